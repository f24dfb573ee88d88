"""GPU profiles from public specifications, and the links between regions.

`flops_per_s` is the dense 16-bit tensor rate of the datasheet (fp32 for the CPU) times
`MFU`, the fraction a training step achieves; `memory_bytes` the card's memory. A scenario
may override either, or calibrate per-block seconds from a measured run (`Scenario.block_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

MFU = 0.4
"""Fraction of the datasheet rate a transformer training step achieves (typical 0.3-0.5)."""


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    name: str
    peak_flops_per_s: float
    """Dense bf16/fp16 tensor FLOP/s of the datasheet (fp32 for 'cpu')."""
    memory_bytes: float
    bandwidth_bytes_per_s: float
    """Typical network bandwidth of a machine with this card (both directions)."""

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops_per_s * MFU


GB = 1e9
PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        # datacenter cards: cloud machines, 10 Gbit/s links (1.25 GB/s)
        GpuProfile(name="h100", peak_flops_per_s=989e12, memory_bytes=80 * GB, bandwidth_bytes_per_s=1.25e9),
        GpuProfile(name="a100", peak_flops_per_s=312e12, memory_bytes=80 * GB, bandwidth_bytes_per_s=1.25e9),
        # consumer cards (fp16 with fp32 accumulate) and the T4: home or spot links, 1 Gbit/s to 100 Mbit/s
        GpuProfile(name="4090", peak_flops_per_s=165e12, memory_bytes=24 * GB, bandwidth_bytes_per_s=125e6),
        GpuProfile(name="3090", peak_flops_per_s=71e12, memory_bytes=24 * GB, bandwidth_bytes_per_s=125e6),
        GpuProfile(name="t4", peak_flops_per_s=65e12, memory_bytes=16 * GB, bandwidth_bytes_per_s=12.5e6),
        GpuProfile(name="cpu", peak_flops_per_s=2e12, memory_bytes=64 * GB, bandwidth_bytes_per_s=12.5e6),
    )
}

REGIONS = ("us", "eu", "asia")
RTT_S = {
    ("us", "us"): 0.02,
    ("eu", "eu"): 0.02,
    ("asia", "asia"): 0.03,
    ("eu", "us"): 0.09,
    ("asia", "us"): 0.16,
    ("asia", "eu"): 0.2,
}
"""Round-trip seconds between regions (public inter-region measurements, rounded)."""


def rtt_s(a: str, b: str) -> float:
    return RTT_S[(a, b) if (a, b) in RTT_S else (b, a)]


def profile(name: str) -> GpuProfile:
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU profile {name!r}: use one of {', '.join(PROFILES)}") from None
