"""A stage's compute in bf16 and fp16 (autocast, float32 master weights) against float32, side by side.

    python benchmarks/mixed_precision.py [--device cpu] [--dtypes fp32,bf16,fp16] [--steps 6]
        [--n-layer 4] [--d-model 256]

Builds one stage holding a whole small GPT on `--device`, once per dtype from the same seed:
a runner computing in float32, one in bf16 and one in fp16 (`StageRunner(compute_dtype=...)`,
what `join --dtype` runs; fp16 with the stage's loss scaling). Each trains the same
microbatches for `--steps` optimizer steps; they alternate microbatch by microbatch so that
machine noise hits all alike. Prints JSON: tokens/s of each (forward + loss + backward, median
over microbatches after the first step), each one's ratio to float32 (`bf16_vs_fp32`,
`fp16_vs_fp32`), the loss of every step in each, the largest relative gap to float32's, and
the fp16 stage's loss scale and overflows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from swarmtrain.model import build_stage
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.wire.records import OptimizerConfig

MICROBATCHES = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated; fp32 is always run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=8)
    args = parser.parse_args()
    config = {
        "n_layer": args.n_layer,
        "n_head": 4,
        "d_model": args.d_model,
        "seq_len": args.seq_len,
        "vocab_size": 256,
    }
    dtypes = ["fp32"] + [d for d in args.dtypes.split(",") if d and d != "fp32"]
    runners = {}
    for dtype in dtypes:
        module = build_stage(
            "tiny-gpt", config, 0, args.n_layer, num_blocks=args.n_layer, seed=0, device=args.device
        )
        runners[dtype] = StageRunner(
            module, OptimizerConfig(lr=1e-3), microbatch_size=args.microbatch_size, compute_dtype=dtype
        )
    data = iter(
        TokenBatches(stdlib_text(2**22), seq_len=args.seq_len, microbatch_size=args.microbatch_size, seed=0)
    )
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    seconds = {d: [] for d in runners}
    losses = {d: [] for d in runners}
    tokens = args.microbatch_size * args.seq_len
    for step in range(args.steps):
        totals = dict.fromkeys(runners, 0.0)
        for i in range(MICROBATCHES):
            x, targets = next(data)
            for dtype, runner in runners.items():
                sync()
                started = time.perf_counter()
                loss, _ = runner.forward_loss_backward(
                    f"{step}-{i}", x, {"targets": targets}, 1 / MICROBATCHES
                )
                sync()
                if step > 0:  # the first step is cold (allocations, kernels)
                    seconds[dtype].append(time.perf_counter() - started)
                totals[dtype] += loss / MICROBATCHES
        for dtype, runner in runners.items():
            runner.fold(step, fresh={f"{step}-{i}" for i in range(MICROBATCHES)}, take=[])
            runner.apply_step(step)
            losses[dtype].append(totals[dtype])
    rate = {d: tokens / statistics.median(s) for d, s in seconds.items()}
    gaps = {
        d: max(abs(b - a) / abs(a) for a, b in zip(losses["fp32"], losses[d], strict=True))
        for d in dtypes[1:]
    }
    scale = runners.get("fp16") and runners["fp16"].loss_scale
    print(
        json.dumps(
            {
                "benchmark": "mixed_precision",
                "device": args.device,
                "torch_threads": torch.get_num_threads(),
                "model": config,
                "microbatch_size": args.microbatch_size,
                "tokens_per_s": rate,
                **{f"{d}_vs_fp32": rate[d] / rate["fp32"] for d in dtypes[1:]},
                "losses": losses,
                "max_relative_loss_gap": gaps,
                **({"fp16_loss_scale": scale.scale, "fp16_overflows": scale.overflows} if scale else {}),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
