"""RL on an emulated heterogeneous swarm: rollouts on the weak peers against colocated and inverse.

    python benchmarks/rl.py [--seconds 60] [--strong 2] [--weak 2] [--eval-prompts 300]

One run, one JSON object. The same emulated machines serve three layouts of one GRPO run
(2-digit addition, tiny-gpt of the RL demo, started from one supervised warm-up done here):

- `planned`: the split the joint planner picks (`swarmtrain.plan.rl.split_rl`, what
  `join --role auto` peers follow) from the machines' rates: this machine's probe (matmul
  FLOP/s, decode tokens/s of the warm policy) divided by each machine's slowdowns. It gave the
  stages to the strong machines and the rollouts to the weak ones (asynchronously, the
  trainer's feed keeping the next step's completions asked for, at most `--max-staleness`
  versions old);
- `colocated`: every machine holds a stage replica *and* samples, in turns: a step's
  completions are sampled from the very version it trains, by all machines at once, then all
  machines train on them (`RolloutFeed(on_policy=True)`);
- `inverse`: the planned split's two sides swapped: the strong machines sample, the weak ones train.

A machine is emulated by the processes it would run, each with `--slowdown` (compute takes that
many times longer; the sleep leaves the cores free) and `--max-memory` (checked by both roles).
Training is compute-bound and sampling memory-bandwidth-bound, so a consumer card is far
further behind a data-centre one at the first than at the second (an RTX 3060 has ~1/75 of an
H100's dense bf16 FLOP/s but ~1/9 of its memory bandwidth): the weak profile's training
slowdown is 8x the strong one's, its sampling slowdown 2x.

Each layout trains for `--seconds` of wall time (from the first step) after its peers serve.
Reported per layout: steps, trained samples per second, mean reward over the last steps,
held-out greedy accuracy of the policy the stages hold at the end; and
`speedup_vs_colocated` = planned samples/s over colocated samples/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
from swarmtrain.rl.feed import RolloutFeed
from swarmtrain.rl.generate import accuracy
from swarmtrain.rl.local import DEFAULT_MODEL, LocalConfig, warm_up
from swarmtrain.rl.registry import build_task
from swarmtrain.train.archive import save_model
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from swarmtrain.wire.rl_config import RLConfig


@dataclass(frozen=True)
class Machine:
    """An emulated machine: how much slower than this CPU it trains and samples, its memory."""

    name: str
    train_slowdown: float
    sample_slowdown: float
    memory: str


STRONG = Machine("strong", train_slowdown=4.0, sample_slowdown=4.0, memory="8GB")
WEAK = Machine("weak", train_slowdown=32.0, sample_slowdown=8.0, memory="2GB")

TASK, TASK_OPTIONS = "add", {"digits": 2}
G = 8
RL = RLConfig(task=TASK, task_options=TASK_OPTIONS, samples_per_prompt=G)
PROMPTS_PER_STEP = 32
BATCH = BatchConfig(microbatch_size=32, microbatches_per_step=8, max_in_flight=8)
OPTIMIZER = OptimizerConfig(name="adamw", lr=3e-4, weight_decay=0.0, max_grad_norm=1.0)
CHUNK_STEPS = 2
"""Steps per `trainer.train` call; the clock is read between calls."""


def stage_args(machine: Machine) -> tuple[str, ...]:
    return (
        "--slowdown",
        str(machine.train_slowdown),
        "--max-memory",
        machine.memory,
        "--rebalance-every",
        "0",
    )


def rollout_args(machine: Machine) -> tuple[str, ...]:
    return ("--slowdown", str(machine.sample_slowdown), "--max-memory", machine.memory)


def plan_roles(machines: list[Machine], policy) -> tuple[list[Machine], list[Machine], dict]:
    """The joint planner's split of the emulated machines (`swarmtrain.plan.rl.split_rl`), as
    `join --role auto` peers would reach it: each machine's capacity is this machine's probe
    (matmul FLOP/s; decode tokens/s of the warm policy on the task) divided by its slowdowns.
    Returns the machines it gives stages, those it gives rollouts, and what it predicted."""
    from swarmtrain.peers.probe import parse_bytes, probe
    from swarmtrain.plan import PeerCapacity, PlanConfig, split_rl
    from swarmtrain.plan.rl import RLDemand
    from swarmtrain.rl.generate import measure_decode
    from swarmtrain.train.placement import planner_costs, sample_positions

    flops = probe("cpu", seconds=1.0).matmul_flops_per_s
    prompts = PROMPTS_PER_STEP // 2  # one request when two rollout peers share a step (as the peers probe)
    decode = measure_decode(
        policy, build_task(TASK, TASK_OPTIONS), samples_per_prompt=G, prompts=prompts, seconds=1.0
    )
    peers = [
        PeerCapacity(
            peer_id=f"{i}-{m.name}",
            flops_per_s=flops / m.train_slowdown,
            memory_bytes=parse_bytes(m.memory),
            bandwidth_bytes_per_s=10e9,  # loopback
            decode_tokens_per_s=decode / m.sample_slowdown,
        )
        for i, m in enumerate(machines)
    ]
    tokens = sample_positions("tiny-gpt", DEFAULT_MODEL)
    split = split_rl(
        (0, 1, 2),
        planner_costs("tiny-gpt", DEFAULT_MODEL, microbatch_size=BATCH.microbatch_size),
        peers,
        PlanConfig(
            tokens_in_flight=tokens * BATCH.microbatch_size * BATCH.max_in_flight,
            tokens_per_step=tokens * BATCH.microbatch_size * BATCH.microbatches_per_step,
        ),
        RLDemand(
            tokens_per_sample=tokens, decode_tokens_per_sample=build_task(TASK, TASK_OPTIONS).max_new_tokens
        ),
    )
    by_id = {p.peer_id: machines[i] for i, p in enumerate(peers)}
    # stage machines in stage order, so run_layout's i % 2 puts each on its planned stage
    stages = [by_id[p] for p, _ in sorted(split.plan.assignments.items(), key=lambda kv: (kv[1], kv[0]))]
    rollouts = [by_id[p] for p in split.rollouts]
    predicted = {
        "stages": {p: k for p, k in sorted(split.plan.assignments.items())},
        "rollouts": list(split.rollouts),
        "consumed_samples_per_s": round(split.consumed_samples_per_s, 1),
        "produced_samples_per_s": round(split.produced_samples_per_s, 1),
        "probe_flops_per_s": round(flops),
        "probe_decode_tokens_per_s": round(decode),
    }
    return stages, rollouts, predicted


def layouts(
    strong: int, weak: int, planned: tuple[list[Machine], list[Machine]]
) -> dict[str, tuple[list[Machine], list[Machine], bool]]:
    """Per layout: machines holding stages, machines sampling, on-policy turns or not. `planned`
    is the planner's split; the inverse swaps its two sides."""
    machines = [STRONG] * strong + [WEAK] * weak
    return {
        "planned": (*planned, False),
        "colocated": (machines, machines, True),
        "inverse": (planned[1], planned[0], False),
    }


def run_layout(
    name: str,
    stages: list[Machine],
    rollouts: list[Machine],
    on_policy: bool,
    *,
    warm: Path,
    seconds: float,
    eval_prompts: int,
    log_dir: Path,
) -> dict:
    task = build_task(TASK, TASK_OPTIONS)
    config = LocalSwarmConfig(
        run_id=f"rl-{name}",
        model_config=DEFAULT_MODEL,
        num_stages=2,
        rl=RL,
        init_from=str(warm),
        batch=BATCH,
        optimizer=OPTIMIZER,
        log_dir=str(log_dir / name),
        stage_args={0: stage_args(stages[0]), 1: stage_args(stages[1 % len(stages)])},
        coordinator_args=("--checkpoint-every", "0"),
    )
    with LocalSwarm(config) as swarm:
        extra = [
            swarm.spawn_stage(i % 2, extra_args=stage_args(m), wait=False) for i, m in enumerate(stages[2:])
        ]
        extra += [swarm.spawn_rollout(extra_args=rollout_args(m), wait=False) for m in rollouts]
        for peer in extra:
            swarm.wait_ready(peer)
        with swarm.trainer() as trainer:
            feed = RolloutFeed(trainer, on_policy=on_policy)
            rewards, steps = [], 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                for result in trainer.train(feed, steps=CHUNK_STEPS):
                    rewards.append(feed.report(result.step)["reward"])
                    steps += 1
            elapsed = time.monotonic() - t0
            report = feed.report(steps - 1)
            policy = trainer.fetch_model()
            feed.close()
    tail = rewards[-max(1, len(rewards) // 4) :]
    return {
        "stages": [m.name for m in stages],
        "rollouts": [m.name for m in rollouts],
        "on_policy": on_policy,
        "steps": steps,
        "seconds": round(elapsed, 2),
        "samples_per_s": round(steps * BATCH.microbatch_size * BATCH.microbatches_per_step / elapsed, 2),
        "seconds_per_step": round(elapsed / steps, 3),
        "reward_last_quarter": round(sum(tail) / len(tail), 4),
        "heldout_accuracy": round(accuracy(policy, task, eval_prompts), 4),
        "policy_lag_last": report["policy_lag"],
        "stale": report["stale"],
        "lost": report["lost"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="GRPO wall time per layout")
    parser.add_argument("--strong", type=int, default=2)
    parser.add_argument("--weak", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=300)
    parser.add_argument("--only", default="planned,colocated,inverse")
    args = parser.parse_args()
    if args.strong < 2 or args.weak < 2:
        parser.error("--strong and --weak must each be >= 2 (two stages)")

    task = build_task(TASK, TASK_OPTIONS)
    t0 = time.monotonic()
    model, warmup_steps = warm_up(
        LocalConfig(task=TASK, task_options=TASK_OPTIONS, model=DEFAULT_MODEL, seed=0)
    )
    report = {
        "task": TASK,
        "samples_per_step": BATCH.microbatch_size * BATCH.microbatches_per_step,
        "machines": {m.name: vars(m) for m in (STRONG, WEAK)},
        "warmup_steps": warmup_steps,
        "warmup_seconds": round(time.monotonic() - t0, 1),
        "warmup_accuracy": round(accuracy(model, task, args.eval_prompts), 4),
        "seconds_per_layout": args.seconds,
        "layouts": {},
    }
    planned_stages, planned_rollouts, report["planner"] = plan_roles(
        [STRONG] * args.strong + [WEAK] * args.weak, model
    )
    print(f"planner: {json.dumps(report['planner'])}", file=sys.stderr)
    if len(planned_stages) < 2 or len(planned_rollouts) < 2:
        raise SystemExit(
            "the planner's split leaves fewer than 2 machines on one side: no inverse to compare"
        )
    wanted = args.only.split(",")
    with tempfile.TemporaryDirectory(prefix="swarmtrain-bench-rl-") as tmp:
        warm = save_model(model, Path(tmp) / "warm", builder="tiny-gpt", config=DEFAULT_MODEL)
        for name, (stages, rollouts, on_policy) in layouts(
            args.strong, args.weak, (planned_stages, planned_rollouts)
        ).items():
            if name not in wanted:
                continue
            print(
                f"{name}: stages on {[m.name for m in stages]}, rollouts on {[m.name for m in rollouts]}",
                file=sys.stderr,
            )
            report["layouts"][name] = run_layout(
                name,
                stages,
                rollouts,
                on_policy,
                warm=warm,
                seconds=args.seconds,
                eval_prompts=args.eval_prompts,
                log_dir=Path(tmp) / "logs",
            )
            print(json.dumps(report["layouts"][name]), file=sys.stderr)
    got = report["layouts"]
    if "planned" in got and "colocated" in got:
        report["speedup_vs_colocated"] = round(
            got["planned"]["samples_per_s"] / got["colocated"]["samples_per_s"], 3
        )
    if "planned" in got and "inverse" in got:
        report["speedup_vs_inverse"] = round(
            got["planned"]["samples_per_s"] / got["inverse"]["samples_per_s"], 3
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
