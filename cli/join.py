"""`swarmtrain join`: serve a run as a stage peer, a rollout peer, or whichever the run's
planner picks (`--role auto`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from swarmtrain.cli.options import (
    AllowModel,
    AnnounceHost,
    Host,
    IdentityPath,
    InitialPeers,
    LogFile,
    LogFormat,
    LogLevel,
    Port,
    RunId,
    RunOwner,
    Streams,
    SwarmKeyPath,
    Threads,
    UplinkMbit,
    Verbose,
    check_writable_flag,
    run_guarded,
    setup_logging,
    trust_settings,
    uplink_bytes_per_s,
)
from swarmtrain.cli.runfile import PrintConfig, RunFile

ROLLOUT_FAULTS = ("lie", "lie-logprobs")
"""The faults a rollout peer takes (`--inject-fault`); a `--role auto` peer gives each role its own."""


def join(
    initial_peers: InitialPeers,
    run_id: RunId = None,
    role: Annotated[
        str,
        typer.Option(
            help="stage: serve a pipeline stage; rollout: hold a whole copy of an RL run's policy and "
            "sample completions for its trainers; auto: the role the run's planner gives this machine "
            "(a stage in pre-training; in an RL run, stages on the machines best at training, rollouts "
            "on the rest), switched when the swarm changes."
        ),
    ] = "stage",
    stage: Annotated[
        int | None,
        typer.Option(
            help="Stage to serve, 0 to the run's stages - 1.", show_default="the stage that needs a peer most"
        ),
    ] = None,
    gpu: Annotated[
        str, typer.Option(help="Device to compute on: auto (first CUDA GPU, else CPU), cpu, cuda or cuda:N.")
    ] = "auto",
    dtype: Annotated[
        str,
        typer.Option(
            help="What stage compute runs in: auto (on a CUDA GPU bf16, or fp16 where it lacks bf16; on a CPU "
            "fp32), fp32, bf16 or fp16 (autocast, fp16 loss-scaled; weights and optimizer state stay fp32).",
        ),
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
    announce_host: AnnounceHost = None,
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
            help="Seconds a request may take to begin once its stream opens, and to send its next "
            "byte; a request that stops arriving is refused, and a half-sent one counts as a bad frame.",
        ),
    ] = 30.0,
    streams: Streams = "reuse",
    uplink_mbit: UplinkMbit = None,
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
    sample_slowdown: Annotated[
        float | None,
        typer.Option(
            min=1.0,
            help="Rollout and auto peers: make sampling take this many times longer (emulates a GPU "
            "whose memory bandwidth is less far behind than its compute).",
            show_default="--slowdown",
        ),
    ] = None,
    rebalance_every: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Seconds between checks whether moving to another stage (or, with --role auto, to the "
            "other role) would raise swarm throughput (by >10%, 3 checks in a row); 0 never moves.",
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
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where this peer writes its stage's checkpoints (the run sets how often).",
            show_default="<data dir>/checkpoints",
        ),
    ] = None,
    checkpoint_keep: Annotated[
        int, typer.Option(min=1, help="Checkpoints of its stage this peer keeps (the newest).")
    ] = 2,
    keep_versions: Annotated[
        int,
        typer.Option(
            min=1,
            max=16,
            help="Policy versions of its parameters this peer serves to rollout peers: the current one "
            "and those before it (kept in memory, once a rollout peer asked).",
        ),
    ] = 2,
    quantize: Annotated[
        str | None,
        typer.Option(
            help="Rollout peers: keep the policy's Linear weights quantized, 8bit or 4bit (bitsandbytes), "
            "to fit a small GPU.",
            show_default="full precision",
        ),
    ] = None,
    inject_fault: Annotated[
        str | None,
        typer.Option(
            hidden=True,
            help="Testing: ACTION:KIND:N kills (kill) or terminates (term) this peer as its N-th "
            "forward/backward/loss task starts; a rollout peer takes 'lie' (it claims every reward is 1) "
            "or 'lie-logprobs' (right rewards, wrong behaviour log-probs).",
            show_default="no fault",
        ),
    ] = None,
    identity: IdentityPath = None,
    swarm_key: SwarmKeyPath = None,
    run_owner: RunOwner = None,
    allow_model: AllowModel = None,
    verbose: Verbose = False,
    log_level: LogLevel = None,
    log_file: LogFile = None,
    log_format: LogFormat = "text",
    config: RunFile = None,
    print_config: PrintConfig = False,
) -> None:
    """Join a swarm as a stage peer (forward and backward passes), a rollout peer (--role
    rollout) or whichever the run's planner picks (--role auto), until stopped or the run's last step."""
    setup_logging(verbose, log_level, log_file, log_format)
    from swarmtrain.errors import ConfigError
    from swarmtrain.model import ModelSources
    from swarmtrain.peers.probe import parse_bytes, resolve_device, resolve_dtype
    from swarmtrain.peers.stage import StageConfig, StagePeer
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.train.versions import VersionsConfig
    from swarmtrain.transport import TransportConfig

    held: list[NodeConfig] = []

    def node() -> NodeConfig:
        """The swarm flags as a NodeConfig, made once per process: an auto peer keeps one
        identity (its default key, or --identity) in every role it takes."""
        if not held:
            held.append(
                NodeConfig(
                    initial_peers=tuple(initial_peers),
                    host=host,
                    port=port,
                    announce_host=announce_host,
                    **trust_settings("stage", identity, swarm_key, run_owner),
                )
            )
        return held[0]

    def transport() -> TransportConfig:
        """The frame flags, which every role's streams honour."""
        return TransportConfig(
            max_frame_bytes=int(max_frame_mb * 2**20),
            max_strikes=max_strikes,
            read_timeout_s=read_timeout,
            reuse_streams=streams == "reuse",
            uplink_bytes_per_s=uplink_bytes_per_s(uplink_mbit),
        )

    def main() -> None:
        if role not in ("stage", "rollout", "auto"):
            raise ConfigError(f"--role must be 'stage', 'rollout' or 'auto', got {role!r}")
        if role == "rollout":
            return _join_rollout()
        if role == "auto":
            return _join_auto()
        if quantize is not None:
            raise ConfigError(
                "--quantize is for rollout peers (--role rollout or auto); a stage trains in full precision"
            )
        if sample_slowdown is not None:
            raise ConfigError(
                "--sample-slowdown is for --role auto or rollout; a stage peer's compute is slowed by --slowdown"
            )
        peer = StagePeer(_stage_config())
        if ready_file is not None:
            peer.on_serving = lambda: _write_atomic(ready_file, peer.node.peer_id)
        else:
            peer.on_serving = lambda: _announce_stage(peer)
        peer.on_finished = peer.on_waiting = typer.echo
        peer.run()

    def _announce_stage(peer) -> None:
        typer.echo(
            f"serving stage {peer.stage} of run {peer.manifest.run_id!r} on {peer.config.device} as {peer.node.peer_id}"
        )

    def _announce_rollout(peer) -> None:
        typer.echo(
            f"sampling for run {peer.manifest.run_id!r} on {peer.config.device} as {peer.node.peer_id}"
        )

    def _stage_config():
        return StageConfig(
            node=node(),
            run_id=run_id,
            stage=stage,
            device=resolve_device(gpu),
            dtype=resolve_dtype(dtype, resolve_device(gpu)),
            num_threads=threads,
            transport=transport(),
            slowdown=slowdown,
            rebalance_s=rebalance_every,
            max_memory_bytes=None if max_memory is None else parse_bytes(max_memory),
            is_spot=spot,
            slowdown_file=None if slowdown_file is None else str(slowdown_file),
            fault=None if inject_fault in ROLLOUT_FAULTS else inject_fault,
            checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
            checkpoint_keep=checkpoint_keep,
            versions=VersionsConfig(keep_versions=keep_versions),
            models=ModelSources(allow=tuple(allow_model or ())),
        )

    def _rollout_config():
        from swarmtrain.peers.rollout import RolloutConfig
        from swarmtrain.rl.quantize import check_mode

        check_mode(quantize)
        return RolloutConfig(
            node=node(),
            run_id=run_id,
            device=resolve_device(gpu),
            num_threads=threads,
            models=ModelSources(allow=tuple(allow_model or ())),
            transport=transport(),
            quantize=quantize,
            slowdown=slowdown if sample_slowdown is None else sample_slowdown,
            max_memory_bytes=None if max_memory is None else parse_bytes(max_memory),
            fault=inject_fault if role == "rollout" or inject_fault in ROLLOUT_FAULTS else None,
            rebalance_s=rebalance_every,
        )

    def _join_rollout() -> None:
        from swarmtrain.peers.rollout import RolloutPeer

        peer = RolloutPeer(_rollout_config())
        if ready_file is not None:
            peer.on_serving = lambda: _write_atomic(ready_file, peer.node.peer_id)
        else:
            peer.on_serving = lambda: _announce_rollout(peer)
        peer.run()

    def _join_auto() -> None:
        from swarmtrain.peers.auto import AutoPeer

        stage_config, rollout_config = _stage_config(), _rollout_config()
        auto = AutoPeer(stage_config, rollout_config)

        def on_role(role, peer) -> None:
            switched = len(auto.roles) > 1
            typer.echo(
                f"{'switching to' if switched else 'taking'} the {role} role the run's planner gives this machine"
            )
            if ready_file is not None:  # the id once it serves, a line per role after that
                peer.on_serving = lambda: _write_atomic(ready_file, peer.node.peer_id)
            else:
                peer.on_serving = lambda: (_announce_stage if role == "stage" else _announce_rollout)(peer)
            if role == "stage":
                peer.on_finished = peer.on_waiting = typer.echo

        auto.on_role = on_role
        auto.run()

    run_guarded(main)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
