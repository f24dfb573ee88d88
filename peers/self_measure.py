"""What a stage peer measures about itself: its capacity at start-up, its links to other
peers once it has a transport, and the memory it uses while it serves. The figures go into
its DHT record (`PeerRecord.capacity`, `memory_used_bytes`), where planners and the
dashboard read them."""

from __future__ import annotations

import logging
import os

import torch

from swarmtrain.peers.probe import measure_links, probe
from swarmtrain.transport import TensorTransport

logger = logging.getLogger(__name__)

LINK_PROBE_BYTES = 2**18
LINK_PROBE_TIMEOUT_S = 5.0


def capacity(
    device: str, *, seconds: float, is_spot: bool, max_memory_bytes: int | None, slowdown: float
) -> dict:
    """The start-up probe as the capacity a peer announces (see `peers.probe.probe`)."""
    cap = probe(
        device, seconds=seconds, is_spot=is_spot, max_memory_bytes=max_memory_bytes, slowdown=slowdown
    )
    return {
        "flops_per_s": cap.matmul_flops_per_s,
        "memory_bytes": cap.usable_memory_bytes,
        "is_spot": cap.is_spot,
        "device_name": cap.device_name,
        "slowdown": cap.slowdown,
    }


def block_capacity(manifest, device: str, *, slowdown: float = 1.0, dtype: str = "fp32") -> dict:
    """A forward and backward of one block of the run's own model on one of its microbatches,
    timed on `device` in the peer's compute dtype (`dtype`: 'fp32' or 'bf16'; the block runs in
    it, close to what autocast computes) (`measure_block_seconds`), as capacity keys: `block_flops_per_s` (the
    block's traced FLOPs over its measured seconds, divided by `slowdown`) and `block_seconds`.
    The planner prefers this calibrated rate to the matmul probe's (`placement.peer_capacity`):
    small kernels, and everything around them, run far below peak matmul speed. {} when the
    block cannot be timed here (the probe's rate stands)."""
    from swarmtrain.errors import ConfigError
    from swarmtrain.model.tracing import measure_block_seconds

    try:
        timing = measure_block_seconds(
            manifest.model,
            manifest.model_config,
            microbatch_size=manifest.batch.microbatch_size,
            device=device,
            dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
            repeats=5,
            warmup=2,
        )
    except (ConfigError, RuntimeError, ValueError) as e:
        logger.warning(
            "could not time a block of run %s here, planning from the matmul probe: %s", manifest.run_id, e
        )
        return {}
    return {
        "block_flops_per_s": timing.achieved_flops_per_s / slowdown,
        "block_seconds": timing.seconds * slowdown,
    }


async def link_figures(transport: TensorTransport, peers: list[str], run_id: str) -> dict:
    """RTT and bandwidth to `peers` over the real transport: the median bandwidth and the best
    RTT, as capacity keys ({} when no peer answered)."""
    links = await measure_links(
        transport, peers, run_id, payload_bytes=LINK_PROBE_BYTES, timeout_s=LINK_PROBE_TIMEOUT_S
    )
    rates = sorted(v["bandwidth_bytes_per_s"] for v in links.values() if "bandwidth_bytes_per_s" in v)
    if not rates:
        return {}
    return {
        "bandwidth_bytes_per_s": rates[len(rates) // 2],
        "rtt_s": min(v["rtt_s"] for v in links.values() if "rtt_s" in v),
    }


def device_label(device: str) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H200)'."""
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def memory_used_bytes(device: str) -> int:
    """Bytes this process holds on `device` (resident memory for the CPU; 0 if unknown)."""
    if device.startswith("cuda"):
        return int(torch.cuda.memory_allocated(torch.device(device)))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
