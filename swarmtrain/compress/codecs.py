"""Tensor codecs: one small interface, a few implementations, a registry by name.

A codec turns a float tensor into a flat uint8 payload plus a dict of scalars (`meta`) and
back. `decode` checks meta and the payload size against the shape and dtype the frame
declares before it allocates anything, and raises BadFrameError naming the first problem, so
a hostile or corrupt frame costs no memory.

Payload layouts (little-endian, as torch stores them):
- none / fp16 / bf16: the raw values.
- int8: absmax (fp32, one per block) then q (int8, one per value).
- nf4 / uint4: absmax (fp32, one per block) then packed indices (two per byte, ceil(n / 2)).
"""

from dataclasses import dataclass
from math import prod
from typing import Protocol, runtime_checkable

import torch

from swarmtrain import kernels
from swarmtrain.errors import BadFrameError

Meta = dict[str, int | float | str]

DTYPES_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@runtime_checkable
class Codec(Protocol):
    """Encodes a float tensor into (payload, meta) and back.

    encode(t) -> (payload, meta): payload is a flat contiguous uint8 tensor on t's device,
    meta a dict of scalars to send beside it. decode(payload, meta, shape, dtype) returns a
    tensor of `shape` and `dtype` on payload's device, or raises BadFrameError when meta or
    the payload size do not match (checked before allocating).
    """

    name: str

    def encode(self, t: torch.Tensor) -> tuple[torch.Tensor, Meta]: ...

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor: ...


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _check_frame(
    payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype, name: str
) -> int:
    """Common checks; returns numel."""
    if meta.get("codec") != name:
        raise BadFrameError(f"frame says codec {meta.get('codec')!r}, decoding with {name!r}")
    if dtype not in kernels.FLOAT_DTYPES:
        raise BadFrameError(f"codec {name!r} decodes to float32/float16/bfloat16, frame asks for {dtype}")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise BadFrameError(
            f"payload must be a flat uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}"
        )
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise BadFrameError(f"bad shape {shape!r}")
    numel = prod(shape)
    if meta.get("numel") != numel:
        raise BadFrameError(
            f"meta numel {meta.get('numel')!r} does not match shape {tuple(shape)} ({numel} values)"
        )
    return numel


def _check_size(payload: torch.Tensor, expected: int, name: str, numel: int) -> None:
    if payload.numel() != expected:
        raise BadFrameError(
            f"codec {name!r}: {numel} values need {expected} payload bytes, got {payload.numel()}"
        )


@dataclass(frozen=True)
class CastCodec:
    """Sends the raw values in `wire_dtype` ("none" keeps each tensor's own dtype)."""

    name: str
    wire_dtype: torch.dtype | None = None

    def encode(self, t: torch.Tensor) -> tuple[torch.Tensor, Meta]:
        wire = t if self.wire_dtype is None else t.to(self.wire_dtype)
        if self.wire_dtype is not None:
            kernels.quant_ref.check_input(wire)  # also catches values beyond the fp16 range
        return _as_bytes(wire), {
            "codec": self.name,
            "numel": t.numel(),
            "wire_dtype": _dtype_name(wire.dtype),
        }

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        numel = _check_frame(payload, meta, shape, dtype, self.name)
        wire_dtype = DTYPES_BY_NAME.get(str(meta.get("wire_dtype")))
        if wire_dtype is None or (self.wire_dtype is not None and wire_dtype != self.wire_dtype):
            raise BadFrameError(f"codec {self.name!r}: bad wire dtype {meta.get('wire_dtype')!r}")
        _check_size(payload, numel * wire_dtype.itemsize, self.name, numel)
        return payload.view(wire_dtype).to(dtype).view(shape)


@dataclass(frozen=True)
class Int8Codec:
    """Blockwise absmax int8 (3.94x smaller than fp32 at block 256); max error absmax / 254 per block."""

    block_size: int = kernels.DEFAULT_INT8_BLOCK_SIZE
    name: str = "int8"

    def __post_init__(self):
        kernels.quant_ref.check_block_size(self.block_size)

    def encode(self, t: torch.Tensor) -> tuple[torch.Tensor, Meta]:
        q, absmax = kernels.quantize_int8(t, self.block_size)
        payload = torch.cat((_as_bytes(absmax), _as_bytes(q)))
        return payload, {"codec": self.name, "numel": t.numel(), "block_size": self.block_size}

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        numel = _check_frame(payload, meta, shape, dtype, self.name)
        if meta.get("block_size") != self.block_size:
            raise BadFrameError(
                f"int8 frame has block size {meta.get('block_size')!r}, expected {self.block_size}"
            )
        scale_bytes = 4 * kernels.num_blocks(numel, self.block_size)
        _check_size(payload, scale_bytes + numel, self.name, numel)
        absmax = payload[:scale_bytes].view(torch.float32)
        q = payload[scale_bytes:].view(torch.int8)
        return kernels.dequantize_int8(q, absmax, self.block_size, dtype).view(shape)


@dataclass(frozen=True)
class FourBitCodec:
    """Blockwise absmax 4-bit with an "nf4" or "uint4" code book (7.1x smaller than fp32 at block 64)."""

    name: str = "nf4"
    block_size: int = kernels.DEFAULT_4BIT_BLOCK_SIZE

    def __post_init__(self):
        kernels.quant_ref.check_block_size(self.block_size)
        if self.name not in kernels.CODE_BOOKS:
            raise ValueError(
                f"unknown 4-bit code book {self.name!r}; choose one of {sorted(kernels.CODE_BOOKS)}"
            )

    def encode(self, t: torch.Tensor) -> tuple[torch.Tensor, Meta]:
        packed, absmax = kernels.quantize_4bit(t, self.block_size, code=self.name)
        payload = torch.cat((_as_bytes(absmax), packed))
        return payload, {"codec": self.name, "numel": t.numel(), "block_size": self.block_size}

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        numel = _check_frame(payload, meta, shape, dtype, self.name)
        if meta.get("block_size") != self.block_size:
            raise BadFrameError(
                f"{self.name} frame has block size {meta.get('block_size')!r}, expected {self.block_size}"
            )
        scale_bytes = 4 * kernels.num_blocks(numel, self.block_size)
        _check_size(payload, scale_bytes + (numel + 1) // 2, self.name, numel)
        absmax = payload[:scale_bytes].view(torch.float32)
        out = kernels.dequantize_4bit(
            payload[scale_bytes:], absmax, numel, self.block_size, code=self.name, dtype=dtype
        )
        return out.view(shape)


_CODECS: dict[str, Codec] = {
    "none": CastCodec("none"),
    "fp16": CastCodec("fp16", torch.float16),
    "bf16": CastCodec("bf16", torch.bfloat16),
    "int8": Int8Codec(),
    "nf4": FourBitCodec("nf4"),
    "uint4": FourBitCodec("uint4"),
}


def codec_names() -> list[str]:
    return list(_CODECS)


def get_codec(name: str) -> Codec:
    """The registered codec called `name`; ValueError listing the known names otherwise."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {codec_names()}")
    return _CODECS[name]
