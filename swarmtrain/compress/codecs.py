"""Tensor codecs: one small interface, a few implementations, a registry by name.

A codec turns a float tensor into a flat uint8 payload plus a dict of scalars (`meta`) and
back. `payload_nbytes` checks meta against the shape and dtype the frame declares and says
how many payload bytes they need; `decode` checks the same and the payload's size before it
allocates anything. Both raise BadFrameError naming the first problem, so a hostile or
corrupt frame costs no memory. The interface (`Codec`) lives in swarmtrain.wire.codec;
importing this module registers the codecs there, so frames can carry them.

Payload layouts (little-endian, as torch stores them):
- none / fp16 / bf16: the raw values.
- int8: absmax (fp32, one per block) then q (int8, one per value).
- nf4 / uint4: absmax (fp32, one per block) then packed indices (two per byte, ceil(n / 2)).
- int8-s16 / nf4-s16 / uint4-s16: the same with fp16 scales (meta "scales": "fp16"), rounded
  up (kernels.quant_ref): 3.97x / 7.5x smaller than fp32 instead of 3.94x / 7.1x. A tensor
  with a block absmax beyond 65504 goes with fp32 scales (meta "scales": "fp32") instead.
"""

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch

from swarmtrain import kernels
from swarmtrain.errors import BadFrameError
from swarmtrain.wire.codec import Codec, Meta, register_codec

DTYPES_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _check_meta(meta: Meta, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> int:
    """Checks every codec makes of meta, shape and dtype; returns numel."""
    if not isinstance(meta, dict) or meta.get("codec") != name:
        codec = meta.get("codec") if isinstance(meta, dict) else meta
        raise BadFrameError(f"frame says codec {codec!r}, decoding with {name!r}")
    if dtype not in kernels.FLOAT_DTYPES:
        raise BadFrameError(f"codec {name!r} decodes to float32/float16/bfloat16, frame asks for {dtype}")
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise BadFrameError(f"bad shape {shape!r}")
    numel = prod(shape)
    if type(meta.get("numel")) is not int or meta["numel"] != numel:
        raise BadFrameError(
            f"meta numel {meta.get('numel')!r} does not match shape {tuple(shape)} ({numel} values)"
        )
    return numel


def _check_block_size(meta: Meta, block_size: int, name: str) -> None:
    got = meta.get("block_size")
    if type(got) is not int or got != block_size:
        raise BadFrameError(f"{name} frame has block size {got!r}, expected {block_size}")


def _check_payload(payload: torch.Tensor, expected: int, name: str) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise BadFrameError(
            f"payload must be a flat uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}"
        )
    if payload.numel() != expected:
        raise BadFrameError(f"codec {name!r} needs {expected} payload bytes, got {payload.numel()}")


SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
"""Meta "scales" values of the -s16 codecs."""


def _scale_dtype(meta: Meta, name: str, fp16_scales: bool) -> torch.dtype:
    """The dtype of the block scales a frame's meta declares (fp32 unless an -s16 codec says fp16)."""
    if not fp16_scales:
        if "scales" in meta:
            raise BadFrameError(
                f"{name} frames carry fp32 scales and no 'scales' meta, got {meta['scales']!r}"
            )
        return torch.float32
    got = meta.get("scales")
    if not isinstance(got, str) or got not in SCALE_DTYPES:
        raise BadFrameError(f"{name} frame has scales {got!r}, expected 'fp16' or 'fp32'")
    return SCALE_DTYPES[got]


def _quantize(
    quantize: Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]], fp16_scales: bool
) -> tuple[torch.Tensor, torch.Tensor, Meta]:
    """(data, scales, scale meta) from `quantize(scale_dtype)`: with fp16 scales where they can
    hold every block's absmax, else fp32 (quantizing again)."""
    if not fp16_scales:
        data, scales = quantize(torch.float32)
        return data, scales, {}
    try:
        data, scales = quantize(torch.float16)
    except kernels.ScaleOverflowError:
        data, scales = quantize(torch.float32)
    return data, scales, {"scales": "fp16" if scales.dtype == torch.float16 else "fp32"}


def _block_meta(codec: "Int8Codec | FourBitCodec", numel: int, scale_meta: Meta) -> Meta:
    """What a blockwise codec's frames carry beside the payload."""
    return {"codec": codec.name, "numel": numel, "block_size": codec.block_size, **scale_meta}


def _split_scales(
    payload: torch.Tensor, numel: int, block_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, the rest) of a checked payload."""
    scale_bytes = scale_dtype.itemsize * kernels.num_blocks(numel, block_size)
    return payload[:scale_bytes].view(scale_dtype), payload[scale_bytes:]


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

    def _wire_dtype(self, meta: Meta) -> torch.dtype:
        wire_dtype = (
            DTYPES_BY_NAME.get(meta.get("wire_dtype")) if isinstance(meta.get("wire_dtype"), str) else None
        )
        if wire_dtype is None or (self.wire_dtype is not None and wire_dtype != self.wire_dtype):
            raise BadFrameError(f"codec {self.name!r}: bad wire dtype {meta.get('wire_dtype')!r}")
        return wire_dtype

    def payload_nbytes(self, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = _check_meta(meta, shape, dtype, self.name)
        return numel * self._wire_dtype(meta).itemsize

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        _check_payload(payload, self.payload_nbytes(meta, shape, dtype), self.name)
        return payload.view(self._wire_dtype(meta)).to(dtype).view(shape)


@dataclass(frozen=True)
class Int8Codec:
    """Blockwise absmax int8 (3.94x smaller than fp32 at block 256, 3.97x with fp16 scales); max
    error absmax / 254 per block (with fp16 scales up to 2^-10 more)."""

    block_size: int = kernels.DEFAULT_INT8_BLOCK_SIZE
    name: str = "int8"
    fp16_scales: bool = False

    def __post_init__(self):
        kernels.quant_ref.check_block_size(self.block_size)

    def encode(self, t: torch.Tensor) -> tuple[torch.Tensor, Meta]:
        q, absmax, scale_meta = _quantize(
            lambda scale_dtype: kernels.quantize_int8(t, self.block_size, scale_dtype=scale_dtype),
            self.fp16_scales,
        )
        return torch.cat((_as_bytes(absmax), _as_bytes(q))), _block_meta(self, t.numel(), scale_meta)

    def encode_feedback(self, g: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, Meta]:
        """encode(g + residual) in one fused pass; residual <- g + residual - decoded, in place.

        `residual` is a contiguous fp32 tensor with g.numel() values on g's device.
        """
        q, absmax, scale_meta = _quantize(
            lambda scale_dtype: kernels.quantize_int8_error_feedback(
                g, residual, self.block_size, scale_dtype=scale_dtype
            ),
            self.fp16_scales,
        )
        return torch.cat((_as_bytes(absmax), _as_bytes(q))), _block_meta(self, g.numel(), scale_meta)

    def payload_nbytes(self, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = _check_meta(meta, shape, dtype, self.name)
        _check_block_size(meta, self.block_size, self.name)
        scale_dtype = _scale_dtype(meta, self.name, self.fp16_scales)
        return scale_dtype.itemsize * kernels.num_blocks(numel, self.block_size) + numel

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        _check_payload(payload, self.payload_nbytes(meta, shape, dtype), self.name)
        scale_dtype = _scale_dtype(meta, self.name, self.fp16_scales)
        absmax, q = _split_scales(payload, prod(shape), self.block_size, scale_dtype)
        return kernels.dequantize_int8(q.view(torch.int8), absmax, self.block_size, dtype).view(shape)


@dataclass(frozen=True)
class FourBitCodec:
    """Blockwise absmax 4-bit with an "nf4" or "uint4" code book (7.1x smaller than fp32 at
    block 64, 7.5x with fp16 scales)."""

    name: str = "nf4"
    block_size: int = kernels.DEFAULT_4BIT_BLOCK_SIZE
    code: str = ""
    """Code book; '' means the codec's name."""
    fp16_scales: bool = False

    def __post_init__(self):
        kernels.quant_ref.check_block_size(self.block_size)
        if not self.code:
            object.__setattr__(self, "code", self.name)
        if self.code not in kernels.CODE_BOOKS:
            raise ValueError(
                f"unknown 4-bit code book {self.code!r}; choose one of {sorted(kernels.CODE_BOOKS)}"
            )

    def encode(self, t: torch.Tensor) -> tuple[torch.Tensor, Meta]:
        packed, absmax, scale_meta = _quantize(
            lambda scale_dtype: kernels.quantize_4bit(
                t, self.block_size, code=self.code, scale_dtype=scale_dtype
            ),
            self.fp16_scales,
        )
        return torch.cat((_as_bytes(absmax), packed)), _block_meta(self, t.numel(), scale_meta)

    def payload_nbytes(self, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        numel = _check_meta(meta, shape, dtype, self.name)
        _check_block_size(meta, self.block_size, self.name)
        scale_dtype = _scale_dtype(meta, self.name, self.fp16_scales)
        return scale_dtype.itemsize * kernels.num_blocks(numel, self.block_size) + (numel + 1) // 2

    def decode(
        self, payload: torch.Tensor, meta: Meta, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        _check_payload(payload, self.payload_nbytes(meta, shape, dtype), self.name)
        numel = prod(shape)
        scale_dtype = _scale_dtype(meta, self.name, self.fp16_scales)
        absmax, packed = _split_scales(payload, numel, self.block_size, scale_dtype)
        out = kernels.dequantize_4bit(packed, absmax, numel, self.block_size, code=self.code, dtype=dtype)
        return out.view(shape)


_CODECS: dict[str, Codec] = {
    "none": CastCodec("none"),
    "fp16": CastCodec("fp16", torch.float16),
    "bf16": CastCodec("bf16", torch.bfloat16),
    "int8": Int8Codec(),
    "nf4": FourBitCodec("nf4"),
    "uint4": FourBitCodec("uint4"),
    "int8-s16": Int8Codec(name="int8-s16", fp16_scales=True),
    "nf4-s16": FourBitCodec("nf4-s16", code="nf4", fp16_scales=True),
    "uint4-s16": FourBitCodec("uint4-s16", code="uint4", fp16_scales=True),
}


for _codec in _CODECS.values():
    if _codec.name != "none":  # frames carry raw values themselves
        register_codec(_codec)


def codec_names() -> list[str]:
    """Every codec name, 'none' first."""
    return list(_CODECS)


def get_codec(name: str) -> Codec:
    """The registered codec called `name`; ValueError listing the known names otherwise."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {codec_names()}")
    return _CODECS[name]
