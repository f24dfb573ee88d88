"""`swarmtrain probe`, `status` and `demo`: the commands that look at a machine or a swarm,
or run a whole one here, rather than take a role in one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from swarmtrain.cli.options import (
    InitialPeers,
    LogFile,
    LogFormat,
    LogLevel,
    RunOwner,
    SwarmKeyPath,
    Verbose,
    check_run_id_flag,
    parse_model_config,
    run_guarded,
    setup_logging,
)
from swarmtrain.cli.runfile import PrintConfig, RunFile


def probe(
    gpu: Annotated[str, typer.Option(help="Device to measure: auto, cpu, cuda or cuda:N.")] = "auto",
    dtype: Annotated[
        str,
        typer.Option(help="The run's dtype: float32, bfloat16 or float16 (a CPU is measured in float32)."),
    ] = "float32",
    seconds: Annotated[
        float, typer.Option(min=0.01, help="How long to time matmuls, after a short warm-up.")
    ] = 1.0,
    spot: Annotated[bool, typer.Option("--spot", help="This machine may be preempted at any time.")] = False,
    max_memory: Annotated[
        str | None,
        typer.Option(
            help="Cap on the memory the run may use, e.g. 12GB, 512MiB, 1.5G.", show_default="what is free"
        ),
    ] = None,
    slowdown: Annotated[
        float, typer.Option(min=1.0, help="Report compute this many times slower (to test uneven swarms).")
    ] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the capacity as JSON on stdout.")] = False,
) -> None:
    """Measure what this machine offers a swarm: device, free memory and matmul throughput."""
    from swarmtrain.peers.probe import format_capacity_table, parse_bytes
    from swarmtrain.peers.probe import probe as measure

    def main() -> None:
        capacity = measure(
            gpu,
            dtype=dtype,
            seconds=seconds,
            is_spot=spot,
            max_memory_bytes=None if max_memory is None else parse_bytes(max_memory),
            slowdown=slowdown,
        )
        if as_json:
            typer.echo(json.dumps(capacity.to_dict(), indent=2))
        else:
            from rich.console import Console

            Console().print(format_capacity_table(capacity))

    run_guarded(main)


def status(
    initial_peers: InitialPeers,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            help="Run to show.",
            show_default="the only run the swarm announces",
            callback=check_run_id_flag,
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the swarm as JSON on stdout instead of tables.")
    ] = False,
    swarm_key: SwarmKeyPath = None,
    run_owner: RunOwner = None,
    verbose: Verbose = False,
    log_level: LogLevel = None,
    log_file: LogFile = None,
    log_format: LogFormat = "text",
) -> None:
    """Show a run's stages, peers and training progress, read from the DHT (works without a
    coordinator: any peer's address will do)."""
    setup_logging(verbose, log_level, log_file, log_format)
    from swarmtrain.peers.status import StatusConfig, read_swarm_status, render_status
    from swarmtrain.swarm import NodeConfig

    def main() -> None:
        node = NodeConfig(
            initial_peers=tuple(initial_peers),
            client_mode=True,
            swarm_key_path=None if swarm_key is None else str(swarm_key),
            run_owner=run_owner,
        )
        config = StatusConfig(node=node, run_id=run_id)
        report = read_swarm_status(config)
        if as_json:
            typer.echo(json.dumps(report, indent=2, allow_nan=False))
        else:
            from rich.console import Console

            Console().print(render_status(report))

    run_guarded(main)


def export(
    initial_peers: InitialPeers,
    out: Annotated[
        Path, typer.Option("--out", help="Directory to write the model to (replaced if it exists).")
    ],
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            help="Run to export.",
            show_default="the only run the swarm announces",
            callback=check_run_id_flag,
        ),
    ] = None,
    resumable: Annotated[
        bool,
        typer.Option(
            "--resumable",
            help="Write a run checkpoint: the optimizer state and the run's settings too, for "
            "`coordinator --resume DIR`.",
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds to wait for every stage to answer at one step.")
    ] = 120.0,
    identity: Annotated[
        Path | None,
        typer.Option(
            help="Key to read the stages' parameters with: the run's owner, one of its trainers, or a "
            "member of its stages.",
            show_default="this machine's trainer key",
        ),
    ] = None,
    swarm_key: SwarmKeyPath = None,
    run_owner: RunOwner = None,
    verbose: Verbose = False,
    log_level: LogLevel = None,
    log_file: LogFile = None,
    log_format: LogFormat = "text",
) -> None:
    """Write a run's current model to a directory: safetensors plus the builder and its options."""
    setup_logging(verbose, log_level, log_file, log_format)
    from swarmtrain.peers.export import export_model
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.trust.identity import Identity, default_identity_path
    from swarmtrain.trust.swarmkey import load_swarm_key

    def main() -> None:
        if swarm_key is not None:
            load_swarm_key(swarm_key)
        key = Identity.load(identity or default_identity_path("trainer"))
        node = NodeConfig(
            initial_peers=tuple(initial_peers),
            client_mode=True,
            identity_path=str(key.path),
            swarm_key_path=None if swarm_key is None else str(swarm_key),
            run_owner=run_owner,
        )
        done = export_model(node, run_id, out, resumable=resumable, timeout_s=timeout)
        typer.echo(f"exported step {done.step} ({done.num_params:,} parameters) to {done.out}")
        if done.native is not None:
            typer.echo(f"as a Hugging Face folder (from_pretrained) in {done.native}")

    run_guarded(main)


def demo(
    stages: Annotated[
        int,
        typer.Option(
            min=1, help="Pipeline stages, 1 to n_layer; one stage peer process is started per stage."
        ),
    ] = 3,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Optimizer steps to train.", show_default="120; 200 with --rl")
    ] = None,
    model_config: Annotated[
        str,
        typer.Option(
            help="Overrides of the demo's tiny-gpt options: a JSON object or KEY=VALUE,KEY=VALUE.",
            show_default="n_layer=6,n_head=4,d_model=128,seq_len=64",
        ),
    ] = "",
    microbatch_size: Annotated[
        int, typer.Option(help="Sequences per microbatch, each the model's seq_len tokens long; >= 1.")
    ] = 16,
    microbatches_per_step: Annotated[
        int, typer.Option(help="Microbatches accumulated into one optimizer step; >= 1.")
    ] = 4,
    lr: Annotated[float, typer.Option(help="Learning rate (AdamW), > 0.")] = 3e-3,
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Coordinator TCP port, 0..65535; 0 picks a free port.")
    ] = 0,
    heterogeneous: Annotated[
        bool,
        typer.Option(
            "--heterogeneous",
            help="Start 4 peers, two of them 4x slower (--slowdown), and plan unequal stages and replicas "
            "for them from measured capacity (overrides --stages).",
        ),
    ] = False,
    compress: Annotated[
        str,
        typer.Option(
            help="Codec of everything stages send (activations, their gradients, replicas' gradient sums): "
            "none, fp16, bf16, int8, nf4, uint4, int8-s16, nf4-s16, uint4-s16 or auto."
        ),
    ] = "none",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a machine-readable summary (JSON) on stdout at the end.")
    ] = False,
    swarm_key: SwarmKeyPath = None,
    rl: Annotated[
        bool,
        typer.Option(
            "--rl",
            help="RL instead: a short supervised warm-up on 2-digit addition in this process, then GRPO "
            "through a swarm of 2 stage peers and 2 rollout peers; reports held-out accuracy after each.",
        ),
    ] = False,
    keep_logs: Annotated[
        bool,
        typer.Option(
            "--keep-logs",
            help="Keep the processes' log folder after a demo that ended well (one that failed keeps it).",
        ),
    ] = False,
    config: RunFile = None,
    print_config: PrintConfig = False,
) -> None:
    """Run a whole swarm on this machine: a coordinator, N stage peers and a trainer,
    each its own process on 127.0.0.1, training tiny-gpt on Python's standard library."""
    from swarmtrain.peers.demo import DemoConfig, run_demo

    def main() -> None:
        if rl:
            from swarmtrain.peers.rl_demo import RLDemoConfig, run_rl_demo

            summary = run_rl_demo(RLDemoConfig(steps=steps or 200), quiet=as_json)
            if as_json:
                typer.echo(json.dumps(summary, indent=2))
            return
        config = DemoConfig(
            num_stages=stages,
            steps=steps or 120,
            model_config=parse_model_config(model_config),
            microbatch_size=microbatch_size,
            microbatches_per_step=microbatches_per_step,
            lr=lr,
            port=port,
            heterogeneous=heterogeneous,
            compress=compress,
            swarm_key=None if swarm_key is None else str(swarm_key.absolute()),
            keep_logs=keep_logs,
        )
        summary = run_demo(config, quiet=as_json)
        if as_json:
            typer.echo(json.dumps(summary, indent=2))

    run_guarded(main)
