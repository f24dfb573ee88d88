"""Predicted throughput of the planner's plans against an even split, and the planner's speed.

    python benchmarks/planner.py [--seed N] [--timing-peers 1000] [--repeats 3] [--tokens-per-step N]

Swarms mix public capacity profiles (achieved, not peak, matmul throughput):

    A100 80GB   312 TFLOP/s bf16 peak, 50% achieved   datacenter 1 Gbit/s
    RTX 4090    165 TFLOP/s peak, 50% achieved        home 100-300 Mbit/s
    RTX 3090     71 TFLOP/s peak, 50% achieved        home 100-300 Mbit/s
    T4 16GB      65 TFLOP/s fp16 peak, ~25 achieved    datacenter 1 Gbit/s
    CPU 16GB    ~0.5 TFLOP/s                          home 100-300 Mbit/s

Every peer's throughput is jittered by +-10% (seeded), as measured numbers are. The models
are GPT-like, costed by `transformer_block_cost` (12 d^2 parameters per block; forward +
backward 72 d^2 + 6 T d FLOPs/token; 16 bytes/parameter of weights, gradients and Adam
state; 34 d bytes/token of activations; 8-bit activations on the wire). Replicas of a stage
average their gradients once per optimizer step of `--tokens-per-step` tokens (default 256
sequences, ~0.5M tokens; 0 ignores averaging, the planner's model before it was added), at a
fixed 0.75 s plus 2 G (R - 1) / R over the slowest replica's link. The baseline is the
best even split over every stage count (equal block counts, round-robin peers). Also timed:
the planner on a 1,000-peer swarm (aim: under a second), and the heuristic alone (exhaustive
search off) against the exact optimum on small random instances, with and without averaging.
One JSON document goes to stdout; the ratios are reported, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import random
import statistics
import time

from swarmtrain.plan import (
    PeerCapacity,
    PlanConfig,
    evaluate,
    even_split_plan,
    plan_swarm,
    transformer_block_cost,
)

GB = 1e9
TERA = 1e12
GBIT_S = 1e9 / 8

# name: (achieved flops/s, memory bytes, bandwidth range in bytes/s, is_spot)
PROFILES = {
    "a100": (0.5 * 312 * TERA, 80 * GB, (1.0 * GBIT_S, 1.0 * GBIT_S), True),
    "rtx4090": (0.5 * 165 * TERA, 24 * GB, (0.1 * GBIT_S, 0.3 * GBIT_S), False),
    "rtx3090": (0.5 * 71 * TERA, 24 * GB, (0.1 * GBIT_S, 0.3 * GBIT_S), False),
    "t4": (25 * TERA, 16 * GB, (1.0 * GBIT_S, 1.0 * GBIT_S), True),
    "cpu": (0.5 * TERA, 16 * GB, (0.1 * GBIT_S, 0.3 * GBIT_S), False),
}

MODELS = {
    "gpt-1.3b (24 x d2048)": {"num_blocks": 24, "d_model": 2048},
    "gpt-9.7b (48 x d4096)": {"num_blocks": 48, "d_model": 4096},
}
SEQ_LEN = 2048
TOKENS_IN_FLIGHT = 4 * SEQ_LEN  # 4 in-flight microbatches of one sequence each
TOKENS_PER_STEP = 256 * SEQ_LEN  # 524,288 tokens per optimizer step across the swarm

SWARMS = {
    "datacenter: 8 A100 + 16 T4": {"a100": 8, "t4": 16},
    "home: 12 RTX4090 + 12 RTX3090": {"rtx4090": 12, "rtx3090": 12},
    "mixed: 4 A100 + 8 4090 + 8 3090 + 8 T4 + 8 CPU": {
        "a100": 4,
        "rtx4090": 8,
        "rtx3090": 8,
        "t4": 8,
        "cpu": 8,
    },
    "gamers + laptops: 6 RTX4090 + 20 CPU": {"rtx4090": 6, "cpu": 20},
    "spot pool: 2 A100 + 30 T4": {"a100": 2, "t4": 30},
    "large: 1000 mixed": {"a100": 50, "rtx4090": 250, "rtx3090": 300, "t4": 200, "cpu": 200},
}


def make_swarm(counts: dict[str, int], rng: random.Random) -> list[PeerCapacity]:
    peers = []
    for profile, count in counts.items():
        flops, memory, (bw_lo, bw_hi), is_spot = PROFILES[profile]
        for k in range(count):
            peers.append(
                PeerCapacity(
                    peer_id=f"{profile}-{k:04d}",
                    flops_per_s=flops * rng.uniform(0.9, 1.1),
                    memory_bytes=memory,
                    bandwidth_bytes_per_s=rng.uniform(bw_lo, bw_hi),
                    is_spot=is_spot,
                )
            )
    rng.shuffle(peers)
    return peers


def describe(plan) -> dict:
    """The plan in brief; per-stage lists as one string ("3 3 2") so the JSON stays readable."""
    return {
        "tokens_per_s": round(plan.throughput_tokens_per_s, 1),
        "stages": plan.num_stages,
        "blocks_per_stage": " ".join(str(b - a) for a, b in itertools.pairwise(plan.stage_bounds)),
        "replicas_per_stage": " ".join(str(len(plan.replicas(s))) for s in range(plan.num_stages)),
        "trainers": len(plan.trainers),
    }


def compare(costs, peers, config) -> dict:
    start = time.perf_counter()
    plan = plan_swarm(costs, peers, config)
    plan_s = time.perf_counter() - start
    even = even_split_plan(costs, peers, config)
    assert not evaluate(plan, costs, peers, config).over_memory
    ratio = (
        plan.throughput_tokens_per_s / even.throughput_tokens_per_s if even.throughput_tokens_per_s else None
    )
    return {
        "plan": describe(plan),
        "even_split": describe(even),
        "ratio": None if ratio is None else round(ratio, 3),
        "plan_wall_s": round(plan_s, 3),
    }


def heuristic_quality(rng: random.Random, instances: int, averaging: bool) -> dict:
    """Gap of the heuristic alone (exhaustive search off) to the exact optimum on small swarms.

    With `averaging`, each instance also draws tokens_per_step (10, 100 or 1000 tokens, so
    averaging is from negligible to dominant) and averaging_overhead_s (0, 0.75 or 5 s).
    """
    from swarmtrain.plan import BlockCost

    def block() -> BlockCost:
        flops, weights_and_grads = rng.uniform(1, 10), rng.uniform(0, 10)
        return BlockCost(
            flops_per_token=flops,
            weight_bytes=weights_and_grads / 2,  # gradients as large as the weights
            grad_bytes=weights_and_grads / 2,
            optimizer_bytes=rng.uniform(0, 10),
            activation_bytes_per_token=rng.uniform(0, 1),
            boundary_bytes_per_token=rng.uniform(0, 5),
        )

    gaps = []
    for _ in range(instances):
        costs = [block() for _ in range(rng.randint(2, 6))]
        peers = [
            PeerCapacity(
                peer_id=f"p{i}",
                flops_per_s=rng.uniform(1, 100),
                memory_bytes=rng.uniform(5, 80),
                bandwidth_bytes_per_s=rng.uniform(1, 100),
            )
            for i in range(rng.randint(2, 4))
        ]
        exact_config = PlanConfig(tokens_in_flight=rng.randint(1, 10), exhaustive_limit=10**9)
        if averaging:
            exact_config = dataclasses.replace(
                exact_config,
                tokens_per_step=rng.choice([10, 100, 1000]),
                averaging_overhead_s=rng.choice([0.0, 0.75, 5.0]),
            )
        exact = plan_swarm(costs, peers, exact_config).throughput_tokens_per_s
        heuristic = plan_swarm(costs, peers, dataclasses.replace(exact_config, exhaustive_limit=0))
        if exact > 0:
            gaps.append(1 - heuristic.throughput_tokens_per_s / exact)
    gaps.sort()
    return {
        "instances": len(gaps),
        "within_1pct": round(sum(g <= 0.01 for g in gaps) / len(gaps), 3),
        "mean_gap": round(statistics.fmean(gaps), 5),
        "worst_gap": round(gaps[-1], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-peers", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality-instances", type=int, default=200)
    parser.add_argument(
        "--tokens-per-step", type=int, default=TOKENS_PER_STEP, help="0: ignore gradient averaging"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    config = PlanConfig(tokens_in_flight=TOKENS_IN_FLIGHT, tokens_per_step=args.tokens_per_step or None)

    results = []
    for model_name, shape in MODELS.items():
        costs = [transformer_block_cost(d_model=shape["d_model"], seq_len=SEQ_LEN)] * shape["num_blocks"]
        for swarm_name, counts in SWARMS.items():
            entry = compare(costs, make_swarm(counts, rng), config)
            results.append({"model": model_name, "swarm": swarm_name, **entry})

    costs = [transformer_block_cost(d_model=4096, seq_len=SEQ_LEN)] * 48
    scale = args.timing_peers / sum(SWARMS["large: 1000 mixed"].values())
    counts = {k: max(1, round(v * scale)) for k, v in SWARMS["large: 1000 mixed"].items()}
    peers = make_swarm(counts, rng)
    times, cpu_times = [], []
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        plan_swarm(costs, peers, config)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)

    ratios = [r["ratio"] for r in results if r["ratio"] is not None]
    print(
        json.dumps(
            {
                "benchmark": "planner",
                "python": platform.python_version(),
                "tokens_in_flight": TOKENS_IN_FLIGHT,
                "tokens_per_step": config.tokens_per_step,
                "averaging_overhead_s": config.averaging_overhead_s if config.tokens_per_step else None,
                "seq_len": SEQ_LEN,
                "swarms": results,
                "ratio_geomean": round(statistics.geometric_mean(ratios), 3) if ratios else None,
                "timing": {
                    "peers": len(peers),
                    "blocks": len(costs),
                    "wall_s_min": round(min(times), 3),
                    "wall_s_median": round(statistics.median(times), 3),
                    "cpu_s_min": round(min(cpu_times), 3),  # wall time swings on a shared machine
                    "aim_s": 1.0,
                },
                "heuristic_vs_exact_small": heuristic_quality(
                    random.Random(args.seed + 1), args.quality_instances, averaging=False
                ),
                "heuristic_vs_exact_small_averaging": heuristic_quality(
                    random.Random(args.seed + 2), args.quality_instances, averaging=True
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
