"""The 'auto' codec policy: which codec a link should use, from its bandwidth and the tensor size.

Pure functions of plain numbers. Compression pays when the transfer time it saves exceeds
what encoding and decoding cost, so:

| link (measured bytes/s)         | codec | why                                                     |
|---------------------------------|-------|---------------------------------------------------------|
| >= 1 GB/s (datacenter, NVLink)  | none  | an fp32 MiB crosses in < 1 ms: nothing to save          |
| >= 200 MB/s (fast LAN)          | fp16  | halves the bytes; loss as fp32 (convergence.py)         |
| >= 2.5 MB/s (20 Mbit/s and up)  | int8  | 3.9x smaller; loss within 0.1% of fp32 (convergence.py) |
| below                           | nf4   | 7.1x smaller; ~1.5% higher loss after 150 steps         |

(convergence.py, tiny-gpt in 3 stages: the 4-bit loss comes from the activations; 4-bit
gradients with int8 activations matched fp32 within 0.1%.)

and whatever the link, a tensor that would cross in under MIN_TRANSFER_S uncompressed goes
as it is (a few KiB: header, latency and the codec's own cost dominate).
"""

from __future__ import annotations

FAST_LINK_BYTES_PER_S = 1e9
"""At and above this, tensors go uncompressed."""
FP16_LINK_BYTES_PER_S = 2e8
"""At and above this (below FAST_LINK), fp16."""
INT8_LINK_BYTES_PER_S = 2.5e6
"""At and above this (below FP16_LINK), blockwise int8; below it, nf4."""
MIN_TRANSFER_S = 1e-3
"""A tensor whose uncompressed transfer takes less than this is sent as it is."""
UNKNOWN_LINK_CODEC = "int8"
"""'auto' before the link was measured: safe on any link slower than a LAN."""


def choose_codec(bandwidth_bytes_per_s: float, tensor_bytes: int) -> str:
    """The codec for sending `tensor_bytes` (uncompressed) over a link of the given bandwidth."""
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth_bytes_per_s}")
    if tensor_bytes < 0:
        raise ValueError(f"tensor size must be >= 0 bytes, got {tensor_bytes}")
    if (
        bandwidth_bytes_per_s >= FAST_LINK_BYTES_PER_S
        or tensor_bytes / bandwidth_bytes_per_s < MIN_TRANSFER_S
    ):
        return "none"
    if bandwidth_bytes_per_s >= FP16_LINK_BYTES_PER_S:
        return "fp16"
    if bandwidth_bytes_per_s >= INT8_LINK_BYTES_PER_S:
        return "int8"
    return "nf4"


def resolve_codec(setting: str, bandwidth_bytes_per_s: float | None, tensor_bytes: int) -> str:
    """A manifest setting made concrete: `setting` itself, or for 'auto' choose_codec (or
    UNKNOWN_LINK_CODEC while the link's bandwidth is unknown, None)."""
    if setting != "auto":
        return setting
    if bandwidth_bytes_per_s is None:
        return UNKNOWN_LINK_CODEC
    return choose_codec(bandwidth_bytes_per_s, tensor_bytes)
