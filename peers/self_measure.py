"""What a stage peer measures about itself: its capacity at start-up, its links to other
peers once it has a transport, and the memory it uses while it serves. The figures go into
its DHT record (`PeerRecord.capacity`, `memory_used_bytes`), where planners and the
dashboard read them."""

from __future__ import annotations

import os

import torch

from swarmtrain.peers.probe import measure_links, probe
from swarmtrain.transport import TensorTransport

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
