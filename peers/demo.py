"""`swarmtrain demo`: a whole swarm on this machine, trained while you watch.

A coordinator, one stage peer per stage and a trainer, each a separate process on
127.0.0.1, train tiny-gpt on the source of Python's standard library (on every machine).
The trainer reports each step as a JSON line; the demo draws them as a progress bar and
ends with a summary. Ctrl+C stops every process it started.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.peers.dashboard import MISSING_EXTRA, dashboard_available
from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig, cli_command
from swarmtrain.peers.probe import probe
from swarmtrain.train.placement import plan_emulated_peers
from swarmtrain.wire.records import CODEC_CHOICES, BatchConfig, CompressionConfig, OptimizerConfig

DEMO_MODEL = {"n_layer": 6, "n_head": 4, "d_model": 128, "seq_len": 64, "vocab_size": 256}
HETEROGENEOUS_SLOWDOWNS = (1.0, 1.0, 2.0, 4.0)
"""The --heterogeneous swarm: two peers at this machine's speed, one 2x and one 4x slower."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    num_stages: int = 3
    steps: int = 120
    model_config: dict = field(default_factory=dict)
    """Overrides of DEMO_MODEL (tiny-gpt options)."""
    microbatch_size: int = 16
    microbatches_per_step: int = 4
    lr: float = 3e-3
    port: int = 0
    """Coordinator port (0: any free port)."""
    heterogeneous: bool = False
    """Start peers of unequal speed (HETEROGENEOUS_SLOWDOWNS) and plan the stages for them."""
    compress: str = "none"
    """One codec for activations, their gradients and the replicas' gradient sums."""
    swarm_key: str | None = None
    """A private swarm's key file every process of the demo gets; None: an open swarm."""
    keep_logs: bool = False
    """Keep the processes' log folder after a demo that ended well (one that failed keeps it)."""

    def __post_init__(self):
        if self.swarm_key is not None:
            from swarmtrain.trust.swarmkey import load_swarm_key

            load_swarm_key(self.swarm_key)  # a bad key file fails here, before any process starts
        if "," in self.compress:
            raise ConfigError(
                f"--compress takes one codec, got {self.compress!r}: for a codec per boundary, start the swarm "
                "with `swarmtrain coordinator --compress-activations ...`"
            )
        if self.compress not in CODEC_CHOICES:
            raise ConfigError(
                f"unknown codec {self.compress!r} for --compress: choose one of {', '.join(CODEC_CHOICES)}"
            )

    def compression(self) -> CompressionConfig:
        return CompressionConfig(activations=self.compress, gradients=self.compress, averaging=self.compress)


def _describe_plan(plan, stages: list[list[float]]) -> list[dict]:
    return [
        {
            "stage": k,
            "blocks": [plan.stage_bounds[k], plan.stage_bounds[k + 1] - 1],
            "peer_slowdowns": slowdowns,
            "predicted_tokens_per_s": round(plan.stage_tokens_per_s[k]),
        }
        for k, slowdowns in enumerate(stages)
    ]


def run_demo(config: DemoConfig, *, quiet: bool = False) -> dict:
    """Run the demo; returns the summary (also printed unless `quiet`)."""
    console = Console(stderr=quiet)
    model_config = DEMO_MODEL | config.model_config
    batch = BatchConfig(
        microbatch_size=config.microbatch_size,
        microbatches_per_step=config.microbatches_per_step,
        max_in_flight=max(config.num_stages, config.microbatches_per_step),
    )
    bounds, stage_args, layout = None, {}, None
    if config.heterogeneous:
        with console.status("measuring this machine and planning stages for peers of unequal speed ..."):
            cap = probe("cpu", seconds=0.3)
            plan, stages = plan_emulated_peers(
                "tiny-gpt",
                model_config,
                HETEROGENEOUS_SLOWDOWNS,
                batch,
                flops_per_s=cap.matmul_flops_per_s,
                memory_bytes=cap.usable_memory_bytes,
            )
        bounds, layout = plan.stage_bounds, _describe_plan(plan, stages)
        stage_args = {k: ("--slowdown", str(s[0])) for k, s in enumerate(stages)}
        for row in layout:
            console.print(
                f"stage {row['stage']}: blocks {row['blocks'][0]}-{row['blocks'][1]} on peers with slowdown "
                f"{', '.join(f'{s:g}x' for s in row['peer_slowdowns'])} (predicted {row['predicted_tokens_per_s']} tokens/s)"
            )
        unused = [HETEROGENEOUS_SLOWDOWNS[int(p.removeprefix("peer"))] for p in sorted(plan.trainers)]
        if unused:
            console.print(
                f"not started as stage peers (the planner predicts they would slow the pipeline): slowdown "
                f"{', '.join(f'{s:g}x' for s in unused)}"
            )
    swarm_config = LocalSwarmConfig(
        run_id="demo",
        model="tiny-gpt",
        model_config=model_config,
        num_stages=config.num_stages,
        stage_bounds=bounds,
        stage_args=stage_args,
        optimizer=OptimizerConfig(lr=config.lr),
        batch=batch,
        compression=config.compression(),
        coordinator_port=config.port,
        dashboard_port=0 if dashboard_available() else None,
        swarm_key=config.swarm_key,
        num_trainers=1,  # the demo's one trainer feeds every step
        keep_logs=config.keep_logs,
    )
    num_peers = sum(len(row["peer_slowdowns"]) for row in layout) if layout else config.num_stages
    started = time.monotonic()
    with console.status(f"starting a coordinator and {num_peers} stage peers on 127.0.0.1 ..."):
        swarm = LocalSwarm(swarm_config)
        swarm.__enter__()
        if config.heterogeneous:  # the replicas beyond each stage's first peer
            for k, slowdowns in enumerate(stages):
                for s in slowdowns[1:]:
                    swarm.spawn_stage(k, extra_args=("--slowdown", str(s)))
    clean = False
    try:
        kept = "kept" if config.keep_logs else "removed at a clean end unless --keep-logs"
        console.print(
            f"[bold]swarm up[/] in {time.monotonic() - started:.1f} s; logs in {swarm.log_dir} ({kept})",
            highlight=False,
        )
        if swarm.dashboard_url:
            console.print(f"dashboard: {swarm.dashboard_url}  (open it in a browser while the demo runs)")
        elif not dashboard_available():
            console.print(f"no dashboard: {MISSING_EXTRA}", markup=False, highlight=False)
        console.print("join it from another terminal with:")
        key = "" if config.swarm_key is None else f" --swarm-key {config.swarm_key}"
        console.print(
            f"  swarmtrain join --initial-peers {swarm.address}{key}", soft_wrap=True, highlight=False
        )
        summary = _train(swarm, config, console, model_config, quiet)
        summary |= _wire_bytes(swarm, console, quiet)
        if layout is not None:
            summary["layout"] = layout
        clean = True
        return summary
    except KeyboardInterrupt:
        console.print("interrupted: stopping every process of the demo")
        raise
    finally:
        swarm.close(clean=clean)
        if not clean:
            console.print(f"the processes' logs are kept in {swarm.log_dir}", highlight=False)


def _wire_bytes(swarm: LocalSwarm, console: Console, quiet: bool) -> dict:
    """What the stage peers sent, from their latest records: tensor bytes on the wire and before
    compression (link probes at start-up included). A swarm that cannot be read costs only this."""
    from swarmtrain.peers.status import StatusConfig, format_bytes, read_swarm_status

    codec = swarm.config.compression.activations
    try:
        status = read_swarm_status(StatusConfig(node=swarm.node_config(), run_id="demo"))
    except SwarmError as e:
        console.print(f"could not read the stage peers' byte counters: {e}")
        return {"compression": codec}
    stages = [r for r in status["peers"] if r["role"] == "stage"]
    wire, raw = sum(r["bytes_sent"] for r in stages), sum(r["raw_bytes_sent"] for r in stages)
    if not quiet and wire:
        saved = f" ({format_bytes(raw)} before compression, {raw / wire:.2f}x)" if codec != "none" else ""
        console.print(f"stage peers sent {format_bytes(wire)} of tensors on the wire{saved}")
    return {"compression": codec, "wire_bytes": wire, "raw_bytes": raw}


def _train(swarm: LocalSwarm, config: DemoConfig, console: Console, model_config: dict, quiet: bool) -> dict:
    args = ["train", "--initial-peers", swarm.address, "--run-id", "demo", "--steps", str(config.steps)]
    args += swarm.trust_args("trainer-0")
    with open(swarm.log_dir / "trainer.log", "wb") as log:
        proc = subprocess.Popen(
            cli_command(*args, "--jsonl", "--threads", "1"),
            stdout=subprocess.PIPE,
            stderr=log,
            env=swarm._env(),
            start_new_session=True,
        )
    swarm.procs["trainer"] = proc
    records = []
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tokens/s"),
        TimeElapsedColumn(),
    )
    began = time.monotonic()
    with Progress(*columns, console=console, transient=quiet) as progress:
        task = progress.add_task("train", total=config.steps, loss="-", tps="-")
        for line in proc.stdout:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records.append(record)
            progress.update(
                task,
                completed=len(records),
                loss=f"{record['loss']:.3f}",
                tps=f"{record['tokens_per_s']:.0f}",
            )
    if proc.wait() != 0:
        raise SwarmError(f"the trainer failed (exit {proc.returncode}):\n{swarm.log_tail('trainer')}")
    wall = time.monotonic() - began
    if not records:
        raise SwarmError("the trainer finished without completing a step")
    tokens = sum(r["tokens"] for r in records)
    tail = records[-min(10, len(records)) :]
    summary = {
        "stages": swarm.num_stages,
        "steps": len(records),
        "model": model_config,
        "initial_loss": records[0]["loss"],
        "final_loss": sum(r["loss"] for r in tail) / len(tail),
        "uniform_loss": math.log(model_config.get("vocab_size", 256)),
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "seconds": wall,
        "replays": sum(r["replays"] for r in records),
        "losses": [r["loss"] for r in records],
    }
    if not quiet:
        console.print(
            f"[bold green]done[/]: {summary['steps']} steps, loss {summary['initial_loss']:.3f} -> "
            f"{summary['final_loss']:.3f} (uniform guess: {summary['uniform_loss']:.3f}), "
            f"{summary['tokens_per_s']:.0f} tokens/s over {summary['seconds']:.0f} s"
        )
    sys.stdout.flush()
    return summary
