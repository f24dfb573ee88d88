"""Planned layout against an even split on the same heterogeneous peers, on loopback.

    python benchmarks/elastic.py [--steps 12] [--slowdowns 1,1,4,4]
    python benchmarks/elastic.py --joins [--steps 12] [--slowdowns 4,4,8,16,16,4] [--small-memory-peer 6] [--all-first]
    python benchmarks/elastic.py --live [--steps 10]

Starts a real swarm (coordinator and stage peers as processes, emulated speeds with
--slowdown) twice in one run: once with the blocks split evenly over one peer per stage,
once with the stages and replicas the planner chooses from the peers' capacities. Prints
JSON: tokens/s of each (median over steps, after warm-up) and their ratio.

`--joins`: peers that come to a running swarm. Peers with slowdowns 4,4,8,16,16,4 (1,1,2,4,4,1
for peers at a quarter of a core's speed: six of them share 2 cores and the host's cores do
not decide the figures; one with little memory, `--max-memory`) come to a run: the first ones, one per stage, start it, the others join the
running swarm one every JOIN_EVERY steps. Three runs side by side: (b) the coordinator's even
split kept fixed, the peers choosing stages by the join rule; (c) the layout planned once from
the first peers (`--min-peers` = `--stages`), the later ones joining it; (a) the same, with
live re-planning (`--replan`: the lead trainer moves the swarm as peers come). Steady-state
tokens/s after the last join, each move's pause, and the ratios `live_vs_even` (a/b),
`live_vs_planned_once` (a/c) and `planned_once_vs_even` (c/b); `--all-first` adds (d), a
layout planned once every peer has come.

`--live`: two equal peers, one of which turns 4x slower mid-run: live re-planning against the
even split kept and a layout planned once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
from swarmtrain.peers.probe import probe
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.placement import plan_emulated_peers
from swarmtrain.wire.records import BatchConfig, even_split

MODEL = {"n_layer": 8, "n_head": 4, "d_model": 128, "seq_len": 64, "vocab_size": 256}
BATCH = BatchConfig(microbatch_size=8, microbatches_per_step=8, max_in_flight=8)
WARMUP_STEPS = 2
SMALL_MEMORY = "96MiB"
"""--max-memory of the small peer in --joins: room for about two of the eight blocks (their state and 8 microbatches of activations)."""


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


JOIN_EVERY = 8
"""Steps between two peers joining the running swarm in --joins (about 5-10 s on 2 cores)."""
JOINS_REPLAN = ("--replan", "--replan-gain", "0.2", "--replan-patience", "2", "--replan-every", "2")
MAX_JOIN_STEPS = 400
"""Most steps a --joins variant trains before it is timed, whatever still moves."""


def measure_joins(
    slowdowns: list[float], small: int, min_peers: int, steps: int, stages: int = 3, *, live: bool = False
) -> dict:
    """Peers with `slowdowns` (the `small`-th, 1-based, with little memory; 0: none) come to a
    run of `stages` stages whose layout is planned from the first `min_peers` of them (0: an
    even split from the start). The first `stages` (or `min_peers`) peers start the run; the
    others join the running swarm one every JOIN_EVERY steps. With `live`, the run re-plans
    as they come (`--replan`). Steady-state tokens/s once all serve (and, live, once the
    layout has held for the timed steps)."""
    from swarmtrain.train.layout import replan_proposal
    from swarmtrain.train.placement import layout_prediction

    def args(i: int) -> tuple[str, ...]:
        extra = ("--max-memory", SMALL_MEMORY) if i + 1 == small else ()
        return ("--slowdown", str(slowdowns[i]), "--rebalance-every", "0", *extra)

    first = max(min_peers, stages)
    config = LocalSwarmConfig(
        model_config=MODEL,
        num_stages=stages,
        min_peers=min_peers,
        plan_wait_s=600.0,
        stage_args={i: args(i) for i in range(min(first, stages))},
        coordinator_args=JOINS_REPLAN if live else (),
        batch=BATCH,
    )
    with LocalSwarm(config) as swarm:
        for i in range(stages, first):
            swarm.spawn_stage(None, extra_args=args(i))
        data = TokenBatches(
            stdlib_text(2**22), seq_len=MODEL["seq_len"], microbatch_size=BATCH.microbatch_size, seed=0
        )
        names = [name for name in swarm.procs if name.startswith("stage")]  # in join order
        later = list(range(first, len(slowdowns)))
        results, all_in = [], None
        with swarm.trainer() as trainer:
            for result in trainer.train(data, steps=MAX_JOIN_STEPS + steps):
                results.append(result)
                n = len(results)
                if later and n % JOIN_EVERY == 0:
                    names.append(swarm.spawn_stage(None, extra_args=args(later.pop(0)), wait=False))
                if (
                    all_in is None
                    and not later
                    and all((swarm.log_dir / f"{x}.ready").exists() for x in names)
                ):
                    all_in = n  # the last peer to join serves
                moves = trainer.layout_moves
                if (
                    all_in is not None
                    and n >= all_in + WARMUP_STEPS + steps
                    and (not moves or moves[-1][0] < result.step - steps or n >= MAX_JOIN_STEPS)
                ):
                    break
            manifest = trainer.node.get_manifest(trainer.manifest.run_id)
            records = trainer.node.peers(manifest.run_id)
            moves = list(trainer.layout_moves)
        slowdown_of = {swarm.wait_ready(name): slowdowns[i] for i, name in enumerate(names)}
    timed = results[-steps:]
    rates = [r.tokens_per_s for r in timed]
    proposal = replan_proposal(manifest, records)
    prediction = layout_prediction(manifest, records) or {}
    stages = [
        sorted(slowdown_of[r.peer_id] for r in records if r.role == "stage" and r.stage == k)
        for k in range(manifest.num_stages)
    ]
    exchanges = [r.exchange_s for r in records if r.role == "stage" and r.exchange_s > 0]
    return {
        "min_peers": min_peers,
        "live": live,
        "predicted_tokens_per_s": prediction.get("predicted_tokens_per_s"),
        "exchange_s_median": statistics.median(exchanges) if exchanges else None,
        "stage_bounds": list(manifest.stage_bounds),
        "layout_version": manifest.layout_version,
        "layout_note": manifest.layout_note,
        "moves": [{"step": s, "layout": v, "paused_s": p} for s, v, p in moves],
        "peer_slowdowns_per_stage": stages,
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "steps": len(results),
        "last_join_serving_at_step": all_in,
        "replan_predicted_gain": None if proposal is None else proposal.gain,
    }


def measure_live(variant: str, steps: int, tmp: Path) -> dict:
    """Two stages on two peers of equal speed; after WARMUP_STEPS + 3 steps stage 1's peer
    turns 4x slower (a throttled or shared GPU) and stays so. `variant`: 'live' (`--replan`:
    the owner re-plans from measured speeds and the trainer moves the swarm), 'even' (the even
    split kept), 'planned_once' (`--min-peers 2`: planned from the peers as they came, kept).
    Tokens/s of `steps` steps once the change has settled (after the move, for 'live')."""
    slow = tmp / f"slowdown-{variant}"
    replan = ("--replan", "--replan-gain", "0.3", "--replan-patience", "2", "--replan-every", "1")
    config = LocalSwarmConfig(
        model_config=MODEL,
        num_stages=2,
        min_peers=2 if variant == "planned_once" else 0,
        stage_args={
            k: ("--rebalance-every", "0", *(("--slowdown-file", str(slow)) if k == 1 else ()))
            for k in range(2)
        },  # fmt: skip
        coordinator_args=replan if variant == "live" else (),
        batch=BATCH,
        log_dir=str(tmp / variant),
    )
    data = TokenBatches(
        stdlib_text(2**22), seq_len=MODEL["seq_len"], microbatch_size=BATCH.microbatch_size, seed=0
    )
    settle = WARMUP_STEPS + 3 + 20  # the throttle, then time for a re-plan and a move
    with LocalSwarm(config) as swarm, swarm.trainer() as trainer:
        results = []
        for result in trainer.train(data, steps=settle + steps + 200):
            results.append(result)
            if len(results) == WARMUP_STEPS + 3:
                slow.write_text("4")
            settled = len(results) >= settle and (variant != "live" or trainer.layout_moves)
            if (
                settled
                and len(results) >= settle + steps
                and (variant != "live" or trainer.layout_moves[-1][0] < len(results) - steps)
            ):
                break
        manifest, moves = trainer.manifest, list(trainer.layout_moves)
    timed = results[-steps:]
    return {
        "stage_bounds": list(manifest.stage_bounds),
        "layout_version": manifest.layout_version,
        "moves": [{"step": s, "layout": v, "paused_s": p} for s, v, p in moves],
        "tokens_per_s_median": statistics.median(r.tokens_per_s for r in timed),
        "steps": len(results),
    }


def main_live(args) -> None:
    import tempfile

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elastic-live-") as tmp:
        runs = {v: measure_live(v, args.steps, Path(tmp)) for v in ("even", "planned_once", "live")}
    print(
        json.dumps(
            {
                "benchmark": "elastic --live",
                "aim": "live re-planning >= 1.3x the even split kept fixed, and not below a layout planned once",
                "model": MODEL,
                "batch": BATCH.to_dict(),
                "scenario": "2 stages, 2 equal peers; stage 1's peer turns 4x slower after 5 steps",
                "runs": runs,
                "live_vs_even": runs["live"]["tokens_per_s_median"] / runs["even"]["tokens_per_s_median"],
                "live_vs_planned_once": runs["live"]["tokens_per_s_median"]
                / runs["planned_once"]["tokens_per_s_median"],
                "elapsed_s": time.monotonic() - started,
            },
            indent=2,
        )
    )


def main_joins(args) -> None:
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    started = time.monotonic()
    n, first = args.stages, min(args.stages, len(slowdowns))
    runs = {
        "even_split_fixed": measure_joins(slowdowns, args.small_memory_peer, 0, args.steps, n),
        "planned_once": measure_joins(slowdowns, args.small_memory_peer, first, args.steps, n),
        "live": measure_joins(slowdowns, args.small_memory_peer, first, args.steps, n, live=True),
    }
    if args.all_first:
        runs["planned_from_all"] = measure_joins(
            slowdowns, args.small_memory_peer, len(slowdowns), args.steps, n
        )
    rate = {k: v["tokens_per_s_median"] for k, v in runs.items()}
    print(
        json.dumps(
            {
                "benchmark": "elastic --joins",
                "aim": "live re-planning >= 1.3x the coordinator's even split kept fixed, and not below a layout "
                "planned once from the first peers",
                "model": MODEL,
                "batch": BATCH.to_dict(),
                "stages": n,
                "peer_slowdowns_in_join_order": slowdowns,
                "small_memory_peer": args.small_memory_peer,
                "join_every_steps": JOIN_EVERY,
                "runs": runs,
                "live_vs_even": rate["live"] / rate["even_split_fixed"],
                "live_vs_planned_once": rate["live"] / rate["planned_once"],
                "planned_once_vs_even": rate["planned_once"] / rate["even_split_fixed"],
                **(
                    {"planned_from_all_vs_even": rate["planned_from_all"] / rate["even_split_fixed"]}
                    if args.all_first
                    else {}
                ),
                "elapsed_s": time.monotonic() - started,
            },
            indent=2,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per layout (default 12)")
    parser.add_argument("--slowdowns", default="1,1,4,4", help="one --slowdown per peer (default 1,1,4,4)")
    parser.add_argument(
        "--joins", action="store_true", help="peers join one by one: even split vs planned layouts"
    )
    parser.add_argument(
        "--small-memory-peer",
        type=int,
        default=6,
        help="with --joins: the n-th peer (1-based) has little memory; 0: none",
    )
    parser.add_argument("--stages", type=int, default=3, help="with --joins: the run's stages (default 3)")
    parser.add_argument(
        "--all-first",
        action="store_true",
        help="with --joins: also a layout planned once every peer has come (--min-peers = all)",
    )
    parser.add_argument(
        "--live", action="store_true", help="live re-planning vs an even split and a layout planned once"
    )
    args = parser.parse_args()
    if args.live:
        main_live(args)
        return
    if args.joins:
        if args.slowdowns == "1,1,4,4":  # 1,1,2,4,4,1 at a quarter of a core's speed: six peers
            args.slowdowns = "4,4,8,16,16,4"  # sleep more than they compute on 2 cores
        main_joins(args)
        return
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
