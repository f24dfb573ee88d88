"""The GPU path end to end on one CUDA GPU, in under five minutes: one JSON object.

    python benchmarks/gpu_check.py [--device cuda:0] [--steps 12] [--skip-swarm]

1. kernels: the Triton int8 and nf4 kernels against the torch reference (`kernels.agreement`,
   sizes off any block, empty included);
2. codecs: each lossy codec's encode and decode of a (8, 1024, 4096) activation where it lives
   (`encode_tensor` / `decode_encoded` on the device, what a stage peer runs), in GB/s against
   this GPU's memory bandwidth (a device copy of the same tensor), with the aim of 0.7;
3. frames: a stage's output frame on the GPU (int8 and raw tensors) written while the GPU
   is busy, by `write_frame` (compressed on the GPU, copied to pinned memory on a copy
   stream in a worker thread) and the blocking way (`encode_frame` on the event loop): the
   longest the event loop stalled each way, and that both decode to what was sent;
4. mixed precision: one stage computing in bf16 and one in fp16 (loss-scaled) under autocast
   against float32 from the same seed (benchmarks/mixed_precision.py on the GPU): tokens/s of each, their ratio, the losses'
   largest relative gap;
5. swarm: a coordinator, two stage peers on this GPU (`join --gpu DEVICE --dtype auto`) with
   int8 activations and gradients, a trainer for `--steps` steps: the loss at the first and
   last step, tokens/s, bytes on the wire against before compression, each stage peer's GPU
   memory (`memory_used_bytes` in its record) and dtype.

Without CUDA it says so and exits with code 2: none of this means anything on a CPU (the CPU
paths are what the test suite covers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
AIM_OF_BANDWIDTH = 0.7
ACTIVATION_SHAPE = (8, 1024, 4096)
AGREEMENT_SIZES = (0, 1, 255, 1000, 2**20 + 3)


def refuse_without_cuda(device: str) -> None:
    """Exit with code 2 and one line naming what is missing unless `device` is a usable CUDA GPU."""
    if not device.startswith("cuda"):
        print(f"error: --device {device!r}: this check is for a CUDA GPU (cuda or cuda:N)", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        print(
            f"error: no CUDA GPU here: torch {torch.__version__} (CUDA {built}) sees none. This check "
            "runs on a machine with one; the CPU paths are covered by `make test`",
            file=sys.stderr,
        )
        sys.exit(2)
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        print(
            f"error: --device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)",
            file=sys.stderr,
        )
        sys.exit(2)


def timed(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn()` on the GPU, by CUDA events (by the clock without CUDA, so that the
    test suite runs these checks' code on a CPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
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


def check_kernels(device: str) -> dict:
    from swarmtrain.kernels.agreement import agreement

    results = {str(n): agreement(device, n) for n in AGREEMENT_SIZES}
    return {"ok": all(r["ok"] for r in results.values()), "by_size": {n: r["ok"] for n, r in results.items()}}


def check_codecs(device: str, shape: tuple[int, ...] = ACTIVATION_SHAPE) -> dict:
    """Encode and decode on the device per codec; GB/s counts the fp32 tensor read (encode) or
    written (decode) plus the compressed bytes, against a device copy's read + write."""
    from swarmtrain.compress import get_codec
    from swarmtrain.compress.feedback import decode_encoded, encode_tensor

    x = torch.randn(shape, device=device)
    nbytes = x.numel() * x.element_size()
    copy_gbs = 2 * nbytes / timed(lambda: x.clone()) / 1e9
    out = {"tensor_shape": list(shape), "copy_gb_per_s": round(copy_gbs, 1), "codecs": {}}
    for name in ("fp16", "int8", "nf4"):
        codec = get_codec(name)
        enc = encode_tensor(x, codec)
        assert enc.payload.device == x.device, f"{name} encoded on {enc.payload.device}, not {x.device}"
        back = decode_encoded(enc)
        assert back.device == x.device, f"{name} decoded on {back.device}, not {x.device}"
        moved = nbytes + enc.nbytes
        encode_s = timed(lambda codec=codec: encode_tensor(x, codec))
        decode_s = timed(lambda enc=enc: decode_encoded(enc))
        error = float((back - x).norm() / x.norm())
        out["codecs"][name] = {
            "bytes_per_element": round(enc.nbytes / x.numel(), 4),
            "relative_error": round(error, 5),
            "encode_gb_per_s": round(moved / encode_s / 1e9, 1),
            "decode_gb_per_s": round(moved / decode_s / 1e9, 1),
            "encode_of_bandwidth": round(moved / encode_s / 1e9 / copy_gbs, 3),
            "decode_of_bandwidth": round(moved / decode_s / 1e9 / copy_gbs, 3),
        }
    worst = min(min(c["encode_of_bandwidth"], c["decode_of_bandwidth"]) for c in out["codecs"].values())
    out["worst_of_bandwidth"] = worst
    out["meets_aim"] = worst >= AIM_OF_BANDWIDTH
    out["aim_of_bandwidth"] = AIM_OF_BANDWIDTH
    return out


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def check_mixed_precision(device: str) -> dict:
    argv = [sys.executable, str(REPO / "benchmarks" / "mixed_precision.py"), "--device", device, "--steps", "6",
            "--n-layer", "8", "--d-model", "1024", "--seq-len", "512", "--microbatch-size", "8"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=240)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-2000:]}
    report = json.loads(proc.stdout)
    return {
        "model": report["model"],
        "tokens_per_s": {k: round(v) for k, v in report["tokens_per_s"].items()},
        **{k: round(v, 2) for k, v in report.items() if k.endswith("_vs_fp32")},
        "max_relative_loss_gap": report["max_relative_loss_gap"],
        "fp16_overflows": report.get("fp16_overflows"),
    }


def check_frames(device: str, shape: tuple[int, ...] = ACTIVATION_SHAPE, busy_matmuls: int = 20) -> dict:
    """A stage's output frame, on the device, written while the GPU is busy: once by
    `write_frame` (compressed on the device and copied to the host in a worker thread, the
    event loop free) and once the blocking way (`encode_frame` on the loop, which waits for
    the GPU). Reports the longest the event loop went without running each way, and checks
    both frames decode to what was sent."""
    import swarmtrain.compress  # noqa: F401  (registers the codecs frames carry)
    from swarmtrain.wire.frames import Frame, encode_frame, read_frame, write_frame

    x = torch.randn(shape, device=device)
    frame = Frame(
        kind="forward", run_id="gpu-check", tensors={"x": x, "raw": x[:1].clone()}, codecs={"x": "int8"}
    )
    a = torch.randn(2048, 2048, device=device)

    class Sink:
        def __init__(self, reader: asyncio.StreamReader):
            self.reader = reader

        def write(self, data) -> None:
            self.reader.feed_data(bytes(data))

        async def drain(self) -> None:
            pass

    async def once(threaded: bool) -> tuple[float, Frame]:
        reader, gaps, done = asyncio.StreamReader(), [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.0005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        for _ in range(busy_matmuls):  # queued on the GPU ahead of the frame's copies
            a @ a
        if threaded:
            await write_frame(Sink(reader), frame)
        else:
            for buf in encode_frame(frame):
                reader.feed_data(bytes(buf))
        await asyncio.sleep(0.01)
        done.set()
        await tick
        reader.feed_eof()
        return max(gaps), await read_frame(reader)

    out = {"tensor_shape": list(shape)}
    for name, threaded in (("write_frame", True), ("blocking", False)):
        asyncio.run(once(threaded))  # warm up (kernels, pinned memory)
        stall, got = asyncio.run(once(threaded))
        assert torch.equal(got.tensors["raw"], x[:1].cpu()), "a raw tensor came back changed"
        error = float((got.tensors["x"] - x.cpu()).norm() / x.norm().cpu())
        assert error < 0.02, f"int8 frame decoded with relative error {error}"
        out[name] = {"loop_stall_ms": round(stall * 1e3, 2), "int8_relative_error": round(error, 5)}
    return out


SWARM_MODEL = {"n_layer": 4, "d_model": 512, "n_head": 8, "seq_len": 256}


def check_swarm(device: str, steps: int, model: dict = SWARM_MODEL, microbatch_size: int = 8) -> dict:
    """Two stage peers on `device` with int8 on the wire, trained for `steps` steps."""
    from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
    from swarmtrain.train.data import TokenBatches, stdlib_text
    from swarmtrain.wire.records import BatchConfig, CompressionConfig

    gpu_args = ("--gpu", device, "--dtype", "auto")
    config = LocalSwarmConfig(
        run_id="gpu-check",
        model_config=model,
        num_stages=2,
        stage_args={0: gpu_args, 1: gpu_args},
        batch=BatchConfig(microbatch_size=microbatch_size, microbatches_per_step=8, max_in_flight=8),
        compression=CompressionConfig(activations="int8", gradients="int8", averaging="int8"),
        num_trainers=0,
        threads_per_peer=2,
    )
    started = time.monotonic()
    seq_len = model["seq_len"]
    with LocalSwarm(config) as swarm, swarm.trainer() as trainer:
        batches = TokenBatches(stdlib_text(2**22), seq_len=seq_len, microbatch_size=microbatch_size, seed=0)
        results = list(trainer.train(iter(batches), steps=steps))
        deadline = time.monotonic() + 10.0  # stage peers announce their counters every 2 s
        while True:
            stages = [p for p in trainer.node.peers("gpu-check") if p.role == "stage"]
            if time.monotonic() > deadline or (len(stages) == 2 and all(p.step >= steps for p in stages)):
                break
            time.sleep(0.5)
    rates = [r.tokens / r.seconds for r in results[2:]]
    sent = sum(p.bytes_sent for p in stages)
    raw = sum(p.raw_bytes_sent for p in stages)
    return {
        "steps": len(results),
        "loss_first": round(results[0].loss, 4),
        "loss_last": round(results[-1].loss, 4),
        "loss_fell": results[-1].loss < results[0].loss,
        "tokens_per_s": round(statistics.median(rates)),
        "compression_ratio": round(raw / sent, 2) if sent else None,
        "dtype": "auto (bf16 where the GPU has it)",
        "stages": [
            {"stage": p.stage, "device": p.device, "memory_used_bytes": p.memory_used_bytes}
            for p in sorted(stages, key=lambda p: p.stage)
        ],
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=12, help="steps of the two-peer swarm (>= 3)")
    parser.add_argument("--skip-swarm", action="store_true", help="leave out the two-peer swarm")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    refuse_without_cuda(args.device)
    import triton

    started = time.monotonic()
    report = {
        "benchmark": "gpu_check",
        "device": torch.cuda.get_device_name(torch.device(args.device)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "kernels": check_kernels(args.device),
        "codecs": check_codecs(args.device),
        "frames": check_frames(args.device),
        "mixed_precision": check_mixed_precision(args.device),
    }
    if not args.skip_swarm:
        try:
            report["swarm"] = check_swarm(args.device, args.steps)
        except Exception as e:  # report what broke with the figures already taken
            report["swarm"] = {"error": f"{type(e).__name__}: {e}"}
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
