"""Triton kernels for the blockwise quantizers in quant_ref.py, plus thin launchers.

Each program handles ROWS consecutive blocks of BLOCK values as one (ROWS, BLOCK) tile.
Launchers take the same arguments and return the same tensors as quant_ref; they run on CUDA
tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before `import triton`.
Stochastic rounding draws from Philox (`tl.rand(seed, offset)`), not torch's generator.
"""

import os

import torch
import triton
import triton.language as tl

from .quant_ref import (
    FP16_MAX,
    INT8_MAX,
    check_block_size,
    check_dtype,
    check_finite,
    check_input,
    check_scale_dtype,
    code_book,
    code_midpoints,
    num_blocks,
    raise_scale_overflow,
)

# Values per program. The interpreter pays per program instance (256-value programs ~20x
# slower than 4096), so it gets huge tiles. On a GPU, 2048 values over 8 warps is 8 a thread:
# 16-byte vector loads of fp32 and at most 74 registers in every variant on sm_90, where 4096
# over 4 warps needed up to 186 (fewer resident warps to hide memory latency). See
# `python -m swarmtrain.kernels.aot`; the speed itself is for benchmarks/codecs.py on a GPU.
TILE_VALUES_GPU = 2048
TILE_VALUES_INTERPRET = 65536
NUM_WARPS = 8
NUM_LEVELS_4BIT = 16

# Kernels may only read globals wrapped in tl.constexpr.
_Q_MAX = tl.constexpr(float(INT8_MAX))
_INF = tl.constexpr(float("inf"))

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _rows_per_program(block_size: int) -> int:
    tile = TILE_VALUES_INTERPRET if _INTERPRET else TILE_VALUES_GPU
    return max(1, tile // block_size)


@triton.jit
def _inf_if_nan(absmax, v):
    # GPU max reductions may drop NaN: mark the block inf so the launcher rejects the input.
    has_nan = tl.max((v != v).to(tl.int32), axis=1) > 0
    return tl.where(has_nan, _INF, absmax)


@triton.jit
def _round_scale(absmax, SCALE_FP16: tl.constexpr):
    # fp16 scales: absmax rounded up to the next fp16 value (quant_ref.round_scales), in fp32.
    if SCALE_FP16:
        s = absmax.to(tl.float16)
        up = (s.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
        absmax = tl.where(s.to(tl.float32) < absmax, up, s).to(tl.float32)
    return absmax


@triton.jit
def _int8_quant_kernel(
    x_ptr, r_ptr, q_ptr, absmax_ptr, n, n_blocks, seed,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, STOCHASTIC: tl.constexpr, FEEDBACK: tl.constexpr,
    SCALE_FP16: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FEEDBACK:
        v += tl.load(r_ptr + offs, mask=mask, other=0.0)
    absmax = _round_scale(_inf_if_nan(tl.max(tl.abs(v), axis=1), v), SCALE_FP16)  # (ROWS,)
    nonzero = absmax > 0
    inv = tl.where(nonzero, _Q_MAX / tl.where(nonzero, absmax, 1.0), 0.0)
    y = v * inv[:, None]
    if STOCHASTIC:
        y += tl.rand(seed, offs)
    else:
        y += 0.5
    q = tl.minimum(tl.maximum(tl.floor(y), -_Q_MAX), _Q_MAX)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(absmax_ptr + row, absmax.to(absmax_ptr.dtype.element_ty), mask=row < n_blocks)
    if FEEDBACK:
        tl.store(r_ptr + offs, v - q * (absmax / _Q_MAX)[:, None], mask=mask)


@triton.jit
def _int8_dequant_kernel(q_ptr, absmax_ptr, out_ptr, n, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    absmax = tl.load(absmax_ptr + row, mask=row < n_blocks, other=0.0)
    out = q * (absmax / _Q_MAX)[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nearest_index(xn, mid_ptr, NUM_LEVELS: tl.constexpr):
    idx = tl.zeros(xn.shape, dtype=tl.int32)
    for k in tl.static_range(NUM_LEVELS - 1):
        idx += (xn > tl.load(mid_ptr + k)).to(tl.int32)
    return idx


@triton.jit
def _stochastic_index(xn, code_ptr, u, NUM_LEVELS: tl.constexpr):
    lo = tl.zeros(xn.shape, dtype=tl.int32)
    for k in tl.static_range(1, NUM_LEVELS):
        lo += (xn >= tl.load(code_ptr + k)).to(tl.int32)
    lo = tl.minimum(lo, NUM_LEVELS - 2)
    c_lo = tl.load(code_ptr + lo)
    c_hi = tl.load(code_ptr + lo + 1)
    return lo + (u < (xn - c_lo) / (c_hi - c_lo)).to(tl.int32)


@triton.jit
def _4bit_quant_kernel(
    x_ptr, code_ptr, mid_ptr, packed_ptr, absmax_ptr, n, n_bytes, n_blocks, seed,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, STOCHASTIC: tl.constexpr, NUM_LEVELS: tl.constexpr,
    SCALE_FP16: tl.constexpr,
):  # fmt: skip
    # Values load as one contiguous (ROWS, BLOCK) tile (vector loads) and their indices pair up
    # in registers; loading even and odd values apart would make every access stride-2.
    HALF: tl.constexpr = BLOCK // 2
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    absmax = _round_scale(_inf_if_nan(tl.max(tl.abs(x), axis=1), x), SCALE_FP16)  # (ROWS,)
    nonzero = absmax > 0
    xn = x * tl.where(nonzero, 1.0 / tl.where(nonzero, absmax, 1.0), 0.0)[:, None]
    if STOCHASTIC:
        idx = _stochastic_index(xn, code_ptr, tl.rand(seed, offs), NUM_LEVELS)
    else:
        idx = _nearest_index(xn, mid_ptr, NUM_LEVELS)
    i_even, i_odd = tl.split(tl.reshape(idx, (ROWS, HALF, 2)))  # (ROWS, HALF) each
    pair = row[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (ROWS, HALF): byte index
    # n_bytes = ceil(n / 2) comes as an argument: a mask from `2 * pair < n` would stop Triton
    # from proving it constant over a thread's bytes, and split the store into single bytes.
    tl.store(packed_ptr + pair, (i_even | (i_odd << 4)).to(tl.uint8), mask=pair < n_bytes)
    tl.store(absmax_ptr + row, absmax.to(absmax_ptr.dtype.element_ty), mask=row < n_blocks)


@triton.jit
def _4bit_dequant_kernel(
    packed_ptr, code_ptr, absmax_ptr, out_ptr, n, n_bytes, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    HALF: tl.constexpr = BLOCK // 2
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    pair = row[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (ROWS, HALF)
    p = tl.load(packed_ptr + pair, mask=pair < n_bytes, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + row, mask=row < n_blocks, other=0.0)[:, None]
    out_even = tl.load(code_ptr + (p & 0xF)) * absmax
    out_odd = tl.load(code_ptr + (p >> 4)) * absmax
    out = tl.reshape(tl.join(out_even, out_odd), (ROWS, BLOCK))  # values 2j, 2j + 1 side by side
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=offs < n)


def _grid(n_blocks: int, rows: int) -> tuple[int]:
    return (max(1, triton.cdiv(n_blocks, rows)),)


def _launch_int8(x, residual, block_size, stochastic, seed, scale_dtype):
    n = x.numel()
    nb = num_blocks(n, block_size)
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    absmax = torch.empty(nb, dtype=scale_dtype, device=x.device)
    if n:
        rows = _rows_per_program(block_size)
        feedback = residual is not None
        _int8_quant_kernel[_grid(nb, rows)](
            x.reshape(-1).contiguous(), residual if feedback else x, q, absmax, n, nb, seed,
            BLOCK=block_size, ROWS=rows, STOCHASTIC=stochastic, FEEDBACK=feedback,
            SCALE_FP16=scale_dtype == torch.float16, num_warps=NUM_WARPS,
        )  # fmt: skip
    return q, absmax


def quantize_int8(
    x: torch.Tensor,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_block_size(block_size)
    check_dtype(x)
    check_scale_dtype(scale_dtype)
    q, absmax = _launch_int8(x, None, block_size, stochastic, seed, scale_dtype)
    check_finite(absmax, x)
    return q, absmax


def quantize_int8_error_feedback(
    g: torch.Tensor,
    residual: torch.Tensor,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_block_size(block_size)
    check_scale_dtype(scale_dtype)
    check_input(g)  # a full pass first: the kernel writes the residual as it goes
    if residual.dtype != torch.float32 or residual.numel() != g.numel() or not residual.is_contiguous():
        raise ValueError(
            f"residual must be a contiguous float32 tensor with {g.numel()} values, "
            f"got {residual.dtype} with {residual.numel()}"
        )
    if scale_dtype == torch.float16 and g.numel():
        v = g.reshape(-1).float() + residual.view(-1)  # the same bound, before the residual changes
        if float(v.abs().max()) > FP16_MAX:
            raise_scale_overflow(v)
    return _launch_int8(g, residual, block_size, stochastic, seed, scale_dtype)


def dequantize_int8(
    q: torch.Tensor, absmax: torch.Tensor, block_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    check_block_size(block_size)
    n = q.numel()
    nb = num_blocks(n, block_size)
    if absmax.numel() != nb:
        raise ValueError(f"{n} values in blocks of {block_size} need {nb} scales, got {absmax.numel()}")
    out = torch.empty(n, dtype=dtype, device=q.device)
    if n:
        rows = _rows_per_program(block_size)
        _int8_dequant_kernel[_grid(nb, rows)](
            q.reshape(-1).contiguous(), absmax.float().contiguous(), out, n, nb,
            BLOCK=block_size, ROWS=rows, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


def quantize_4bit(
    x: torch.Tensor,
    block_size: int,
    *,
    code: str = "nf4",
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_block_size(block_size)
    check_dtype(x)
    check_scale_dtype(scale_dtype)
    n = x.numel()
    nb = num_blocks(n, block_size)
    levels = code_book(code, x.device)
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(nb, dtype=scale_dtype, device=x.device)
    if n:
        rows = _rows_per_program(block_size)
        _4bit_quant_kernel[_grid(nb, rows)](
            x.reshape(-1).contiguous(), levels, code_midpoints(levels), packed, absmax, n, (n + 1) // 2, nb, seed,
            BLOCK=block_size, ROWS=rows, STOCHASTIC=stochastic, NUM_LEVELS=NUM_LEVELS_4BIT,
            SCALE_FP16=scale_dtype == torch.float16, num_warps=NUM_WARPS,
        )  # fmt: skip
    check_finite(absmax, x)
    return packed, absmax


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    numel: int,
    block_size: int,
    *,
    code: str = "nf4",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    check_block_size(block_size)
    nb = num_blocks(numel, block_size)
    if absmax.numel() != nb or packed.numel() != (numel + 1) // 2:
        raise ValueError(
            f"{numel} values in blocks of {block_size} need {nb} scales and {(numel + 1) // 2} bytes, "
            f"got {absmax.numel()} and {packed.numel()}"
        )
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel:
        rows = _rows_per_program(block_size)
        _4bit_dequant_kernel[_grid(nb, rows)](
            packed.reshape(-1).contiguous(), code_book(code, packed.device), absmax.float().contiguous(),
            out, numel, (numel + 1) // 2, nb, BLOCK=block_size, ROWS=rows, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out
