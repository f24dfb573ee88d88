"""`swarmtrain coordinator`: start a run, signed as its owner, and keep its address."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from swarmtrain.cli.options import (
    AnnounceHost,
    Host,
    IdentityPath,
    LogFile,
    LogFormat,
    LogLevel,
    Port,
    SwarmKeyPath,
    Verbose,
    check_run_id_flag,
    check_writable_flag,
    parse_model_config,
    parse_stage_bounds,
    parse_task_options,
    read_initial_peers_flag,
    run_guarded,
    setup_logging,
    trust_settings,
)
from swarmtrain.cli.runfile import PrintConfig, RunFile


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
            help="Model builder: a registered name (tiny-gpt, hf-causal-lm) or 'package.module:function', "
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
    min_peers: Annotated[
        int,
        typer.Option(
            help="Plan the stage bounds from the stage peers that come: wait until this many have joined "
            "and measured themselves (or --plan-wait), then size each stage to its peers; trainers wait "
            "for the plan. 0: publish the stages at once.",
            min=0,
        ),
    ] = 0,
    plan_wait: Annotated[
        float,
        typer.Option(
            help="With --min-peers: seconds after which the stages are planned with the peers there are "
            "(at least one per stage).",
            min=0,
            max=86399,
        ),
    ] = 60.0,
    replan: Annotated[
        bool,
        typer.Option(
            "--replan/--no-replan",
            help="Let the run re-plan its layout as it runs: its lead trainer plans the serving peers "
            "from their measured speeds and moves the swarm to a plan that beats the live layout by more "
            "than --replan-gain for --replan-patience checks in a row (blocks change hands between two "
            "steps). The rule goes in the manifest: layouts change with or without this coordinator.",
        ),
    ] = False,
    replan_gain: Annotated[
        float, typer.Option(help="With --replan: smallest predicted gain worth a move (0.2: +20%).", min=0)
    ] = 0.2,
    replan_patience: Annotated[
        int, typer.Option(help="With --replan: checks in a row a re-plan must keep its gain.", min=1)
    ] = 3,
    replan_every: Annotated[
        float, typer.Option(help="With --replan: seconds between re-plan checks.", min=0.1)
    ] = 10.0,
    optimizer: Annotated[str, typer.Option(help="Optimizer every stage runs: adamw or sgd.")] = "adamw",
    lr: Annotated[float, typer.Option(help="Learning rate, > 0.")] = 3e-3,
    weight_decay: Annotated[
        float, typer.Option(help="Decoupled (AdamW-style) weight decay coefficient, >= 0; 0 turns it off.")
    ] = 0.0,
    warmup_steps: Annotated[
        int, typer.Option(help="Steps of linear learning-rate warmup, from --lr/N up to --lr; 0: none.")
    ] = 0,
    lr_schedule: Annotated[
        str,
        typer.Option(
            help="Learning rate after warmup: constant, or cosine (down to --min-lr at the run's last "
            "step; needs --steps)."
        ),
    ] = "constant",
    min_lr: Annotated[
        float, typer.Option(help="Learning rate the cosine schedule ends at, 0 to --lr.")
    ] = 0.0,
    max_grad_norm: Annotated[
        float,
        typer.Option(
            help="Clip the gradient of the whole model (all stages together) to this L2 norm; 0: off."
        ),
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
    steps: Annotated[
        int,
        typer.Option(
            help="Optimizer steps the run lasts (trainers and stage peers stop after the last); 0: until stopped."
        ),
    ] = 0,
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
            show_default="the model's own (tiny-gpt: cross_entropy); grpo with --task",
        ),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(
            help="Make this an RL run on a task with verifiable rewards: add, sort, reverse, or an import "
            "path 'package.module:function' (rollout peers sample completions, the loss is GRPO).",
            show_default="no task: trainers feed their own data",
        ),
    ] = None,
    task_options: Annotated[
        str, typer.Option(help="The task's options as JSON, e.g. '{\"digits\": 2}'.")
    ] = "{}",
    samples_per_prompt: Annotated[
        int,
        typer.Option(
            min=2, help="RL: completions sampled per prompt, the group advantages are normalised over."
        ),
    ] = 8,
    max_staleness: Annotated[
        int,
        typer.Option(
            min=0, help="RL: a completion sampled by a policy more than this many steps old is dropped."
        ),
    ] = 2,
    weights_codec: Annotated[
        str, typer.Option(help="RL: how rollout peers fetch each policy version: none (exact), bf16 or int8.")
    ] = "none",
    verify_fraction: Annotated[
        float,
        typer.Option(
            help="RL: share of rollout replies whose behaviour log-probs the trainer recomputes "
            "through the pipeline (0: none); a peer whose claims do not hold is banned."
        ),
    ] = 0.1,
    logprob_tolerance: Annotated[
        float,
        typer.Option(
            help="RL: nats; a checked reply whose log-probs differ from the pipeline's by more than "
            "this on average bans its rollout peer."
        ),
    ] = 0.1,
    host: Host = "127.0.0.1",
    port: Port = 0,
    announce_host: AnnounceHost = None,
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
    weight_reader: Annotated[
        list[str],
        typer.Option(
            "--weight-reader",
            help="Peer id that may fetch the run's weights by policy version (a rollout peer); repeat "
            "for several. Given once or more, no one else may besides the run's trainers and stage "
            "peers; by default anyone who reaches the swarm may.",
            show_default="anyone",
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
    checkpoint_every: Annotated[
        int,
        typer.Option(min=0, help="Stage replicas checkpoint their stage every this many steps; 0 never."),
    ] = 100,
    allow_reinit: Annotated[
        bool,
        typer.Option(
            "--allow-reinit",
            help="A stage that lost its last replica, with no checkpoint of it in the swarm, starts again "
            "from the run seed (default: it waits, shown as lost).",
        ),
    ] = False,
    restore_lost_stage_only: Annotated[
        bool,
        typer.Option(
            "--restore-lost-stage-only",
            help="A stage that lost every replica comes back from its checkpoint alone; the other stages "
            "keep their state (default: the whole run goes back to that checkpoint).",
        ),
    ] = False,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            help="Gather whole-run checkpoints from the stages into this directory (each resumable with "
            "--resume DIR/RUN/INSTANCE/step-N) and serve them to peers bringing a lost stage back.",
            show_default="no archive",
        ),
    ] = None,
    init_from: Annotated[
        Path | None,
        typer.Option(
            help="Start every stage from the model in this directory (`swarmtrain export`'s output) "
            "instead of the seed; each stage peer reads its own tensors from it.",
            show_default="the run seed",
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Start the run again from this run checkpoint (`swarmtrain export --resumable`): its "
            "settings, optimizer state and step; the flags that shape the run are ignored.",
            show_default="a new run",
        ),
    ] = None,
    initial_peers: Annotated[
        list[str],
        typer.Option(
            "--initial-peers",
            help="Join an existing swarm through this peer's address (another coordinator's, any peer's, "
            "or a plain hivemind-dht node's; repeat for several): start the run there, or serve it if "
            "the swarm runs it already (its owner's manifest, as it is). @FILE reads them from a file.",
            show_default="start a new swarm",
            callback=read_initial_peers_flag,
        ),
    ] = [],  # noqa: B006 (typer reads the default; it is never mutated)
    identity: IdentityPath = None,
    swarm_key: SwarmKeyPath = None,
    verbose: Verbose = False,
    log_level: LogLevel = None,
    log_file: LogFile = None,
    log_format: LogFormat = "text",
    config: RunFile = None,
    print_config: PrintConfig = False,
) -> None:
    """Start a swarm (or join one): a bootstrap DHT peer that publishes a run's manifest, signed as
    the run's owner, or serves the manifest its owner signed when the swarm runs it already."""
    setup_logging(verbose, log_level, log_file, log_format)
    from swarmtrain.peers.coordinator import Coordinator, CoordinatorConfig
    from swarmtrain.peers.dashboard.config import DashboardConfig
    from swarmtrain.plan import ReplanConfig
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.train.layout import FirstLayoutConfig
    from swarmtrain.wire.records import BatchConfig, CompressionConfig, OptimizerConfig
    from swarmtrain.wire.rl_config import RLConfig

    def main() -> None:
        from swarmtrain.cli.options import check_peer_id_flag, check_run_owner_flag
        from swarmtrain.errors import ConfigError

        if init_from is not None and resume is not None:
            raise ConfigError(
                "give --init-from (weights only, a new run) or --resume (the whole run), not both"
            )
        if dashboard_port is not None:
            from swarmtrain.peers.dashboard import MISSING_EXTRA, dashboard_available

            if not dashboard_available():
                raise ConfigError(f"--dashboard-port: {MISSING_EXTRA}")
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
            node=NodeConfig(
                host=host,
                port=listen_port,
                announce_host=announce_host,
                initial_peers=tuple(initial_peers),
                **trust,
            ),
            trainers=tuple(trainers),
            weight_readers=tuple(check_peer_id_flag("--weight-reader", r) for r in weight_reader) or None,
            run_id=run_id,
            model=model,
            model_config=parse_model_config(model_config),
            num_stages=stages,
            stage_bounds=parse_stage_bounds(stage_bounds),
            first_layout=FirstLayoutConfig(min_peers=min_peers, plan_wait_s=plan_wait) if min_peers else None,
            replan=(
                ReplanConfig(min_gain=replan_gain, patience=replan_patience, every_s=replan_every)
                if replan
                else None
            ),
            optimizer=OptimizerConfig(
                name=optimizer,
                lr=lr,
                weight_decay=weight_decay,
                warmup_steps=warmup_steps,
                schedule=lr_schedule,
                min_lr=min_lr,
                max_grad_norm=max_grad_norm,
            ),
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
            rl=None
            if task is None
            else RLConfig(
                task=task,
                task_options=parse_task_options(task_options),
                samples_per_prompt=samples_per_prompt,
                max_staleness=max_staleness,
                weights_codec=weights_codec,
                verify_fraction=verify_fraction,
                logprob_tolerance=logprob_tolerance,
            ),
            checkpoint_every=checkpoint_every,
            allow_reinit=allow_reinit,
            restore_lost_stage_only=restore_lost_stage_only,
            init_from=None if (init_from or resume) is None else str(resume or init_from),
            resume=resume is not None,
            checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
            dashboard=None
            if dashboard_port is None
            else DashboardConfig(host=dashboard_host, port=dashboard_port),
        )
        coord = Coordinator(config)
        coord.on_layout = typer.echo
        owner.remember_port(int(coord.address.split("/tcp/")[1].split("/")[0]))
        try:
            m = coord.manifest
            if coord.joined_existing:
                typer.echo(f"run {m.run_id!r} runs in this swarm already: serving its manifest as it is")
            if m.layout_version == 0:
                typer.echo(
                    f"run {m.run_id!r}: {m.model}, {m.num_blocks} blocks in {m.num_stages} stages, layout {m.layout_note}"
                )
            else:
                typer.echo(
                    f"run {m.run_id!r}: {m.model}, {m.num_blocks} blocks in {m.num_stages} stages {list(m.stage_bounds)}"
                )
            if m.compression.is_enabled:
                typer.echo(f"compression: {m.compression.describe()}")
            if m.loss is not None:
                typer.echo(f"loss: {m.loss}")
            if m.rl is not None:
                options = f" {json.dumps(m.rl.task_options)}" if m.rl.task_options else ""
                typer.echo(
                    f"task: {m.rl.task}{options}, {m.rl.samples_per_prompt} completions a prompt, "
                    "sampled by rollout peers (join --role rollout)"
                )
            if coord.is_owner:
                typer.echo(f"owner:        {coord.node.peer_id} (identity {owner.path})")
            else:
                typer.echo(
                    f"owner:        {coord.node.owner_of(m.run_id)} (this coordinator: {coord.node.peer_id})"
                )
            typer.echo(f"trainers:     {', '.join(m.trainers) or 'anyone (--any-trainer)'}")
            if m.weight_readers is not None:
                typer.echo(
                    f"weights for:  {', '.join(m.weight_readers) or 'its trainers and stage peers only'}"
                )
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
