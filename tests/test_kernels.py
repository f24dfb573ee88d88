"""Triton quantization kernels (under TRITON_INTERPRET=1 on CPU tensors) against the torch reference."""

import os
import sys

# Under the interpreter only if the flag is set before triton is first imported (triton builds
# its own tl.* helpers at import). tests/conftest.py sets it on machines without CUDA; run alone,
# this file sets it itself.
_TRITON_USABLE = os.environ.get("TRITON_INTERPRET") == "1" or "triton" not in sys.modules
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from swarmtrain import kernels  # noqa: E402
from swarmtrain.kernels import quant_ref as ref  # noqa: E402
from swarmtrain.kernels import quant_triton as tri  # noqa: E402

needs_triton = pytest.mark.skipif(
    not _TRITON_USABLE,
    reason="triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py",
)
IMPLS = [pytest.param(ref, id="ref"), pytest.param(tri, id="triton", marks=needs_triton)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 63, 1000, 5003]  # none a multiple of the blocks below
CODES = ["nf4", "uint4"]


def _randn(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 3).to(dtype)


def _assert_close_out(a: torch.Tensor, b: torch.Tensor) -> None:
    # The interpreter truncates fp32 -> bf16 where torch (and CUDA) round to nearest: allow one ulp.
    rtol = 2**-7 if a.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=0.0)


def _assert_q_match(q_ref: torch.Tensor, q_tri: torch.Tensor) -> None:
    # Values exactly halfway between two levels may round either way (order of fp32 ops).
    diff = (q_ref.int() - q_tri.int()).abs()
    assert diff.max().item() <= 1 if diff.numel() else True
    assert (diff > 0).float().mean().item() < 1e-2 if diff.numel() else True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@needs_triton
def test_int8_triton_matches_reference(n, dtype):
    x = _randn(n, dtype)
    q_ref, a_ref = ref.quantize_int8(x, 256)
    q_tri, a_tri = tri.quantize_int8(x, 256)
    assert q_tri.shape == (n,) and a_tri.shape == (kernels.num_blocks(n, 256),)
    torch.testing.assert_close(a_tri, a_ref, rtol=0, atol=0)
    _assert_q_match(q_ref, q_tri)
    _assert_close_out(
        tri.dequantize_int8(q_ref, a_ref, 256, dtype), ref.dequantize_int8(q_ref, a_ref, 256, dtype)
    )


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@needs_triton
def test_4bit_triton_matches_reference(n, dtype, code):
    x = _randn(n, dtype, seed=1)
    p_ref, a_ref = ref.quantize_4bit(x, 64, code=code)
    p_tri, a_tri = tri.quantize_4bit(x, 64, code=code)
    assert p_tri.shape == ((n + 1) // 2,)
    torch.testing.assert_close(a_tri, a_ref, rtol=0, atol=0)
    assert (p_ref != p_tri).float().mean().item() < 1e-2  # halfway ties only
    out_ref = ref.dequantize_4bit(p_ref, a_ref, n, 64, code=code, dtype=dtype)
    _assert_close_out(tri.dequantize_4bit(p_ref, a_ref, n, 64, code=code, dtype=dtype), out_ref)


@pytest.mark.parametrize("block_size", [64, 1024, 4096])
@pytest.mark.parametrize("impl", IMPLS)
def test_int8_error_bound(impl, block_size):
    x = _randn(10_007, torch.float32, seed=2)
    q, absmax = impl.quantize_int8(x, block_size)
    err = (impl.dequantize_int8(q, absmax, block_size) - x).abs()
    bound = (absmax / 127 / 2 + 1e-6).repeat_interleave(block_size)[: x.numel()]  # absmax / 254 per block
    assert bool((err <= bound).all())
    torch.testing.assert_close(absmax, ref._blocks(x, block_size).abs().amax(1))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_zero(impl):
    for fn, args in [(impl.quantize_int8, ()), (impl.quantize_4bit, ())]:
        q, absmax = fn(torch.empty(0), 256, *args)
        assert q.numel() == 0 and absmax.numel() == 0
    z = torch.zeros(300, dtype=torch.float16)
    q, absmax = impl.quantize_int8(z, 256)
    assert not q.any() and not absmax.any()
    assert not impl.dequantize_int8(q, absmax, 256).any()
    p, absmax = impl.quantize_4bit(z, 64, code="uint4", stochastic=True, seed=1)
    assert not impl.dequantize_4bit(p, absmax, 300, 64, code="uint4").any()
    assert impl.dequantize_4bit(torch.empty(0, dtype=torch.uint8), torch.empty(0), 0, 64).numel() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_input_raises(impl, bad):
    x = torch.randn(500)
    x[123] = bad
    with pytest.raises(ValueError, match="inf/NaN"):
        impl.quantize_int8(x, 256)
    with pytest.raises(ValueError, match="inf/NaN"):
        impl.quantize_4bit(x, 64)
    with pytest.raises(ValueError, match="inf/NaN"):
        impl.quantize_int8_error_feedback(x, torch.zeros(500), 256)


def test_bad_block_size_and_dtype_raise():
    with pytest.raises(ValueError, match="power of two"):
        kernels.quantize_int8(torch.randn(10), 100)
    with pytest.raises(ValueError, match="power of two"):
        kernels.quantize_4bit(torch.randn(10), 8192)
    with pytest.raises(ValueError, match="float32"):
        kernels.quantize_int8(torch.arange(10), 64)


@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_is_unbiased(impl):
    # S copies of one block of values between the levels (absmax 1, int8 levels every 1/127);
    # each copy gets its own draws, so the mean over copies estimates E[dequant(quant(x))].
    copies, block = 32, 1024
    x = torch.linspace(-1, 1, block)
    xs = x.repeat(copies)  # (S * B,)
    deq = impl.dequantize_int8(*impl.quantize_int8(xs, block, stochastic=True, seed=7), block).view(
        copies, block
    )
    step = 1 / 127
    assert bool(((deq - x).abs() <= step + 1e-6).all())  # never further than one level
    bias = (deq.mean(0) - x).abs().mean().item()
    assert bias < 0.15 * step, bias  # nearest rounding's mean |error| is ~step / 4
    packed, absmax = impl.quantize_4bit(xs, block, code="nf4", stochastic=True, seed=7)
    assert torch.equal(
        packed, impl.quantize_4bit(xs, block, code="nf4", stochastic=True, seed=7)[0]
    )  # seeded
    assert not torch.equal(packed, impl.quantize_4bit(xs, block, code="nf4", stochastic=True, seed=8)[0])
    means = impl.dequantize_4bit(packed, absmax, xs.numel(), block, code="nf4").view(copies, block).mean(0)
    nearest = ref.dequantize_4bit(*ref.quantize_4bit(x, block, code="nf4"), block, block, code="nf4")
    assert (means - x).abs().mean() < 0.5 * (nearest - x).abs().mean()


@pytest.mark.parametrize("impl", IMPLS)
def test_error_feedback_accumulated_sum_converges(impl):
    steps, n = 20, 2048
    gen = torch.Generator().manual_seed(3)
    residual = torch.zeros(n)
    sent = torch.zeros(n)
    plain = torch.zeros(n)
    total = torch.zeros(n)
    for _ in range(steps):
        g = torch.randn(n, generator=gen) + 0.05  # small mean drift under big noise
        q, absmax = impl.quantize_int8_error_feedback(g, residual, 256)
        sent += impl.dequantize_int8(q, absmax, 256)
        plain += ref.dequantize_int8(*ref.quantize_int8(g, 256), 256)
        total += g
    # What was sent trails the gradient sum by exactly the residual, which stays bounded.
    torch.testing.assert_close(sent + residual, total, atol=1e-4, rtol=0)
    assert residual.abs().max().item() < 6 / 127
    assert (sent - total).abs().mean() < 0.5 * (plain - total).abs().mean()


@needs_triton
def test_error_feedback_matches_reference_and_checks_residual():
    g = _randn(2000, torch.bfloat16, seed=4)
    r_ref, r_tri = torch.full((2000,), 0.01), torch.full((2000,), 0.01)
    q_ref, a_ref = ref.quantize_int8_error_feedback(g, r_ref, 512)
    q_tri, a_tri = tri.quantize_int8_error_feedback(g, r_tri, 512)
    torch.testing.assert_close(a_tri, a_ref, rtol=0, atol=0)
    _assert_q_match(q_ref, q_tri)
    torch.testing.assert_close(r_tri, r_ref, atol=a_ref.max().item() / 127 + 1e-6, rtol=0)
    with pytest.raises(ValueError, match="residual"):
        kernels.quantize_int8_error_feedback(g, torch.zeros(1999), 512)


def test_cpu_dispatch_uses_reference():
    x = _randn(777, torch.float32, seed=5)
    for a, b in zip(kernels.quantize_int8(x), ref.quantize_int8(x, kernels.DEFAULT_INT8_BLOCK_SIZE)):
        assert torch.equal(a, b)
    for a, b in zip(kernels.quantize_4bit(x, code="uint4"), ref.quantize_4bit(x, 64, code="uint4")):
        assert torch.equal(a, b)


# fp16 scales

WIDE = [1e-9, 1e-6, 1e-3, 1.0, 300.0, 16000.0]  # block absmax from fp16-subnormal to near its max


def _wide(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """N(0, 1) values, each 64-value block scaled by one of WIDE in turn."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor(WIDE).repeat_interleave(64).repeat(n // (64 * len(WIDE)) + 1)[:n]
    x = torch.randn(n, generator=gen) * scale
    return x.clamp(-65504, 65504).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@needs_triton
def test_fp16_scales_triton_matches_reference(n, dtype):
    x = _wide(n, dtype)
    q_ref, s_ref = ref.quantize_int8(x, 64, scale_dtype=torch.float16)
    q_tri, s_tri = tri.quantize_int8(x, 64, scale_dtype=torch.float16)
    assert s_ref.dtype == s_tri.dtype == torch.float16
    assert torch.equal(s_tri, s_ref)  # the same rounding, bit for bit
    _assert_q_match(q_ref, q_tri)
    _assert_close_out(
        tri.dequantize_int8(q_ref, s_ref, 64, dtype), ref.dequantize_int8(q_ref, s_ref, 64, dtype)
    )
    for code in CODES:
        p_ref, s_ref = ref.quantize_4bit(x, 64, code=code, scale_dtype=torch.float16)
        p_tri, s_tri = tri.quantize_4bit(x, 64, code=code, scale_dtype=torch.float16)
        assert torch.equal(s_tri, s_ref)
        assert (p_ref != p_tri).float().mean() < 1e-2  # ties at a midpoint may go either way


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_scales_round_up_and_keep_the_error_bound(impl):
    x = _wide(64 * len(WIDE) * 4, torch.float32, seed=1)
    absmax = x.view(-1, 64).abs().amax(dim=1)
    q, scales = impl.quantize_int8(x, 64, scale_dtype=torch.float16)
    s = scales.float()
    assert scales.dtype == torch.float16 and (s >= absmax).all()  # every value still fits
    normal = absmax >= 2**-14
    assert (s[normal] <= absmax[normal] * (1 + 2**-10)).all()  # one fp16 step at most
    assert (s[~normal] - absmax[~normal] <= 2**-24).all()  # subnormal: one step of 2^-24
    err = (impl.dequantize_int8(q, scales, 64) - x).view(-1, 64).abs().amax(dim=1)
    assert (err <= s / 254 * (1 + 1e-6)).all()
    # 4-bit: the same scales, and every index decodes within the code book's half-gap
    packed, scales4 = impl.quantize_4bit(x, 64, code="uint4", scale_dtype=torch.float16)
    assert torch.equal(scales4, scales)
    err4 = (impl.dequantize_4bit(packed, scales4, x.numel(), 64, code="uint4") - x).view(-1, 64).abs()
    assert (err4.amax(dim=1) <= s / 14 * (1 + 1e-6)).all()


@pytest.mark.filterwarnings(
    "ignore:overflow encountered in cast:RuntimeWarning"
)  # the interpreter's fp16 inf
@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_scales_overflow_is_its_own_error(impl):
    x = _randn(1000, torch.float32)
    x[700] = 7e4  # finite, beyond fp16
    for quantize in (impl.quantize_int8, impl.quantize_4bit):
        with pytest.raises(kernels.ScaleOverflowError, match="70000, beyond 65504.*fp32 scales"):
            quantize(x, 64, scale_dtype=torch.float16)
        assert quantize(x, 64)[1].dtype == torch.float32  # fp32 scales hold it
    residual = torch.full((1000,), 0.25)
    with pytest.raises(kernels.ScaleOverflowError):
        impl.quantize_int8_error_feedback(x, residual, 64, scale_dtype=torch.float16)
    assert (residual == 0.25).all()  # refused before the residual changed
    x[700] = 65504.0
    x[701] = 65504.0 - 0.5  # and g + residual above 65504 counts too
    with pytest.raises(kernels.ScaleOverflowError):
        impl.quantize_int8_error_feedback(x, residual, 64, scale_dtype=torch.float16)
    x[3] = float("nan")  # non-finite input stays the inf/NaN error
    with pytest.raises(ValueError, match="inf/NaN") as e:
        impl.quantize_int8(x, 64, scale_dtype=torch.float16)
    assert not isinstance(e.value, kernels.ScaleOverflowError)
    with pytest.raises(ValueError, match="scales are float32 or float16, got torch.bfloat16"):
        impl.quantize_int8(x, 64, scale_dtype=torch.bfloat16)


@needs_triton
def test_fp16_scales_error_feedback_matches_reference():
    g = _wide(2000, torch.float32, seed=6)
    r_ref, r_tri = torch.full((2000,), 1e-4), torch.full((2000,), 1e-4)
    q_ref, s_ref = ref.quantize_int8_error_feedback(g, r_ref, 64, scale_dtype=torch.float16)
    q_tri, s_tri = tri.quantize_int8_error_feedback(g, r_tri, 64, scale_dtype=torch.float16)
    assert torch.equal(s_tri, s_ref) and s_ref.dtype == torch.float16
    _assert_q_match(q_ref, q_tri)
    # the residual is exactly what the stored scales decode short of g + residual
    sent = ref.dequantize_int8(q_ref, s_ref, 64)
    torch.testing.assert_close(r_ref, g + 1e-4 - sent, rtol=0, atol=1e-3)
    step = s_ref.float().repeat_interleave(64)[:2000] / 127
    assert ((r_tri - r_ref).abs() <= step + 1e-6).all()


@needs_triton
@pytest.mark.parametrize("n", [0, 5003])
def test_the_agreement_check_a_gpu_run_starts_with(n):
    from swarmtrain.kernels.agreement import agreement

    report = agreement("cpu", n)
    assert report["ok"], report
    assert {"int8", "int8_s16", "nf4", "uint4_s16", "int8_error_feedback", "nf4_decode"} <= set(report)
    if n:
        assert report["int8"]["scales_equal"] and report["int8"]["mismatch_fraction"] < 0.01


def test_the_agreement_check_catches_a_wrong_kernel():
    from swarmtrain.kernels.agreement import _compare

    x = _randn(4096, torch.float32)
    q, s = ref.quantize_int8(x, 256)
    assert _compare(q, q, s, s)["ok"]
    assert not _compare(q, q, s * (1 + 2**-20), s)["ok"]  # scales one ulp off
    off = q.clone()
    off[:100] = (off[:100].int() + 1).clamp(max=127).to(torch.int8)  # 2.4% a level apart
    assert not _compare(off, q, s, s)["ok"]
    off[0] = q[0] + 2 if q[0] < 120 else q[0] - 2  # two levels apart
    assert _compare(off, q, s, s)["max_level_diff"] == 2
