"""What checkpoints cost on the demo model, side by side in one run.

    python benchmarks/checkpoint.py [--steps 8] [--pairs 2] [--skip-swarm]

1. In process, per stage of the demo model (tiny-gpt, `peers/demo.py`'s DEMO_MODEL, 2 stages,
   AdamW): the compute pause a checkpoint costs (the copy of parameters and optimizer state the
   compute thread makes, and the digest), the write on its worker thread (safetensors, fsync,
   rename), and the bytes written, against one training step of that stage (8 microbatches of
   8 x 64 tokens forward and backward, then the optimizer step) timed in the same run.
2. Real swarms on loopback (a coordinator and one peer per stage): `--checkpoint-every 1` against
   `--checkpoint-every 0`, alternated `--pairs` times, `--steps` steps each; per arm the median
   and the longest step, and the ratio of the medians (checkpointing / none).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from swarmtrain.model import build_stage
from swarmtrain.peers.checkpoints import StageCheckpointer
from swarmtrain.peers.demo import DEMO_MODEL
from swarmtrain.schedule import ReadinessQueue
from swarmtrain.schedule.runtime import ComputeScheduler
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest, even_split

OPTIMIZER = OptimizerConfig(name="adamw", lr=3e-3)
MICROBATCH, PER_STEP = 8, 8


def in_process(repeats: int = 5) -> list[dict]:
    bounds = even_split(DEMO_MODEL["n_layer"], 2)
    manifest = RunManifest(
        run_id="bench", model="tiny-gpt", model_config=DEMO_MODEL, num_blocks=DEMO_MODEL["n_layer"],
        stage_bounds=bounds, optimizer=OPTIMIZER, checkpoint_every=1,
    )  # fmt: skip
    runners = [
        StageRunner(
            build_stage("tiny-gpt", DEMO_MODEL, a, b, num_blocks=DEMO_MODEL["n_layer"], seed=0),
            OPTIMIZER,
            microbatch_size=MICROBATCH,
        )
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    data = iter(
        TokenBatches(stdlib_text(2**20), seq_len=DEMO_MODEL["seq_len"], microbatch_size=MICROBATCH, seed=0)
    )
    step_s = [[] for _ in runners]
    for step in range(repeats):
        times = [0.0 for _ in runners]
        for n in range(PER_STEP):
            x, y = next(data)
            t = time.perf_counter()
            h = runners[0].forward(f"{step}.{n}", x)
            times[0] += time.perf_counter() - t
            t = time.perf_counter()
            _, grad = runners[1].forward_loss_backward(f"{step}.{n}", h, {"targets": y}, 1 / PER_STEP)
            times[1] += time.perf_counter() - t
            t = time.perf_counter()
            runners[0].backward(f"{step}.{n}", grad)
            times[0] += time.perf_counter() - t
        for k, r in enumerate(runners):
            t = time.perf_counter()
            r.fold(step, fresh=set(r.report()[0]), take=[])
            r.apply_step(step)
            step_s[k].append(times[k] + time.perf_counter() - t)
    out = []
    with tempfile.TemporaryDirectory() as root:
        for k, runner in enumerate(runners):
            scheduler = ComputeScheduler(ReadinessQueue(4), holding=lambda: 0, fused_last=False)
            saver = StageCheckpointer(root, manifest, keep=1)
            pauses, writes = [], []
            try:
                for _ in range(repeats):
                    runner.step += 1  # a new step each time: an existing one is not written again
                    asyncio.run(saver.save(runner, scheduler, k))
                    pauses.append(saver.stats.longest_pause_s)
                    saver.stats.longest_pause_s = 0.0
                    writes.append(saver.stats.last_write_s)
            finally:
                scheduler.close()
            step_median = statistics.median(step_s[k])
            out.append(
                {
                    "stage": k,
                    "parameters": sum(p.numel() for p in runner.params),
                    "bytes_per_checkpoint": saver.stats.last_bytes,
                    "pause_ms_median": round(statistics.median(pauses) * 1e3, 2),
                    "pause_ms_longest": round(max(pauses) * 1e3, 2),
                    "write_ms_median": round(statistics.median(writes) * 1e3, 2),
                    "step_ms_median": round(step_median * 1e3, 2),
                    "pause_over_step": round(max(pauses) / step_median, 4),
                }
            )
    return out


def swarm_arm(every: int, steps: int) -> dict:
    from swarmtrain.peers.launcher import LocalSwarm

    batch = BatchConfig(microbatch_size=MICROBATCH, microbatches_per_step=PER_STEP, max_in_flight=PER_STEP)
    with tempfile.TemporaryDirectory() as home, LocalSwarm(
        model_config=DEMO_MODEL, num_stages=2, optimizer=OPTIMIZER, batch=batch,
        stage_args={0: ("--rebalance-every", "0"), 1: ("--rebalance-every", "0")},
        coordinator_args=("--checkpoint-every", str(every)), env={"SWARMTRAIN_HOME": home},
    ) as swarm:  # fmt: skip
        data = TokenBatches(
            stdlib_text(2**20), seq_len=DEMO_MODEL["seq_len"], microbatch_size=MICROBATCH, seed=0
        )
        with swarm.trainer() as trainer:
            seconds = [r.seconds for r in trainer.train(data, steps=steps)][2:]  # 2 steps of warm-up
        written = sum(f.stat().st_size for f in Path(home, "checkpoints").rglob("*") if f.is_file())
    return {
        "median_step_s": statistics.median(seconds),
        "longest_step_s": max(seconds),
        "bytes_on_disk": written,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--skip-swarm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {
        "model": DEMO_MODEL,
        "microbatches": f"{PER_STEP} x {MICROBATCH} x {DEMO_MODEL['seq_len']} tokens",
    }
    report["in_process"] = in_process()
    if not args.skip_swarm:
        arms = {"every_step": [], "never": []}
        for pair in range(args.pairs):
            for name, every in (("never", 0), ("every_step", 1)):
                print(f"pair {pair + 1}: checkpoint {name}", file=sys.stderr)
                arms[name].append(swarm_arm(every, args.steps))
        summary = {
            name: {
                "median_step_s": round(statistics.median(r["median_step_s"] for r in runs), 4),
                "longest_step_s": round(max(r["longest_step_s"] for r in runs), 4),
                "bytes_on_disk": runs[-1]["bytes_on_disk"],
            }
            for name, runs in arms.items()
        }
        summary["median_ratio"] = round(
            summary["every_step"]["median_step_s"] / summary["never"]["median_step_s"], 3
        )
        summary["longest_ratio"] = round(
            summary["every_step"]["longest_step_s"] / summary["never"]["longest_step_s"], 3
        )
        report["swarm"] = summary
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
