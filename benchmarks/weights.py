"""What a policy update costs a rollout peer, exact against compressed, on the demo model.

    python benchmarks/weights.py [--steps 6] [--codecs none,bf16,int8] [--skip-swarm]

1. In process, per stage of the demo model (tiny-gpt, `peers/demo.py`'s DEMO_MODEL, 2 stages,
   AdamW): what keeping the previous version costs a replica once someone asks for weights
   (the CPU snapshot its compute thread takes at each commit) against one training step of
   that stage (8 microbatches of 8 x 64 tokens forward and backward, then the optimizer step),
   and what it costs a replica nobody asks (nothing is copied).
2. A real swarm on loopback (a coordinator and one peer per stage) trains `--steps` steps; after
   each, a peer outside the run fetches the new version once per codec (in turn, the order
   rotating each step). Per codec: the bytes on the wire and the seconds of one update
   (medians), and their ratio to the exact fetch's.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time

import torch

from swarmtrain.model import build_stage
from swarmtrain.peers.demo import DEMO_MODEL
from swarmtrain.rl.weights import FetchConfig, fetch_version, latest_version, swarm_source
from swarmtrain.swarm import SwarmNode
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.train.versions import PolicyVersions
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, even_split

OPTIMIZER = OptimizerConfig(name="adamw", lr=3e-3)
MICROBATCH, PER_STEP = 8, 8


def in_process(repeats: int = 5) -> list[dict]:
    bounds = even_split(DEMO_MODEL["n_layer"], 2)
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
    snapshot_s, snapshot_bytes = [[] for _ in runners], [0 for _ in runners]
    apply_s = {"asked": [[] for _ in runners], "not_asked": [[] for _ in runners]}
    for step in range(2 * repeats):
        arm = "asked" if step % 2 else "not_asked"
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
            if arm == "asked":
                r.versions.mark_interest()
            else:  # a replica nobody asked: a fresh store
                r.versions = PolicyVersions()
            before = r.versions.stats.snapshot_s
            t = time.perf_counter()
            r.fold(step, fresh=set(r.report()[0]), take=[])
            r.apply_step(step)
            took = time.perf_counter() - t
            apply_s[arm][k].append(took)
            if arm == "asked":
                snapshot_s[k].append(r.versions.stats.snapshot_s - before)
                snapshot_bytes[k] = r.versions.stats.held_bytes
            step_s[k].append(times[k] + took)
    out = []
    for k, runner in enumerate(runners):
        snapshot_ms = statistics.median(snapshot_s[k]) * 1e3
        step_median = statistics.median(step_s[k])
        out.append(
            {
                "stage": k,
                "parameters": sum(p.numel() for p in runner.params),
                "snapshot_bytes": snapshot_bytes[k],
                "snapshot_ms_median": round(snapshot_ms, 3),
                "snapshot_ms_longest": round(max(snapshot_s[k]) * 1e3, 3),
                "apply_ms_median_asked": round(statistics.median(apply_s["asked"][k]) * 1e3, 3),
                "apply_ms_median_not_asked": round(statistics.median(apply_s["not_asked"][k]) * 1e3, 3),
                "step_ms_median": round(step_median * 1e3, 2),
                "snapshot_over_step": round(snapshot_ms / 1e3 / step_median, 5),
            }
        )
    return out


class Client:
    """A peer outside the run, on its own event loop."""

    def __init__(self, node_config):
        self.node = SwarmNode(node_config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.source = self.run(swarm_source(self.node))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def wait_for(self, version: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.run(latest_version(self.source)) or 0) < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no stage announced version {version} within {timeout_s} s")
            time.sleep(0.1)

    def close(self) -> None:
        self.run(self.node.close_p2p())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.node.shutdown()


def swarm(steps: int, codecs: list[str]) -> dict:
    from swarmtrain.peers.launcher import LocalSwarm

    batch = BatchConfig(microbatch_size=MICROBATCH, microbatches_per_step=PER_STEP, max_in_flight=PER_STEP)
    runs = {codec: [] for codec in codecs}
    with tempfile.TemporaryDirectory() as home, LocalSwarm(
        model_config=DEMO_MODEL, num_stages=2, optimizer=OPTIMIZER, batch=batch,
        stage_args={0: ("--rebalance-every", "0"), 1: ("--rebalance-every", "0")},
        env={"SWARMTRAIN_HOME": home},
    ) as local:  # fmt: skip
        data = iter(
            TokenBatches(
                stdlib_text(2**20), seq_len=DEMO_MODEL["seq_len"], microbatch_size=MICROBATCH, seed=0
            )
        )
        client = Client(local.node_config())
        try:
            with local.trainer() as trainer:
                step_s = []
                for step in range(steps):
                    (result,) = trainer.train(data, steps=1)
                    step_s.append(result.seconds)
                    client.wait_for(step + 1)
                    order = codecs[step % len(codecs) :] + codecs[: step % len(codecs)]
                    for codec in order:
                        _, stats = client.run(
                            fetch_version(client.source, step + 1, FetchConfig(codec=codec))
                        )
                        runs[codec].append(stats)
                    print(f"step {step}: fetched version {step + 1}", file=sys.stderr)
        finally:
            client.close()
    exact = runs[codecs[0]]
    base_bytes = statistics.median(s.wire_bytes for s in exact)
    base_s = statistics.median(s.seconds for s in exact)
    out = {"median_step_s": round(statistics.median(step_s), 4), "updates": steps, "per_codec": {}}
    for codec, stats in runs.items():
        wire = statistics.median(s.wire_bytes for s in stats)
        seconds = statistics.median(s.seconds for s in stats)
        out["per_codec"][codec] = {
            "wire_bytes": int(wire),
            "raw_bytes": stats[0].raw_bytes,
            "seconds_median": round(seconds, 4),
            "seconds_longest": round(max(s.seconds for s in stats), 4),
            "requests": stats[0].requests,
            "bytes_ratio_to_exact": round(wire / base_bytes, 4),
            "seconds_ratio_to_exact": round(seconds / base_s, 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--codecs", default="none,bf16,int8", help="comma-separated; the first is the baseline"
    )
    parser.add_argument("--skip-swarm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {
        "model": DEMO_MODEL,
        "microbatches": f"{PER_STEP} x {MICROBATCH} x {DEMO_MODEL['seq_len']} tokens",
        "in_process": in_process(),
    }
    if not args.skip_swarm:
        report["swarm"] = swarm(args.steps, args.codecs.split(","))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
