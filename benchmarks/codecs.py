"""Quantizer throughput and error, ours against bitsandbytes and hivemind, printed as one JSON object.

    OMP_NUM_THREADS=1 python benchmarks/codecs.py --sizes 1 4 16 64

Sizes are millions of N(0, 1) float32 values. Throughput is GB/s of fp32 input through
encode and through decode (median of --repeats). Error is relative MSE (mse / mean(x^2))
and max abs error of decode(encode(x)). On CUDA the Triton kernels are timed as well and
their achieved bandwidth (bytes read + written) is set against the device's peak, after
`cuda_agreement` (swarmtrain.kernels.agreement) has checked them against the torch reference.
"""

import os

# bitsandbytes' CPU kernels and torch each bring an OpenMP runtime; with more than one thread
# they compete and bitsandbytes' dequantize times become erratic (ENVIRONMENT.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from swarmtrain import kernels  # noqa: E402

warnings.filterwarnings("ignore")

Encode = Callable[[torch.Tensor], object]
Decode = Callable[[object], torch.Tensor]


def _methods() -> dict[str, tuple[Encode, Decode]]:
    """name -> (encode, decode) working on a flat fp32 tensor."""
    import bitsandbytes.functional as bnbf
    from hivemind.compression.base import CompressionInfo
    from hivemind.compression.quantization import BlockwiseQuantization, Uniform8BitQuantization

    def ours_int8(block, scale_dtype=torch.float32):
        return (
            lambda x: kernels.quantize_int8(x, block, scale_dtype=scale_dtype),
            lambda enc: kernels.dequantize_int8(*enc, block),
        )

    def ours_4bit(code, scale_dtype=torch.float32):
        return (
            lambda x: (kernels.quantize_4bit(x, 64, code=code, scale_dtype=scale_dtype), x.numel()),
            lambda enc: kernels.dequantize_4bit(*enc[0], enc[1], 64, code=code),
        )

    def hivemind(codec):
        return (
            lambda x: codec.compress(x, CompressionInfo.from_tensor(x)),
            codec.extract,
        )

    return {
        "ours_int8_b256": ours_int8(256),
        "ours_int8_b4096": ours_int8(4096),
        "ours_nf4_b64": ours_4bit("nf4"),
        "ours_uint4_b64": ours_4bit("uint4"),
        "ours_int8_b256_s16": ours_int8(256, torch.float16),  # fp16 scales
        "ours_nf4_b64_s16": ours_4bit("nf4", torch.float16),
        "bnb_blockwise8_b4096": (
            lambda x: bnbf.quantize_blockwise(x, blocksize=4096),
            lambda enc: bnbf.dequantize_blockwise(*enc),
        ),
        "bnb_nf4_b64": (
            lambda x: bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4"),
            lambda enc: bnbf.dequantize_4bit(*enc),
        ),
        "hivemind_blockwise8": hivemind(BlockwiseQuantization()),
        "hivemind_uniform8": hivemind(Uniform8BitQuantization()),
    }


def _median_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _errors(x: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    diff = out.float().reshape(-1) - x.reshape(-1)
    return {
        "rel_mse": (diff.square().mean() / x.square().mean()).item(),
        "max_abs_error": diff.abs().max().item(),
    }


def bench_cpu(size_m: float, repeats: int) -> dict[str, dict[str, float]]:
    x = torch.randn(int(size_m * 2**20), generator=torch.Generator().manual_seed(0))
    gb = x.numel() * 4 / 1e9
    rows = {}
    for name, (encode, decode) in _methods().items():
        enc = encode(x)  # warm-up, and the decode input
        out = decode(enc)
        rows[name] = {
            "encode_GBps": round(gb / _median_s(lambda e=encode: e(x), repeats), 3),
            "decode_GBps": round(gb / _median_s(lambda d=decode, e=enc: d(e), repeats), 3),
            **{k: float(f"{v:.4g}") for k, v in _errors(x, out).items()},
        }
    return rows


PUBLISHED_PEAK_GBps = {
    "H200": 4800.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "A100-SXM4-80GB": 2039.0,
}
"""Vendors' peak memory bandwidth, for devices whose properties do not report clock and bus width."""


def _peak_bandwidth_GBps() -> float | None:
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PUBLISHED_PEAK_GBps.items() if k in name), None)


def bench_cuda(size_m: float, repeats: int) -> dict[str, dict[str, float]]:
    """Triton kernels on the GPU; GB/s counts every byte read and written."""
    from swarmtrain.kernels import quant_triton as tri

    x = torch.randn(int(size_m * 2**20), device="cuda")
    n = x.numel()
    q, absmax = tri.quantize_int8(x, 256)
    packed, absmax4 = tri.quantize_4bit(x, 64)
    residual = torch.zeros_like(x)
    cases = {
        "triton_int8_quant": (lambda: tri.quantize_int8(x, 256), 4 * n + n + 4 * n // 256),
        "triton_int8_dequant": (lambda: tri.dequantize_int8(q, absmax, 256), n + 4 * n // 256 + 4 * n),
        "triton_nf4_quant": (lambda: tri.quantize_4bit(x, 64), 4 * n + n // 2 + 4 * n // 64),
        "triton_nf4_dequant": (
            lambda: tri.dequantize_4bit(packed, absmax4, n, 64),
            n // 2 + 4 * n // 64 + 4 * n,
        ),
        "triton_int8_quant_s16": (
            lambda: tri.quantize_int8(x, 256, scale_dtype=torch.float16),
            4 * n + n + 2 * n // 256,
        ),
        "triton_int8_error_feedback": (
            lambda: tri.quantize_int8_error_feedback(x, residual, 256),
            4 * n + 8 * n + n + 4 * n // 256,
        ),
    }
    peak = _peak_bandwidth_GBps()
    rows = {}
    for name, (fn, num_bytes) in cases.items():
        fn()
        seconds = _median_s(fn, repeats, torch.cuda.synchronize)
        achieved = num_bytes / seconds / 1e9
        rows[name] = {
            "input_GBps": round(4 * n / seconds / 1e9, 1),
            "achieved_GBps": round(achieved, 1),
            "fraction_of_peak": round(achieved / peak, 3) if peak else None,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64], help="millions of values")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    args = parser.parse_args()
    report = {
        "threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
        "input": "float32 N(0, 1); GB/s of fp32 input",
        "cpu": {f"{s:g}M": bench_cpu(s, args.repeats if s < 16 else 1) for s in args.sizes},
    }
    if torch.cuda.is_available():
        from swarmtrain.kernels.agreement import agreement

        report["device"] = torch.cuda.get_device_name(0)
        report["peak_bandwidth_GBps"] = _peak_bandwidth_GBps()
        # a fast kernel that is wrong is no result: Triton against the reference first
        report["cuda_agreement"] = agreement("cuda", 2**22 + 17)
        report["cuda"] = {f"{s:g}M": bench_cuda(s, 20) for s in args.sizes}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
