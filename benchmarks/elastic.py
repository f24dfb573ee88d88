"""Planned layout against an even split on the same heterogeneous peers, on loopback.

    python benchmarks/elastic.py [--steps 12] [--slowdowns 1,1,4,4]

Starts a real swarm (coordinator and stage peers as processes, emulated speeds with
--slowdown) twice in one run: once with the blocks split evenly over one peer per stage,
once with the stages and replicas the planner chooses from the peers' capacities. Prints
JSON: tokens/s of each (median over steps, after warm-up) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
from swarmtrain.peers.probe import probe
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.placement import plan_emulated_peers
from swarmtrain.wire.records import BatchConfig, even_split

MODEL = {"n_layer": 8, "n_head": 4, "d_model": 128, "seq_len": 64, "vocab_size": 256}
BATCH = BatchConfig(microbatch_size=8, microbatches_per_step=8, max_in_flight=8)
WARMUP_STEPS = 2


def measure(stage_bounds: tuple[int, ...], peers: list[list[float]], steps: int) -> dict:
    """Train `steps` steps on a swarm whose stage k has peers with slowdowns `peers[k]`."""
    config = LocalSwarmConfig(
        model_config=MODEL,
        stage_bounds=stage_bounds,
        stage_args={k: ("--slowdown", str(s[0]), "--rebalance-every", "0") for k, s in enumerate(peers)},
        batch=BATCH,
    )
    with LocalSwarm(config) as swarm:
        for k, slowdowns in enumerate(peers):
            for s in slowdowns[1:]:
                swarm.spawn_stage(k, extra_args=("--slowdown", str(s), "--rebalance-every", "0"))
        data = TokenBatches(
            stdlib_text(2**22), seq_len=MODEL["seq_len"], microbatch_size=BATCH.microbatch_size, seed=0
        )
        with swarm.trainer() as trainer:
            results = list(trainer.train(data, steps=steps + WARMUP_STEPS))[WARMUP_STEPS:]
    rates = [r.tokens_per_s for r in results]
    return {
        "stage_bounds": list(stage_bounds),
        "peer_slowdowns_per_stage": peers,
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "steps": len(results),
        "replays": sum(r.replays for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per layout (default 12)")
    parser.add_argument("--slowdowns", default="1,1,4,4", help="one --slowdown per peer (default 1,1,4,4)")
    args = parser.parse_args()
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    started = time.monotonic()

    cap = probe("cpu", seconds=0.3)
    plan, planned = plan_emulated_peers(
        "tiny-gpt",
        MODEL,
        slowdowns,
        BATCH,
        flops_per_s=cap.matmul_flops_per_s,
        memory_bytes=cap.usable_memory_bytes,
    )

    even = measure(even_split(MODEL["n_layer"], len(slowdowns)), [[s] for s in slowdowns], args.steps)
    best = measure(plan.stage_bounds, planned, args.steps)
    ratio = best["tokens_per_s_median"] / even["tokens_per_s_median"]
    print(
        json.dumps(
            {
                "benchmark": "elastic",
                "aim": "planned layout >= 1.3x the tokens/s of an even split on a 4x-heterogeneous mix",
                "model": MODEL,
                "batch": BATCH.to_dict(),
                "peer_slowdowns": slowdowns,
                "even_split": even,
                "planned": best | {"predicted_tokens_per_s": plan.throughput_tokens_per_s},
                "ratio_planned_over_even": ratio,
                "meets_aim": ratio >= 1.3,
                "elapsed_s": time.monotonic() - started,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
