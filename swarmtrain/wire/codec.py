"""The seam between frames and codecs: what a frame needs of a codec, and a registry by name.

`wire` lies below the codecs (swarmtrain.compress, built on kernels/), so it does not import
them: swarmtrain.compress registers its codecs here when it is imported, and
swarmtrain.transport imports it, so every process that speaks frames over our transport
knows them. Frames carry codec 'none' (raw values) themselves, without the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Protocol, runtime_checkable

import torch

Meta = dict[str, int | float | str]
"""A codec's small per-tensor parameters (codec name, value count, block size...), sent in the header."""


@runtime_checkable
class Codec(Protocol):
    """Encodes a float tensor into (payload, meta) and back.

    encode(t) -> (payload, meta): payload is a flat contiguous uint8 tensor on t's device, meta
    a dict of scalars to send beside it; ValueError for inf/NaN input. payload_nbytes(meta,
    shape, dtype) validates meta against the declared shape and dtype and returns the payload
    size they imply, without allocating. decode(payload, meta, shape, dtype) returns a tensor
    of `shape` and `dtype` on payload's device. Both raise BadFrameError naming the problem.
    """

    name: str

    def encode(self, t: torch.Tensor) -> tuple[torch.Tensor, Meta]: ...

    def payload_nbytes(self, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype) -> int: ...

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class Encoded:
    """A tensor a codec has already encoded; a frame sends its payload as it is.

    Senders put one in `Frame.tensors` when they need the payload themselves (error feedback,
    exact replica sums); the receiver gets the decoded tensor of `shape` and `dtype`.
    """

    codec: str
    """Registered codec name (not 'none')."""
    payload: torch.Tensor
    """Flat uint8 bytes, on any device (frames copy them to the CPU)."""
    meta: Meta
    """What codec.encode returned beside the payload."""
    shape: tuple[int, ...]
    """Shape of the decoded tensor."""
    dtype: torch.dtype
    """Dtype of the decoded tensor."""

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return self.payload.numel()

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the decoded tensor."""
        return prod(self.shape) * self.dtype.itemsize

    def cpu(self) -> Encoded:
        """The same with its payload in CPU memory (what frames send and receivers decode)."""
        return Encoded(
            codec=self.codec, payload=self.payload.cpu(), meta=self.meta, shape=self.shape, dtype=self.dtype
        )


_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec) -> None:
    """Make frames able to send and read tensors encoded with `codec` (by its name)."""
    if codec.name == "none":
        raise ValueError("codec 'none' is built into frames and cannot be registered")
    if not isinstance(codec, Codec):
        raise TypeError(f"{codec!r} does not implement the Codec protocol")
    _REGISTRY[codec.name] = codec


def find_codec(name: str) -> Codec | None:
    """The registered codec called `name`, or None."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def known_codecs() -> list[str]:
    """'none' and every registered codec name."""
    return ["none", *_REGISTRY]
