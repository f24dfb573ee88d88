"""What this machine can offer the swarm. For now: which torch device `--gpu` names."""

from __future__ import annotations

import torch

from swarmtrain.errors import ConfigError


def resolve_device(gpu: str) -> str:
    """Map a --gpu value ('auto', 'cpu', 'cuda', 'cuda:N') to a torch device string.

    'auto' takes the first CUDA device when there is one, else the CPU. Naming a CUDA
    device this machine does not have raises ConfigError saying what it has.
    """
    gpu = gpu.strip().lower()
    if gpu == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if gpu == "cpu":
        return "cpu"
    if gpu == "cuda":
        gpu = "cuda:0"
    if gpu.startswith("cuda:") and gpu[5:].isdigit():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(gpu[5:])
        if index >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA device (or a CPU-only torch build)"
            raise ConfigError(f"--gpu {gpu}: this machine has {have}; use --gpu auto or --gpu cpu")
        return gpu
    raise ConfigError(f"--gpu {gpu!r} is not a device: use auto, cpu, cuda or cuda:N")
