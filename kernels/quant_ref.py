"""Torch reference for the blockwise quantizers: the CPU path, and what the Triton kernels are tested against.

Every quantizer works on the flattened tensor cut into blocks of `block_size` values, one
absmax per block (the last block is zero-padded internally; outputs keep the original numel):

- int8:  q = round(x * 127 / absmax) in [-127, 127];  x' = q * absmax / 127.
- 4-bit: idx = nearest entry of a 16-value code book in [-1, 1] to x / absmax, two indices a
  byte (element 2j in the low nibble, 2j + 1 in the high one); x' = code[idx] * absmax.
- error feedback (int8): v = g + residual; q = quant(v); residual <- v - dequant(q).

Scales (absmax) are fp32, or fp16 with `scale_dtype=torch.float16`: half the scale bytes
(4-bit at block 64 goes from 7.1x to 7.5x smaller than fp32). An fp16 scale is the block's
absmax rounded *up* to the next fp16 value before anything is quantized, so every value still
fits and dequantizing with the stored scale is exact arithmetic; the cost is a step up to
2^-10 coarser (more for blocks whose absmax is below 2^-14, where fp16 is subnormal). A block
whose absmax exceeds 65504 has no fp16 scale: ScaleOverflowError (a ValueError), and the
caller sends fp32 scales instead.

Stochastic rounding rounds up with probability equal to the distance to the lower level, so
E[x'] = x. The reference draws from a seeded `torch.Generator`; the Triton kernels draw from
Philox (`tl.rand`), so the two backends agree in distribution, not bit for bit.
"""

import torch

INT8_MAX = 127
MIN_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 4096
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float32, torch.float16)
FP16_MAX = 65504.0
"""The largest finite fp16 value: the largest block absmax fp16 scales can hold."""


class ScaleOverflowError(ValueError):
    """A block's absmax is beyond what the scale dtype holds (fp16: 65504); the input is finite."""


# NF4 (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) scaled to [-1, 1], exact zero at index 7.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# Symmetric int4 on [-7, 7] / 7 with an exact zero; index 0 (-8/7) lies outside [-1, 1] and is never chosen.
UNIFORM4_CODE = tuple((i - 8) / 7 for i in range(16))
CODE_BOOKS = {"nf4": NF4_CODE, "uint4": UNIFORM4_CODE}


def check_block_size(block_size: int) -> None:
    """Raise ValueError unless block_size is a power of two in [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]."""
    if not (MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE) or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}"
        )


def check_dtype(x: torch.Tensor) -> None:
    """Raise ValueError for anything but float32/float16/bfloat16."""
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantizers take float32/float16/bfloat16 tensors, got {x.dtype}")


def check_scale_dtype(scale_dtype: torch.dtype) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scales are float32 or float16, got {scale_dtype}")


def check_finite(absmax: torch.Tensor, x: torch.Tensor) -> None:
    """Raise ValueError if x held inf/NaN, judged from its block absmax (NaN and inf propagate
    there); ScaleOverflowError if x is finite but an fp16 scale overflowed."""
    if absmax.numel() and not bool(torch.isfinite(absmax).all()):
        num_bad = int((~torch.isfinite(x)).sum())
        if num_bad == 0:
            raise_scale_overflow(x)
        raise ValueError(
            f"cannot quantize a tensor holding {num_bad} inf/NaN value(s) out of {x.numel()}; "
            "check the loss scale or clip before compressing"
        )


def check_input(x: torch.Tensor) -> None:
    """check_dtype, then a full pass for inf/NaN (for callers that must not write anything first)."""
    check_dtype(x)
    if x.numel() and not bool(torch.isfinite(x).all()):
        check_finite(torch.tensor([float("nan")]), x)


def raise_scale_overflow(x: torch.Tensor) -> None:
    raise ScaleOverflowError(
        f"a block's largest |value| is {float(x.abs().max()):.6g}, beyond 65504, the largest fp16 scale: "
        "send this tensor with fp32 scales"
    )


def round_scales(absmax: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp32 absmax to quantize with, the scales to store): for fp16, absmax rounded up to
    the next fp16 value (by one step of its bit pattern, which works for subnormals too)."""
    if scale_dtype == torch.float32:
        return absmax, absmax
    s = absmax.to(torch.float16)
    up = (s.view(torch.int16) + 1).view(torch.float16)
    s = torch.where(s.to(torch.float32) < absmax, up, s)
    return s.to(torch.float32), s


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def code_book(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 sorted fp32 levels of a 4-bit code book ("nf4" or "uint4")."""
    if name not in CODE_BOOKS:
        raise ValueError(f"unknown 4-bit code book {name!r}; choose one of {sorted(CODE_BOOKS)}")
    return torch.tensor(CODE_BOOKS[name], dtype=torch.float32, device=device)


def code_midpoints(code: torch.Tensor) -> torch.Tensor:
    """The 15 decision thresholds between neighbouring levels (nearest rounding)."""
    return (code[:-1] + code[1:]) * 0.5


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flatten to fp32 and zero-pad to whole blocks: (num_blocks, block_size)."""
    flat = x.reshape(-1).to(torch.float32)
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)  # (NB, B)


def _uniform(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


def _int8_from_blocks(
    v: torch.Tensor, stochastic: bool, seed: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, the fp32 absmax quantized with, the scales to store)."""
    absmax, scales = round_scales(_absmax(v), scale_dtype)  # (NB,)
    inv = torch.where(absmax > 0, INT8_MAX / torch.where(absmax > 0, absmax, 1.0), 0.0)
    y = v * inv[:, None]  # (NB, B) in [-127, 127]
    y.add_(_uniform(y.shape, seed, y.device) if stochastic else 0.5)
    q = y.floor_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, absmax, scales


def _absmax(v: torch.Tensor) -> torch.Tensor:
    """Each row's largest |value| (NaN if it holds one). Not torch.aminmax: it saves the |v|
    temporary but runs at 1.5 GB/s where abs().amax runs at 14 on cache-sized tensors."""
    return v.abs().amax(dim=1)


def _int8_dequant_blocks(q: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    out = q.to(torch.float32)  # (NB, B); scaled in place: one allocation (2x faster on 64M values)
    return out.mul_((absmax / INT8_MAX)[:, None])


def quantize_int8(
    x: torch.Tensor,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8. Returns (q int8 of x.numel(), absmax `scale_dtype` of num_blocks)."""
    check_block_size(block_size)
    check_dtype(x)
    check_scale_dtype(scale_dtype)
    n = x.numel()
    q, _, scales = _int8_from_blocks(_blocks(x, block_size), stochastic, seed, scale_dtype)
    check_finite(scales, x)
    return q.view(-1)[:n].contiguous(), scales


def dequantize_int8(
    q: torch.Tensor, absmax: torch.Tensor, block_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_int8: a flat tensor of q.numel() values in `dtype`."""
    check_block_size(block_size)
    n = q.numel()
    if absmax.numel() != num_blocks(n, block_size):
        raise ValueError(
            f"{n} values in blocks of {block_size} need {num_blocks(n, block_size)} scales, got {absmax.numel()}"
        )
    out = torch.empty(absmax.numel() * block_size, dtype=torch.float32, device=q.device)
    out[:n] = q.reshape(-1)  # converted as it is copied
    out[n:] = 0  # the last block's padding
    out.view(-1, block_size).mul_((absmax.to(torch.float32) / INT8_MAX)[:, None])
    return out[:n].to(dtype)


def quantize_4bit(
    x: torch.Tensor,
    block_size: int,
    *,
    code: str = "nf4",
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax 4-bit. Returns (packed uint8 of ceil(numel / 2), absmax `scale_dtype` of num_blocks)."""
    check_block_size(block_size)
    check_dtype(x)
    check_scale_dtype(scale_dtype)
    n = x.numel()
    levels = code_book(code, x.device)
    v = _blocks(x, block_size)  # (NB, B)
    absmax, scales = round_scales(_absmax(v), scale_dtype)
    check_finite(scales, x)
    inv = torch.where(absmax > 0, 1.0 / torch.where(absmax > 0, absmax, 1.0), 0.0)
    xn = v * inv[:, None]  # (NB, B) in [-1, 1]
    if stochastic:
        lo = torch.bucketize(xn, levels[1:], right=True).clamp_(max=14)  # levels[lo] <= xn < levels[lo + 1]
        c_lo, c_hi = levels[lo], levels[lo + 1]
        p_up = (xn - c_lo) / (c_hi - c_lo)
        idx = lo + (_uniform(xn.shape, seed, xn.device) < p_up).to(lo.dtype)
    else:
        idx = torch.bucketize(xn, code_midpoints(levels))  # number of thresholds strictly below xn
    idx = idx.to(torch.uint8).view(-1, 2)  # (NB * B / 2, 2): even, odd
    packed = idx[:, 0] | (idx[:, 1] << 4)
    return packed[: (n + 1) // 2].contiguous(), scales


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    numel: int,
    block_size: int,
    *,
    code: str = "nf4",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of quantize_4bit: a flat tensor of `numel` values in `dtype`."""
    check_block_size(block_size)
    nb = num_blocks(numel, block_size)
    if absmax.numel() != nb or packed.numel() != (numel + 1) // 2:
        raise ValueError(
            f"{numel} values in blocks of {block_size} need {nb} scales and {(numel + 1) // 2} bytes, "
            f"got {absmax.numel()} and {packed.numel()}"
        )
    levels = code_book(code, packed.device)
    byte = torch.arange(256, device=packed.device)
    pair_values = torch.stack((levels[byte & 0xF], levels[byte >> 4]), dim=1)  # (256, 2): one row per byte
    pad = nb * block_size // 2 - packed.numel()
    p = torch.nn.functional.pad(packed.reshape(-1), (0, pad)) if pad else packed.reshape(-1)
    out = pair_values.index_select(0, p.int()).view(nb, block_size)  # (NB, B); 3x faster than indexing
    out.mul_(absmax.to(torch.float32)[:, None])
    return out.view(-1)[:numel].to(dtype)


def quantize_int8_error_feedback(
    g: torch.Tensor,
    residual: torch.Tensor,
    block_size: int,
    *,
    stochastic: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q = quant(g + residual); residual <- g + residual - dequant(q), updated in place.

    `residual` is an fp32 tensor with g.numel() values (start it at zeros), one per gradient
    tensor, kept by the caller across steps. Returns (q int8, absmax) like quantize_int8.
    """
    check_block_size(block_size)
    check_dtype(g)
    check_scale_dtype(scale_dtype)
    if residual.dtype != torch.float32 or residual.numel() != g.numel():
        raise ValueError(
            f"residual must be float32 with {g.numel()} values, got {residual.dtype} with {residual.numel()}"
        )
    n = g.numel()
    v = _blocks(g, block_size) + _blocks(residual, block_size)  # (NB, B)
    q, absmax, scales = _int8_from_blocks(v, stochastic, seed, scale_dtype)
    if not bool(torch.isfinite(scales).all()):  # before touching the residual
        if bool(torch.isfinite(g).all()):
            raise_scale_overflow(v)  # g + residual went beyond the fp16 scales
        check_finite(scales, g)
    residual.view(-1).copy_((v - _int8_dequant_blocks(q, absmax)).view(-1)[:n])
    return q.view(-1)[:n].contiguous(), scales
