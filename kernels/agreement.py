"""Do the Triton kernels agree with the torch reference on this device? One call, plain figures.

benchmarks/codecs.py runs it on a GPU before it times anything (a fast kernel that is wrong
is no result); tests/test_kernels.py runs it on CPU tensors under TRITON_INTERPRET=1.

    report = agreement("cuda", 1 << 22)     # {"int8": {...}, ..., "ok": True}

Each row compares Triton's output on `device` with quant_ref's on a CPU copy of the same
input: scales must be bit-identical, quantized values may differ by one level on at most 1%
of them (a value halfway between two levels rounds either way, by the order of fp32 ops), and
decoding the same codes must give the same values (one bf16 ulp).
"""

from __future__ import annotations

import torch

from . import quant_ref as ref

MAX_MISMATCH = 0.01
"""Fraction of quantized values allowed one level apart (ties)."""


def _compare(q_tri: torch.Tensor, q_ref: torch.Tensor, s_tri: torch.Tensor, s_ref: torch.Tensor) -> dict:
    q_tri, s_tri = q_tri.cpu(), s_tri.cpu()
    if q_tri.dtype == torch.uint8:  # 4-bit: compare the two indices in each byte
        q_tri = torch.stack((q_tri & 0xF, q_tri >> 4), dim=-1)
        q_ref = torch.stack((q_ref & 0xF, q_ref >> 4), dim=-1)
    diff = (q_tri.int() - q_ref.int()).abs()
    row = {
        "scales_equal": bool(torch.equal(s_tri, s_ref)),
        "mismatch_fraction": float((diff > 0).float().mean()) if diff.numel() else 0.0,
        "max_level_diff": int(diff.max()) if diff.numel() else 0,
    }
    row["ok"] = (
        row["scales_equal"] and row["max_level_diff"] <= 1 and row["mismatch_fraction"] <= MAX_MISMATCH
    )
    return row


def agreement(device: str | torch.device, n: int, *, seed: int = 0) -> dict:
    """Triton on `device` against the reference, for `n` N(0, 1)-ish values (n need not be a
    multiple of any block). Returns a row per kernel and "ok" for all of them."""
    from . import quant_triton as tri

    gen = torch.Generator().manual_seed(seed)
    x_cpu = torch.randn(n, generator=gen) * 3
    x = x_cpu.to(device)
    report = {}
    for scale_dtype, suffix in ((torch.float32, ""), (torch.float16, "_s16")):
        q_tri, s_tri = tri.quantize_int8(x, 256, scale_dtype=scale_dtype)
        q_ref, s_ref = ref.quantize_int8(x_cpu, 256, scale_dtype=scale_dtype)
        report[f"int8{suffix}"] = _compare(q_tri, q_ref, s_tri, s_ref)
        for code in ("nf4", "uint4"):
            p_tri, s_tri = tri.quantize_4bit(x, 64, code=code, scale_dtype=scale_dtype)
            p_ref, s_ref = ref.quantize_4bit(x_cpu, 64, code=code, scale_dtype=scale_dtype)
            report[f"{code}{suffix}"] = _compare(p_tri, p_ref, s_tri, s_ref)
    r_tri, r_ref = torch.full_like(x, 0.01), torch.full_like(x_cpu, 0.01)
    q_tri, s_tri = tri.quantize_int8_error_feedback(x, r_tri, 256)
    q_ref, s_ref = ref.quantize_int8_error_feedback(x_cpu, r_ref, 256)
    row = _compare(q_tri, q_ref, s_tri, s_ref)
    if n:  # the residuals differ by at most one level where the codes do
        row["residual_max_diff"] = float((r_tri.cpu() - r_ref).abs().max())
        row["ok"] = row["ok"] and row["residual_max_diff"] <= float(s_ref.max()) / 127 + 1e-6
    report["int8_error_feedback"] = row
    # decoding: the same codes through both backends
    q, s = ref.quantize_int8(x_cpu, 256)
    p, s4 = ref.quantize_4bit(x_cpu, 64)
    for name, out_tri, out_ref in (
        ("int8_decode", tri.dequantize_int8(q.to(device), s.to(device), 256, torch.bfloat16),
         ref.dequantize_int8(q, s, 256, torch.bfloat16)),
        ("nf4_decode", tri.dequantize_4bit(p.to(device), s4.to(device), n, 64, dtype=torch.bfloat16),
         ref.dequantize_4bit(p, s4, n, 64, dtype=torch.bfloat16)),
    ):  # fmt: skip
        diff = (out_tri.cpu().float() - out_ref.float()).abs()
        bound = out_ref.float().abs() * 2**-7  # one bf16 ulp: backends may round or truncate
        report[name] = {"ok": bool((diff <= bound).all()), "max_abs_diff": float(diff.max()) if n else 0.0}
    report["ok"] = all(r["ok"] for r in report.values())
    return report
