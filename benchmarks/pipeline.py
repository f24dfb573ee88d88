"""swarmtrain's schedules against torch.distributed.pipelining, on loopback processes, in one run.

    python benchmarks/pipeline.py [--steps 4] [--scenarios homogeneous,slow_replica,kill_replica]
                                  [--stages 2] [--torch-schedule 1f1b] [--d-model 128]

Same model (tiny-gpt, each stage built by `build_stage`), same microbatches
(`TokenBatches(stdlib_text(...), seed=0)`, 8 of 8 sequences a step), one torch thread per
stage process, the swarm's trainer in this process. Scenarios:
- homogeneous: S equal stages, one peer each: torch pipelining (gloo), swarm static, swarm readiness.
- slow_replica: 2 stages, the heavier stage 1 on two replicas, one 4x slower: static and
  readiness (torch pipelining has no replicas).
- kill_replica: readiness, the last stage on two replicas; one is SIGKILLed halfway through the
  timed steps (at least 6 here): a per-step timeline, the time until a step is back to 90% of
  the survivors' tokens/s, the microbatch accounting.
- trust (not in the default list): readiness, 2 stages, the last on two replicas, as an open
  swarm that authorizes any trainer against a private swarm (--swarm-key: a challenge on every
  stream, sealed records) whose owner authorizes its trainers, alternated TRUST_PAIRS times;
  plus what signing one DHT record and checking one costs, against how many a peer writes.
Prints one JSON object (progress and peer warnings go to stderr). Every swarm peer runs with
--rebalance-every 0 so layouts stay put. With the defaults it took 6-8 minutes on 2 cores shared
with other work (load average 6-8), half of it starting the 5 swarms.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
from swarm_runs import BATCH, TEXT_BYTES, BenchConfig, Layout, run_swarm
from torch_pipelining import PipeliningConfig, run_pipelining

from swarmtrain.wire.records import even_split

MODEL_BASE = {"n_layer": 8, "n_head": 4, "seq_len": 128, "vocab_size": 256}
"""ENVIRONMENT.md's reference GPT but for its width (d_model 256 there: --d-model 256)."""
DEFAULT_D_MODEL = 128  # 256 ran ~3.5x slower a step here (torch pipelining: ~1,000 vs ~3,600 tokens/s)
SLOWDOWN = 4.0
RECOVERED = 0.9
"""A step counts as recovered at this fraction of the reference tokens/s."""
KILL_MIN_STEPS = 6
"""kill_replica times at least this many steps, so that two or more steps follow the kill's step."""
SCENARIOS = ("homogeneous", "slow_replica", "kill_replica", "trust")
TRUST_PAIRS = 2
"""The trust scenario alternates open and trusted swarms this many times each (drift cancels)."""
MEASURES = {
    "tokens_per_s": "median over the timed steps of tokens / step wall time",
    "utilization": "swarm: d(PeerRecord.busy_s)/d(wall); torch: forward+loss+backward seconds "
    "(module hooks and autograd marks) / wall; null where not measured",
    "cpu_utilization": "process CPU seconds (/proc; process_time in torch ranks) / wall: includes "
    "serialization, excludes --slowdown sleeps and the time the OS gave other processes",
    "bubble_fraction": "1 - mean utilization over the stage peers alive at the end",
    "wall": "sum of the timed steps' wall times",
}


def homogeneous(cfg: BenchConfig) -> dict:
    """S equal stages, one peer each: torch pipelining, static and readiness on the same stages."""
    bounds = even_split(cfg.num_blocks, cfg.stages)
    layout = Layout(stage_bounds=bounds, slowdowns=((1.0,),) * cfg.stages)
    baseline = run_pipelining(
        PipeliningConfig(
            model_config=cfg.model_config,
            stage_bounds=bounds,
            batch=BATCH,
            schedule=cfg.torch_schedule,
            text_bytes=TEXT_BYTES,
            warmup_steps=cfg.warmup_steps,
            steps=cfg.steps,
        )
    )
    static = run_swarm(cfg, "static", layout)
    readiness = run_swarm(cfg, "readiness", layout)
    ratio = readiness["tokens_per_s_median"] / baseline["tokens_per_s_median"]
    diffs = [abs(a - b) for run in (static, readiness) for a, b in zip(run["losses"], baseline["losses"])]
    return {
        "aim": "readiness tokens/s >= 0.8x torch.distributed.pipelining",
        "torch_pipelining": baseline,
        "static": static,
        "readiness": readiness,
        "readiness_over_torch": ratio,
        "static_over_torch": static["tokens_per_s_median"] / baseline["tokens_per_s_median"],
        "meets_aim": ratio >= 0.8,
        "losses_max_abs_diff_vs_torch": max(diffs),  # same stages, data and optimizer: ~0
    }


def slow_replica(cfg: BenchConfig) -> dict:
    """Stage 1 (3/4 of the blocks and the head) on a full-speed and a 4x slower replica."""
    n = cfg.num_blocks
    layout = Layout(stage_bounds=(0, n // 4, n), slowdowns=((1.0,), (1.0, SLOWDOWN)))
    static = run_swarm(cfg, "static", layout)
    readiness = run_swarm(cfg, "readiness", layout)
    ratio = readiness["tokens_per_s_median"] / static["tokens_per_s_median"]
    return {
        "aim": "readiness tokens/s >= 1.5x static",
        "layout": f"stage 0: blocks 0-{n // 4 - 1}; stage 1: blocks {n // 4}-{n - 1} and the head, "
        f"on two replicas, the second {SLOWDOWN:g}x slower",
        "torch_pipelining": {"applicable": False, "reason": "one process per stage: it has no replicas"},
        "static": static,
        "readiness": readiness,
        "readiness_over_static": ratio,
        "meets_aim": ratio >= 1.5,
    }


def trust(cfg: BenchConfig) -> dict:
    """The cost of trust: tokens/s of a private, authorized swarm over an open one, same layout."""
    import tempfile
    from pathlib import Path

    from swarmtrain.trust import generate_swarm_key

    n = cfg.num_blocks
    layout = Layout(stage_bounds=(0, n // 2, n), slowdowns=((1.0,), (1.0, 1.0)))
    key = Path(tempfile.mkdtemp(prefix="swarmtrain-bench-")) / "swarm.key"
    generate_swarm_key(key)
    runs: dict[str, list[dict]] = {"open": [], "trusted": []}
    for _ in range(TRUST_PAIRS):
        runs["open"].append(run_swarm(cfg, "readiness", layout, trust=False))
        runs["trusted"].append(run_swarm(cfg, "readiness", layout, swarm_key=str(key), trust=True))
    medians = {name: statistics.median(r["tokens_per_s_median"] for r in rs) for name, rs in runs.items()}
    ratio = medians["trusted"] / medians["open"]
    return {
        "aim": "trusted tokens/s >= 0.97x open (the cost of trust <= 3%)",
        "layout": "stage 0: half the blocks; stage 1: the rest and the head, on two replicas",
        "open": runs["open"],
        "trusted": runs["trusted"],
        "tokens_per_s_open": medians["open"],
        "tokens_per_s_trusted": medians["trusted"],
        "trusted_over_open": ratio,
        "meets_aim": ratio >= 0.97,
        "record_signatures": signing_cost(),
    }


def signing_cost(rounds: int = 200) -> dict:
    """Microseconds to sign one peer record and to check one, and the share of a core that costs
    a stage peer at its heartbeat rate (it signs one record a heartbeat and checks those it reads)."""
    import dataclasses as dc
    import tempfile
    from pathlib import Path

    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from swarmtrain.peers.stage import StageConfig
    from swarmtrain.trust.identity import Identity
    from swarmtrain.trust.records import check_envelope, sign_record
    from swarmtrain.wire.keys import peers_key
    from swarmtrain.wire.records import PeerRecord

    me = Identity.load(Path(tempfile.mkdtemp()) / "bench.key")
    body = PeerRecord(peer_id=me.peer_id, role="stage", stage=0).to_dict()
    key, expires = peers_key("bench"), get_dht_time() + 60
    t = time.perf_counter()
    for _ in range(rounds):
        envelope = sign_record(me, key, body, expires)
    sign_us = (time.perf_counter() - t) / rounds * 1e6
    record = DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(me.peer_id),
        MSGPackSerializer.dumps(envelope),
        expires,
    )
    t = time.perf_counter()
    for _ in range(rounds):
        check_envelope(dc.replace(record, expiration_time=expires))
    check_us = (time.perf_counter() - t) / rounds * 1e6
    heartbeat_s = StageConfig.__dataclass_fields__["heartbeat_s"].default
    return {
        "sign_us": sign_us,
        "check_us": check_us,
        "heartbeat_s": heartbeat_s,
        "core_share_per_peer_of_4": (sign_us + 4 * check_us) / 1e6 / heartbeat_s,
        "note": "a peer signs its record once a heartbeat and checks the records of the peers it reads "
        "(4 here) as often; repeated lookups of the same record hit the validator's cache",
    }


def recovery(timeline: list[dict], reference_tokens_per_s: float) -> dict:
    """When the steps after the kill are back to RECOVERED x `reference_tokens_per_s`.

    The recovered step is the first one ending after the kill that runs at least that fast;
    recovery_s is its start relative to the kill (0 if it started before). `later_steps_below`
    counts the steps after it that fell below again (load on the machine, or a relapse).
    All None if no step after the kill got there.
    """
    after = [row for row in timeline if row["end_s"] > 0]
    threshold = RECOVERED * reference_tokens_per_s
    for i, row in enumerate(after):
        if row["tokens_per_s"] >= threshold:
            return {
                "recovery_s": max(0.0, row["start_s"]),
                "recovered_at_step": row["step"],
                "later_steps_below": sum(r["tokens_per_s"] < threshold for r in after[i + 1 :]),
            }
    return {"recovery_s": None, "recovered_at_step": None, "later_steps_below": None}


def kill_replica(cfg: BenchConfig, survivors: dict | None) -> dict:
    """Readiness with the last stage on two replicas; SIGKILL the second halfway through.

    `survivors`: figures of a readiness run of the survivors-only layout (the homogeneous one)
    from this same benchmark run, or None to run it here first.
    """
    bounds = even_split(cfg.num_blocks, cfg.stages)
    last = cfg.stages - 1
    source = "homogeneous.readiness (the survivors' layout, this run)"
    if survivors is None:
        survivors = run_swarm(cfg, "readiness", Layout(stage_bounds=bounds, slowdowns=((1.0,),) * cfg.stages))
        source = "a survivors-only readiness run"
    layout = Layout(stage_bounds=bounds, slowdowns=((1.0,),) * last + ((1.0, 1.0),))
    run = run_swarm(
        dataclasses.replace(cfg, steps=max(cfg.steps, KILL_MIN_STEPS)), "readiness", layout, kill=(last, 1)
    )
    timeline = run["timeline"]
    pre_kill = [row["tokens_per_s"] for row in timeline if row["end_s"] <= 0]
    figures = {
        "aim": "a tokens/s timeline, and the time after the kill until a step is back to >= 90% "
        "of the survivors' steady tokens/s",
        "readiness": run,
        "survivors_tokens_per_s": survivors["tokens_per_s_median"],
        "survivors_source": source,
        "pre_kill_tokens_per_s_median": statistics.median(pre_kill) if pre_kill else None,
    }
    if run["kill_happened"]:
        figures |= recovery(timeline, survivors["tokens_per_s_median"])
        if pre_kill:  # the same run's own steps before the kill: a reference with the same machine load
            figures["recovery_s_vs_pre_kill"] = recovery(timeline, statistics.median(pre_kill))["recovery_s"]
    figures["accounting"] = {
        "microbatches_per_step": BATCH.microbatches_per_step,
        "steps": run["steps"],
        "replays": run["replays"],
        "dropped": run["dropped"],
        "per_step": "readiness.timeline holds every StepResult counter (replays, dropped, and any "
        "completed/replayed/dropped-cause fields the trainer has)",
    }
    return figures


def parse_args() -> tuple[BenchConfig, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=4, help="timed steps per run, after 2 warm-up steps (default 4)"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS[:3]),
        help="comma list of " + ", ".join(SCENARIOS) + " (default: all but trust)",
    )
    parser.add_argument(
        "--stages", type=int, default=2, help="stages of homogeneous and kill_replica (default 2)"
    )
    parser.add_argument("--torch-schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument(
        "--d-model",
        type=int,
        default=DEFAULT_D_MODEL,
        help="tiny-gpt width (ENVIRONMENT.md's reference: 256)",
    )
    args = parser.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not scenarios or set(scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios takes a comma list of {', '.join(SCENARIOS)}, got {args.scenarios!r}")
    try:
        cfg = BenchConfig(
            model_config=dict(MODEL_BASE, d_model=args.d_model),
            steps=args.steps,
            stages=args.stages,
            torch_schedule=args.torch_schedule,
        )
    except ValueError as e:
        parser.error(str(e))
    return cfg, scenarios


def main() -> None:
    cfg, scenarios = parse_args()
    started = time.monotonic()
    out: dict = {
        "benchmark": "pipeline",
        "model": cfg.model_config,
        "batch": BATCH.to_dict(),
        "warmup_steps": cfg.warmup_steps,
        "timed_steps": cfg.steps,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads_per_stage_process": 1},
        "measures": MEASURES,
    }
    if "homogeneous" in scenarios:
        out["homogeneous"] = homogeneous(cfg)
    if "slow_replica" in scenarios:
        out["slow_replica"] = slow_replica(cfg)
    if "trust" in scenarios:
        out["trust"] = trust(cfg)
    if "kill_replica" in scenarios:
        survivors = out["homogeneous"]["readiness"] if "homogeneous" in out else None
        out["kill_replica"] = kill_replica(cfg, survivors)
    out["elapsed_s"] = time.monotonic() - started
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
