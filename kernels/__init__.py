"""Blockwise quantization kernels: Triton on CUDA tensors, the torch reference on CPU tensors.

Importing this package never imports triton; the Triton module loads on the first CUDA call.
All functions take any-shaped float32/float16/bfloat16 tensors, work on the flattened values
and return flat tensors (callers reshape). inf/NaN input raises ValueError; empty and
all-zero tensors are fine; numel need not be a multiple of the block size. Scales are fp32 or,
with `scale_dtype=torch.float16`, fp16 (rounded up; quant_ref explains the trade).

    q, absmax = quantize_int8(x, block_size=256)
    x_hat = dequantize_int8(q, absmax, block_size=256).view_as(x)
"""

from types import ModuleType

import torch

from . import quant_ref
from .quant_ref import (
    CODE_BOOKS,
    FLOAT_DTYPES,
    FP16_MAX,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    SCALE_DTYPES,
    ScaleOverflowError,
    code_book,
    num_blocks,
)

DEFAULT_INT8_BLOCK_SIZE = 256  # 4 scale bytes per 256 values: 3.94x smaller than fp32
DEFAULT_4BIT_BLOCK_SIZE = 64  # as bitsandbytes' quantize_4bit: 7.1x smaller than fp32

__all__ = [
    "CODE_BOOKS",
    "DEFAULT_4BIT_BLOCK_SIZE",
    "DEFAULT_INT8_BLOCK_SIZE",
    "FLOAT_DTYPES",
    "FP16_MAX",
    "MAX_BLOCK_SIZE",
    "MIN_BLOCK_SIZE",
    "SCALE_DTYPES",
    "ScaleOverflowError",
    "code_book",
    "dequantize_4bit",
    "dequantize_int8",
    "num_blocks",
    "quantize_4bit",
    "quantize_int8",
    "quantize_int8_error_feedback",
]


def _backend(t: torch.Tensor) -> ModuleType:
    if t.is_cuda:
        from . import quant_triton

        return quant_triton
    return quant_ref


def quantize_int8(
    x: torch.Tensor,
    block_size: int = DEFAULT_INT8_BLOCK_SIZE,
    *,
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 with x.numel() values, absmax `scale_dtype` (fp32 or fp16) with one value
    per block); ScaleOverflowError if fp16 scales cannot hold a block's absmax."""
    return _backend(x).quantize_int8(x, block_size, stochastic=stochastic, seed=seed, scale_dtype=scale_dtype)


def dequantize_int8(
    q: torch.Tensor,
    absmax: torch.Tensor,
    block_size: int = DEFAULT_INT8_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Returns a flat `dtype` tensor with q.numel() values; ValueError if absmax has the wrong length."""
    return _backend(q).dequantize_int8(q, absmax, block_size, dtype)


def quantize_4bit(
    x: torch.Tensor,
    block_size: int = DEFAULT_4BIT_BLOCK_SIZE,
    *,
    code: str = "nf4",
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (packed uint8 with ceil(numel / 2) bytes, absmax `scale_dtype` per block); code is
    "nf4" or "uint4"."""
    return _backend(x).quantize_4bit(
        x, block_size, code=code, stochastic=stochastic, seed=seed, scale_dtype=scale_dtype
    )


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    numel: int,
    block_size: int = DEFAULT_4BIT_BLOCK_SIZE,
    *,
    code: str = "nf4",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Returns a flat `dtype` tensor with `numel` values; ValueError if the sizes disagree."""
    return _backend(packed).dequantize_4bit(packed, absmax, numel, block_size, code=code, dtype=dtype)


def quantize_int8_error_feedback(
    g: torch.Tensor,
    residual: torch.Tensor,
    block_size: int = DEFAULT_INT8_BLOCK_SIZE,
    *,
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q = quant(g + residual); residual <- g + residual - dequant(q), in place.

    The caller keeps one contiguous fp32 residual per gradient tensor (zeros at the start, on
    g's device) and passes it every step; the sum of what was sent then trails the sum of the
    gradients by exactly the current residual, at most absmax / 254 per value.
    """
    return _backend(g).quantize_int8_error_feedback(
        g, residual, block_size, stochastic=stochastic, seed=seed, scale_dtype=scale_dtype
    )
