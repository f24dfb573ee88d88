"""Quantized policy copies for rollout peers on small GPUs (bitsandbytes, 8-bit or 4-bit).

A rollout peer holds the whole policy, twice (`swarmtrain.rl.worker`). On a 16 GB card that
is what runs out first, so `join --role rollout --quantize 8bit|4bit` keeps every Linear
layer's weight quantized: `Linear8bitLt` (LLM.int8 with threshold 0: plain absmax int8 rows)
or `Linear4bit` (NF4, computing in the model's dtype). Embeddings, norms and biases stay in
full precision. Each policy version arrives in full precision (`swarmtrain.rl.weights`) and
is quantized as it loads (`load_policy`), into the spare copy, off the sampling path.

Sampling from a quantized copy makes the behaviour log-probs those of a slightly different
policy; GRPO's importance ratio corrects for exactly that, as it does for staleness. bitsandbytes
runs these layers on CUDA and, since 0.45, on the CPU too (slowly for 4-bit), which is what
the tests exercise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from swarmtrain.errors import ConfigError
from swarmtrain.wire.rl_config import QUANTIZE_MODES


def _bnb():
    # bitsandbytes logs a warning at import about optional CPU kernels it does not need here
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ConfigError(f"--quantize needs bitsandbytes, which did not import: {e}") from e
    return bitsandbytes


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in QUANTIZE_MODES:
        raise ConfigError(f"--quantize takes {' or '.join(QUANTIZE_MODES)}, got {mode!r}")


def _quantized_weight(bnb, mode: str, weight: torch.Tensor, device: torch.device) -> nn.Parameter:
    data = weight.detach().to("cpu", torch.float32 if device.type == "cpu" else torch.float16)
    if mode == "8bit":
        param = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
    else:
        param = bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4")
    return param.to(device)  # bitsandbytes quantizes as the parameter moves to its device


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace every `nn.Linear` of `model` (in place) by its bitsandbytes `mode` counterpart
    holding the same weights, quantized. Returns `model`, now for inference only."""
    check_mode(mode)
    bnb = _bnb()
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear or _is_plain_linear(m)]
    for name, linear in targets:
        device = linear.weight.device
        dtype = linear.weight.dtype
        if mode == "8bit":
            q = bnb.nn.Linear8bitLt(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                has_fp16_weights=False,
                threshold=0.0,
                device="meta",
            )
        else:
            q = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=dtype,
                quant_type="nf4",
                device="meta",
            )
        q.weight = _quantized_weight(bnb, mode, linear.weight, device)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        _set_submodule(model, name, q)
    model.requires_grad_(False)
    model.eval()
    return model


def _is_plain_linear(module: nn.Module) -> bool:
    """Subclasses of nn.Linear that add no forward of their own (such as an init marker)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The bitsandbytes layers of `model` by module name (empty for a full-precision model)."""
    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover
        return {}
    kinds = (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def load_policy(model: nn.Module, state: Mapping[str, torch.Tensor], mode: str | None) -> None:
    """Load a full-precision policy `state` (keys as the whole model's state_dict; a subset
    is fine) into `model`, quantizing the weights of its quantized layers as `mode` says."""
    if mode is None:
        model.load_state_dict(dict(state), strict=False)
        return
    bnb = _bnb()
    layers = quantized_layers(model)
    plain: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in state.items():
            owner, _, leaf = key.rpartition(".")
            layer = layers.get(owner)
            if layer is None:
                plain[key] = value
            elif leaf == "weight":
                if tuple(value.shape) != (layer.out_features, layer.in_features):
                    raise ConfigError(
                        f"policy weight {key!r} has shape {tuple(value.shape)}, not "
                        f"{(layer.out_features, layer.in_features)}"
                    )
                layer.weight = _quantized_weight(bnb, mode, value, layer.weight.device)
            elif leaf == "bias":
                layer.bias.copy_(value)
            else:
                raise ConfigError(f"policy tensor {key!r} is not a weight or bias of its layer")
    if plain:
        model.load_state_dict(plain, strict=False)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take on their device (quantized ones as stored)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
