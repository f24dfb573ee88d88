"""`swarmtrain`: the command line. Each command parses flags into a config, builds the
object, runs it and closes it; the logic lives in the Python API under it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

# Before hivemind is imported anywhere. CRITICAL: the p2p daemon's own errors reach the user
# as one explained line (swarm.node._explain_daemon_error), not as its raw log.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "CRITICAL")

import typer  # noqa: E402

from swarmtrain.cli.keys import keygen, whoami  # noqa: E402
from swarmtrain.cli.options import (  # noqa: E402
    USAGE_EXIT_CODE,
    AllowModel,
    Host,
    IdentityPath,
    InitialPeers,
    Port,
    RunId,
    RunOwner,
    SwarmKeyPath,
    Threads,
    Verbose,
    check_run_id_flag,
    check_writable_flag,
    parse_model_config,
    parse_stage_bounds,
    print_error,
    run_guarded,
    setup_logging,
    trust_settings,
)
from swarmtrain.errors import SwarmError  # noqa: E402

app = typer.Typer(
    name="swarmtrain",
    help="Elastic, decentralized training over spot and consumer GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def coordinator(
    run_id: Annotated[
        str,
        typer.Option(
            help="Name of the run, which peers pass as --run-id: 1-64 letters, digits, '_', '.' or '-'.",
            callback=check_run_id_flag,
        ),
    ] = "demo",
    model: Annotated[
        str,
        typer.Option(
            help="Model builder: a registered name (tiny-gpt) or 'package.module:function', "
            "importable on every peer."
        ),
    ] = "tiny-gpt",
    model_config: Annotated[
        str,
        typer.Option(
            help="Builder options: a JSON object or KEY=VALUE,KEY=VALUE, e.g. n_layer=8,d_model=256.",
            show_default="the builder's own; tiny-gpt: n_layer=4,n_head=4,d_model=128,seq_len=128",
        ),
    ] = "",
    stages: Annotated[
        int,
        typer.Option(
            help="Pipeline stages, 1 to the model's block count (tiny-gpt: n_layer); blocks are split evenly."
        ),
    ] = 3,
    stage_bounds: Annotated[
        str | None,
        typer.Option(
            help="Unequal stages as block boundaries, e.g. 0,3,5,6: stage k holds blocks b[k]..b[k+1]-1. "
            "Overrides --stages.",
            show_default="an even split",
        ),
    ] = None,
    optimizer: Annotated[str, typer.Option(help="Optimizer every stage runs: adamw or sgd.")] = "adamw",
    lr: Annotated[float, typer.Option(help="Learning rate, > 0.")] = 3e-3,
    weight_decay: Annotated[
        float, typer.Option(help="Decoupled (AdamW-style) weight decay coefficient, >= 0; 0 turns it off.")
    ] = 0.0,
    microbatch_size: Annotated[
        int, typer.Option(help="Sequences per microbatch, each the model's seq_len tokens long; >= 1.")
    ] = 8,
    microbatches_per_step: Annotated[
        int, typer.Option(help="Microbatches accumulated into one optimizer step; >= 1.")
    ] = 4,
    max_in_flight: Annotated[
        int, typer.Option(help="Microbatches a trainer keeps in the pipeline at once; >= 1.")
    ] = 4,
    seed: Annotated[
        int, typer.Option(help="Run seed (an integer): model initialisation and data order.")
    ] = 0,
    steps: Annotated[int, typer.Option(help="Optimizer steps the run aims for; 0 means until stopped.")] = 0,
    schedule: Annotated[
        str,
        typer.Option(
            help="readiness: peers run whatever work is ready and route each microbatch to the replica "
            "expected to finish it first; static: round-robin replicas in a fixed 1F1B order (a baseline)."
        ),
    ] = "readiness",
    compress_activations: Annotated[
        str,
        typer.Option(
            help="Codec of the activations stages send forward: none, fp16, bf16, int8, nf4, uint4 "
            "(int8-s16, nf4-s16, uint4-s16: the same with fp16 block scales, a little smaller), "
            "or auto (chosen per link from its measured bandwidth); or one per boundary, comma-separated "
            "(none,int8,nf4: stage 0 to 1 raw, 1 to 2 int8, 2 to 3 nf4)."
        ),
    ] = "none",
    compress_gradients: Annotated[
        str,
        typer.Option(
            help="Codec of the activation gradients stages send backward (same choices; "
            "one for all boundaries or one per boundary)."
        ),
    ] = "none",
    compress_averaging: Annotated[
        str,
        typer.Option(
            help="Codec of the gradient sums replicas of a stage exchange (same choices; "
            "one for all stages or one per stage)."
        ),
    ] = "none",
    error_feedback: Annotated[
        bool,
        typer.Option(help="Gradient and averaging codecs carry what they rounded away into the next send."),
    ] = True,
    loss: Annotated[
        str | None,
        typer.Option(
            help="Loss the last stage computes, by registered name: cross_entropy, weighted_cross_entropy "
            "(each microbatch also carries per-token 'weights'), or one the model's module registers.",
            show_default="the model's own (tiny-gpt: cross_entropy)",
        ),
    ] = None,
    host: Host = "127.0.0.1",
    port: Port = 0,
    dashboard_port: Annotated[
        int | None,
        typer.Option(
            help="Serve the swarm dashboard on this port, 0..65535 (0 picks a free one).",
            show_default="no dashboard",
        ),
    ] = None,
    dashboard_host: Annotated[
        str, typer.Option(help="Address the dashboard listens on: 127.0.0.1 (this machine) or 0.0.0.0.")
    ] = "127.0.0.1",
    address_file: Annotated[
        Path | None,
        typer.Option(
            help="Also write the peer address (one line) to this file once serving.",
            show_default="not written",
            callback=check_writable_flag,
        ),
    ] = None,
    trainer: Annotated[
        list[str],
        typer.Option(
            "--trainer",
            help="Peer id of a trainer this run authorizes (`swarmtrain whoami` on its machine prints it); "
            "repeat for several. Stage peers take microbatches and commit phases from no one else.",
            show_default="this machine's default trainer identity",
        ),
    ] = [],  # noqa: B006 (typer reads the default; it is never mutated)
    any_trainer: Annotated[
        bool,
        typer.Option(
            "--any-trainer",
            hidden=True,
            help="Benchmarks only: authorize every trainer, as before runs had owners (the baseline "
            "the cost of authorization is measured against).",
        ),
    ] = False,
    identity: IdentityPath = None,
    swarm_key: SwarmKeyPath = None,
    verbose: Verbose = False,
) -> None:
    """Start a swarm: a bootstrap DHT peer that publishes a run's manifest, signed as the run's owner."""
    setup_logging(verbose)
    from swarmtrain.peers.coordinator import Coordinator, CoordinatorConfig
    from swarmtrain.peers.dashboard.config import DashboardConfig
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.wire.records import BatchConfig, CompressionConfig, OptimizerConfig

    def main() -> None:
        from swarmtrain.cli.options import check_run_owner_flag
        from swarmtrain.trust.identity import Identity, default_identity_path

        trust = trust_settings("coordinator", identity, swarm_key)
        owner = Identity.load(trust["identity_path"])
        trainers = [check_run_owner_flag(t) for t in trainer] or [
            Identity.load(default_identity_path("trainer")).peer_id
        ]
        if any_trainer:
            trainers = []
        listen_port = port or _free_or_zero(host, owner.remembered_port())
        config = CoordinatorConfig(
            node=NodeConfig(host=host, port=listen_port, **trust),
            trainers=tuple(trainers),
            run_id=run_id,
            model=model,
            model_config=parse_model_config(model_config),
            num_stages=stages,
            stage_bounds=parse_stage_bounds(stage_bounds),
            optimizer=OptimizerConfig(name=optimizer, lr=lr, weight_decay=weight_decay),
            batch=BatchConfig(
                microbatch_size=microbatch_size,
                microbatches_per_step=microbatches_per_step,
                max_in_flight=max_in_flight,
            ),
            seed=seed,
            max_steps=steps,
            schedule=schedule,
            compression=CompressionConfig(
                activations=compress_activations,
                gradients=compress_gradients,
                averaging=compress_averaging,
                error_feedback=error_feedback,
            ),
            loss=loss,
            dashboard=None
            if dashboard_port is None
            else DashboardConfig(host=dashboard_host, port=dashboard_port),
        )
        coord = Coordinator(config)
        owner.remember_port(int(coord.address.split("/tcp/")[1].split("/")[0]))
        try:
            m = coord.manifest
            typer.echo(
                f"run {m.run_id!r}: {m.model}, {m.num_blocks} blocks in {m.num_stages} stages {list(m.stage_bounds)}"
            )
            if m.compression.is_enabled:
                typer.echo(f"compression: {m.compression.describe()}")
            if m.loss is not None:
                typer.echo(f"loss: {m.loss}")
            typer.echo(f"owner:        {coord.node.peer_id} (identity {owner.path})")
            typer.echo(f"trainers:     {', '.join(m.trainers) or 'anyone (--any-trainer)'}")
            if coord.node.swarm_key is not None:
                typer.echo(f"private swarm, key {coord.node.swarm_key.fingerprint} ({swarm_key})")
            key_flag = "" if swarm_key is None else f" --swarm-key {swarm_key}"
            typer.echo(f"peer address: {coord.address}")
            typer.echo(f"join with:    swarmtrain join --initial-peers {coord.address}{key_flag}")
            if coord.dashboard is not None:
                typer.echo(f"dashboard:    {coord.dashboard.url}")
            if address_file is not None:
                tmp = address_file.with_suffix(".tmp")
                tmp.write_text(coord.address + "\n")
                tmp.replace(address_file)
            _wait_for_signal(coord)
        finally:
            coord.close()

    run_guarded(main)


def _free_or_zero(host: str, port: int | None) -> int:
    """`port` if it is free on `host` (a coordinator's address from last time), else 0 (any)."""
    import socket

    if port is None:
        return 0
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return 0
    return port


def _wait_for_signal(coord) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: coord.close())
    try:
        while not coord.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass


@app.command()
def join(
    initial_peers: InitialPeers,
    run_id: RunId = None,
    stage: Annotated[
        int | None,
        typer.Option(
            help="Stage to serve, 0 to the run's stages - 1.", show_default="the stage that needs a peer most"
        ),
    ] = None,
    gpu: Annotated[
        str, typer.Option(help="Device to compute on: auto (first CUDA GPU, else CPU), cpu, cuda or cuda:N.")
    ] = "auto",
    threads: Threads = None,
    host: Host = "127.0.0.1",
    port: Port = 0,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            help="Write this peer's id (one line) to this file once it serves.",
            show_default="not written",
            callback=check_writable_flag,
        ),
    ] = None,
    announce_host: Annotated[
        str | None,
        typer.Option(
            help="Address other peers should dial, if not --host (behind NAT).", show_default="--host"
        ),
    ] = None,
    max_frame_mb: Annotated[
        float,
        typer.Option(min=0.001, help="Largest frame payload accepted, in MiB; bigger frames are refused."),
    ] = 256.0,
    max_strikes: Annotated[
        int, typer.Option(min=1, help="Bad frames from one peer before it is banned (for 60 s).")
    ] = 3,
    read_timeout: Annotated[
        float,
        typer.Option(
            min=0.01,
            help="Seconds a request may take to arrive whole once its stream opens; then it is refused.",
        ),
    ] = 30.0,
    spot: Annotated[bool, typer.Option("--spot", help="This machine may be preempted at any time.")] = False,
    max_memory: Annotated[
        str | None,
        typer.Option(
            help="Memory this peer may use, e.g. 12GB, 512MiB; stages that need more are refused.",
            show_default="what is free",
        ),
    ] = None,
    slowdown: Annotated[
        float, typer.Option(min=1.0, help="Make compute take this many times longer (emulates a slower GPU).")
    ] = 1.0,
    rebalance_every: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Seconds between checks whether moving to another stage would raise swarm throughput "
            "(by >10%, 3 checks in a row); 0 never moves.",
        ),
    ] = 10.0,
    slowdown_file: Annotated[
        Path | None,
        typer.Option(
            help="While this file exists, compute runs as many times slower as the number in it says "
            "(emulates a GPU that throttles for a while, then recovers).",
            show_default="not watched",
        ),
    ] = None,
    inject_fault: Annotated[
        str | None,
        typer.Option(
            hidden=True,
            help="Testing: ACTION:KIND:N kills (kill) or terminates (term) this peer as its N-th "
            "forward/backward/loss task starts.",
            show_default="no fault",
        ),
    ] = None,
    identity: IdentityPath = None,
    swarm_key: SwarmKeyPath = None,
    run_owner: RunOwner = None,
    allow_model: AllowModel = None,
    verbose: Verbose = False,
) -> None:
    """Join a swarm as a stage peer and serve forward and backward passes until stopped."""
    setup_logging(verbose)
    from swarmtrain.model import ModelSources
    from swarmtrain.peers.probe import parse_bytes, resolve_device
    from swarmtrain.peers.stage import StageConfig, StagePeer
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.transport import TransportConfig

    def main() -> None:
        config = StageConfig(
            node=NodeConfig(
                initial_peers=tuple(initial_peers),
                host=host,
                port=port,
                announce_host=announce_host,
                **trust_settings("stage", identity, swarm_key, run_owner),
            ),
            run_id=run_id,
            stage=stage,
            device=resolve_device(gpu),
            num_threads=threads,
            transport=TransportConfig(
                max_frame_bytes=int(max_frame_mb * 2**20),
                max_strikes=max_strikes,
                read_timeout_s=read_timeout,
            ),
            slowdown=slowdown,
            rebalance_s=rebalance_every,
            max_memory_bytes=None if max_memory is None else parse_bytes(max_memory),
            is_spot=spot,
            slowdown_file=None if slowdown_file is None else str(slowdown_file),
            fault=inject_fault,
            models=ModelSources(allow=tuple(allow_model or ())),
        )
        peer = StagePeer(config)
        if ready_file is not None:
            peer.on_serving = lambda: _write_atomic(ready_file, peer.node.peer_id)
        else:
            peer.on_serving = lambda: typer.echo(
                f"serving stage {peer.stage} of run {peer.manifest.run_id!r} on {config.device} as {peer.node.peer_id}"
            )
        peer.run()

    run_guarded(main)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


@app.command()
def train(
    initial_peers: InitialPeers,
    run_id: RunId = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps to run, then exit.")] = 100,
    data: Annotated[
        str,
        typer.Option(
            help="Training text: 'stdlib' (the source of Python's standard library) or a text file or a folder of them."
        ),
    ] = "stdlib",
    timeout: Annotated[
        float,
        typer.Option(
            help="Seconds one microbatch may take, forward through every stage and back, before it is "
            "replayed; > 1."
        ),
    ] = 60.0,
    threads: Threads = None,
    jsonl: Annotated[
        bool, typer.Option("--jsonl", help="Print one JSON object per step instead of text.")
    ] = False,
    identity: IdentityPath = None,
    swarm_key: SwarmKeyPath = None,
    run_owner: RunOwner = None,
    allow_model: AllowModel = None,
    verbose: Verbose = False,
) -> None:
    """Train a run: feed microbatches of byte-level text into the swarm and step it."""
    setup_logging(verbose)
    from swarmtrain.model import ModelSources
    from swarmtrain.peers.trainer import Trainer, TrainerConfig
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.train.data import text_batches_for

    def main() -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        node = NodeConfig(
            initial_peers=tuple(initial_peers), **trust_settings("trainer", identity, swarm_key, run_owner)
        )
        config = TrainerConfig(node=node, run_id=run_id, microbatch_timeout_s=timeout)
        with Trainer(config) as trainer:
            models = ModelSources(allow=tuple(allow_model or ()))
            batches = text_batches_for(trainer.manifest, data, models=models)
            for result in trainer.train(batches, steps=steps):
                if jsonl:
                    record = {
                        "step": result.step,
                        "loss": result.loss,
                        "tokens": result.tokens,
                        "seconds": result.seconds,
                        "tokens_per_s": result.tokens_per_s,
                        "completed": result.completed,
                        "replays": result.replays,
                        "dropped": result.dropped,
                        "replay_causes": result.replay_causes,
                        "dropped_causes": result.dropped_causes,
                        "window": result.window,
                    }
                    typer.echo(json.dumps(record))
                else:
                    extra = f"  {result.replays} replayed" if result.replays else ""
                    extra += f"  {result.dropped} dropped" if result.dropped else ""
                    typer.echo(
                        f"step {result.step:5d}  loss {result.loss:.4f}  {result.tokens_per_s:8.0f} tokens/s{extra}"
                    )

    run_guarded(main)


@app.command()
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


@app.command()
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
) -> None:
    """Show a run's stages, peers and training progress, read from the DHT (works without a
    coordinator: any peer's address will do)."""
    setup_logging(verbose)
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


@app.command()
def demo(
    stages: Annotated[
        int, typer.Option(help="Pipeline stages, 1 to n_layer; one stage peer process is started per stage.")
    ] = 3,
    steps: Annotated[int, typer.Option(help="Optimizer steps to train.")] = 120,
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
    port: Annotated[int, typer.Option(help="Coordinator TCP port, 0..65535; 0 picks a free port.")] = 0,
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
) -> None:
    """Run a whole swarm on this machine: a coordinator, N stage peers and a trainer,
    each its own process on 127.0.0.1, training tiny-gpt on Python's standard library."""
    from swarmtrain.peers.demo import DemoConfig, run_demo

    def main() -> None:
        config = DemoConfig(
            num_stages=stages,
            steps=steps,
            model_config=parse_model_config(model_config),
            microbatch_size=microbatch_size,
            microbatches_per_step=microbatches_per_step,
            lr=lr,
            port=port,
            heterogeneous=heterogeneous,
            compress=compress,
            swarm_key=None if swarm_key is None else str(swarm_key.absolute()),
        )
        summary = run_demo(config, quiet=as_json)
        if as_json:
            typer.echo(json.dumps(summary, indent=2))

    run_guarded(main)


app.command()(keygen)
app.command()(whoami)


def _usage_error_line(e: typer.TyperException) -> str:
    """Typer's usage error (missing option, bad value, unknown flag) as one line that says where
    the help is, instead of its multi-line box."""
    ctx = getattr(e, "ctx", None)
    command = ctx.command_path if ctx is not None else "swarmtrain"
    message = " ".join(e.format_message().split()).rstrip(".")
    return f"{message} (see `{command} --help`)"


def main() -> None:
    """The console entry point: run the command and exit with its code. Bad input of any kind
    (typer's usage errors, swarmtrain's own) ends as one line on stderr and exit code 2."""
    try:
        code = app(prog_name="swarmtrain", standalone_mode=False)
    except SwarmError as e:  # raised by a flag callback, before the command runs
        print_error(str(e))
        code = USAGE_EXIT_CODE
    except typer.TyperException as e:
        # NoArgsIsHelpError: typer has printed the help already (typer's own check, by name).
        if type(e).__name__ != "NoArgsIsHelpError":
            print_error(_usage_error_line(e))
        code = USAGE_EXIT_CODE
    except typer.Abort:
        typer.secho("aborted", err=True)
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
