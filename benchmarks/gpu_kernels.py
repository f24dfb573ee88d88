"""The Triton quantization kernels on a CUDA GPU: agreement with the torch reference, then
bandwidth against a plain device copy, side by side in one run (one JSON object).

    python benchmarks/gpu_kernels.py [--numel 67108864]

Agreement (`kernels.agreement`) at sizes that are not multiples of any block, empty included.
Timing: CUDA events around 20 launches after 3 warm-ups, median; GB/s counts the bytes a
kernel reads and writes (fp32 or bf16 in, codes and scales out, or back), and the ratio is
against `torch.clone` of the fp32 input (read + write), this GPU's practical ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

try:  # installed: the package's name for it
    from swarmtrain import kernels
    from swarmtrain.kernels.agreement import agreement
except ImportError:  # from a checkout on PYTHONPATH
    import kernels
    from kernels.agreement import agreement


def timed(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn()` on the GPU, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**26)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark times the Triton kernels on a GPU")
    import triton

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    report["agreement"] = {str(n): agreement("cuda", n)["ok"] for n in (0, 1, 255, 1000, 2**20 + 3)}
    x = torch.randn(args.numel, device="cuda")
    copy_s = timed(lambda: x.clone())
    copy_gbs = 2 * nbytes(x) / copy_s / 1e9
    report["copy_gb_per_s"] = round(copy_gbs, 1)
    q, s = kernels.quantize_int8(x, 256)
    p, s4 = kernels.quantize_4bit(x, 64)
    residual = torch.zeros_like(x)
    cases = {
        "int8_encode": (lambda: kernels.quantize_int8(x, 256), nbytes(x, q, s)),
        "int8_encode_fp16_scales": (
            lambda: kernels.quantize_int8(x, 256, scale_dtype=torch.float16),
            nbytes(x, q) + s.numel() * 2,
        ),
        "int8_error_feedback": (
            lambda: kernels.quantize_int8_error_feedback(x, residual, 256),
            nbytes(x, q, s) + 2 * nbytes(residual),
        ),
        "int8_decode_bf16": (
            lambda: kernels.dequantize_int8(q, s, 256, torch.bfloat16),
            nbytes(q, s) + x.numel() * 2,
        ),
        "nf4_encode": (lambda: kernels.quantize_4bit(x, 64), nbytes(x, p, s4)),
        "nf4_decode_bf16": (
            lambda: kernels.dequantize_4bit(p, s4, x.numel(), 64, dtype=torch.bfloat16),
            nbytes(p, s4) + x.numel() * 2,
        ),
    }
    report["kernels"] = {}
    for name, (fn, moved) in cases.items():
        seconds = timed(fn)
        gbs = moved / seconds / 1e9
        report["kernels"][name] = {
            "us": round(seconds * 1e6, 1),
            "gb_per_s": round(gbs, 1),
            "vs_copy": round(gbs / copy_gbs, 3),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
