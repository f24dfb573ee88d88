"""The optimizer a run's `OptimizerConfig` names; every stage builds its own over its own parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from swarmtrain.wire.records import OptimizerConfig


def make_optimizer(params: Iterable[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (lr, betas, weight_decay) or SGD (lr, momentum, weight_decay) over `params`.

    Weight decay applies to every parameter alike (no nanoGPT-style exemption for biases and
    norms), so a stage's update does not depend on how the model was split.
    """
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    assert cfg.name == "sgd", cfg.name  # OptimizerConfig admits only these two
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
