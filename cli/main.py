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

from swarmtrain.cli.coordinator import coordinator  # noqa: E402
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
    check_writable_flag,
    print_error,
    run_guarded,
    setup_logging,
    trust_settings,
)
from swarmtrain.cli.tools import demo, export, probe, status  # noqa: E402
from swarmtrain.errors import SwarmError  # noqa: E402

app = typer.Typer(
    name="swarmtrain",
    help="Elastic, decentralized training over spot and consumer GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(coordinator)


ROLLOUT_FAULTS = ("lie", "lie-logprobs")
"""The faults a rollout peer takes (`--inject-fault`); a `--role auto` peer gives each role its own."""


@app.command()
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
) -> None:
    """Join a swarm as a stage peer and serve forward and backward passes until stopped (or
    until the run's last step)."""
    setup_logging(verbose)
    from swarmtrain.errors import ConfigError
    from swarmtrain.model import ModelSources
    from swarmtrain.peers.probe import parse_bytes, resolve_device
    from swarmtrain.peers.stage import StageConfig, StagePeer
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.train.versions import VersionsConfig
    from swarmtrain.transport import TransportConfig

    held: list[dict] = []

    def trust() -> dict:
        """The trust flags' node settings, once per process: an auto peer keeps one identity
        (its default key, or --identity) in every role it takes."""
        if not held:
            held.append(trust_settings("stage", identity, swarm_key, run_owner))
        return held[0]

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
        peer.on_finished = typer.echo
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
            node=NodeConfig(
                initial_peers=tuple(initial_peers),
                host=host,
                port=port,
                announce_host=announce_host,
                **trust(),
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
            node=NodeConfig(
                initial_peers=tuple(initial_peers),
                host=host,
                port=port,
                announce_host=announce_host,
                **trust(),
            ),
            run_id=run_id,
            device=resolve_device(gpu),
            num_threads=threads,
            models=ModelSources(allow=tuple(allow_model or ())),
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
                peer.on_finished = typer.echo

        auto.on_role = on_role
        auto.run()

    run_guarded(main)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


@app.command()
def train(
    initial_peers: InitialPeers,
    run_id: RunId = None,
    steps: Annotated[
        int, typer.Option(help="Optimizer steps to run, then exit (sooner at the run's last step).")
    ] = 100,
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
    shard: Annotated[
        str | None,
        typer.Option(
            help="This trainer's shard I/N of the run's data: it feeds microbatches I, I+N, I+2N, ... of "
            "the run's data order, other trainers the rest; N must divide the run's microbatches per step.",
            show_default="its place among the run's authorized trainers (I of N), the whole data if the "
            "run authorizes any trainer",
        ),
    ] = None,
    min_trainers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Wait (at most a minute) until this many trainers of the run are up before the first "
            "step, so trainers started together feed the run from its first step.",
        ),
    ] = 1,
    verify_replicas: Annotated[
        bool,
        typer.Option(
            "--verify-replicas", help="Check after each step that every stage's replicas are bit-identical."
        ),
    ] = False,
    jsonl: Annotated[
        bool, typer.Option("--jsonl", help="Print one JSON object per step instead of text.")
    ] = False,
    inject_fault: Annotated[
        str | None,
        typer.Option(
            hidden=True,
            help="Testing: kill:KIND:N kills this trainer as it sends its N-th request of a kind "
            "(forward, claim, prepare, exchange, apply, report).",
            show_default="no fault",
        ),
    ] = None,
    identity: IdentityPath = None,
    swarm_key: SwarmKeyPath = None,
    run_owner: RunOwner = None,
    allow_model: AllowModel = None,
    verbose: Verbose = False,
) -> None:
    """Train a run: feed microbatches of text (bytes, or token ids from the model's tokenizer) into
    the swarm and step it. Several trainers may feed one run, each its shard of every step."""
    setup_logging(verbose)
    from swarmtrain.model import ModelSources
    from swarmtrain.peers.trainer import Trainer, TrainerConfig
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.train.data import text_batches_for
    from swarmtrain.train.run_length import last_step_message

    def main() -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        node = NodeConfig(
            initial_peers=tuple(initial_peers), **trust_settings("trainer", identity, swarm_key, run_owner)
        )
        config = TrainerConfig(
            node=node,
            run_id=run_id,
            microbatch_timeout_s=timeout,
            shard=shard or "auto",
            min_trainers=min_trainers,
            verify_replicas=verify_replicas,
            fault=inject_fault,
        )
        with Trainer(config) as trainer:
            models = ModelSources(allow=tuple(allow_model or ()))
            feed = None
            if trainer.manifest.rl is not None:  # rollout peers make the data
                from swarmtrain.rl.feed import RolloutFeed

                batches = feed = RolloutFeed(trainer)
            else:
                batches = text_batches_for(trainer.manifest, data, models=models)
            if trainer.shard.count > 1:
                typer.echo(f"feeding shard {trainer.shard} of run {trainer.manifest.run_id!r}", err=jsonl)
            for result in trainer.train(batches, steps=steps, run_order=feed is None):
                rl = feed.report(result.step) if feed is not None else {}
                if jsonl:
                    record = {
                        "step": result.step,
                        "loss": result.loss,
                        "tokens": result.tokens,
                        "seconds": result.seconds,
                        "tokens_per_s": result.tokens_per_s,
                        "completed": result.completed,
                        "adopted": result.adopted,
                        "replays": result.replays,
                        "dropped": result.dropped,
                        "replay_causes": result.replay_causes,
                        "dropped_causes": result.dropped_causes,
                        "window": result.window,
                        "lr": result.lr,
                        "grad_norm": result.grad_norm,
                        "replicas_equal": result.replicas_equal,
                        **rl,
                    }
                    typer.echo(json.dumps(record))
                else:
                    extra = f"  {result.replays} replayed" if result.replays else ""
                    extra += f"  {result.dropped} dropped" if result.dropped else ""
                    extra += f"  grad norm {result.grad_norm:.3g}" if result.grad_norm is not None else ""
                    if rl:
                        extra += f"  reward {rl['reward']:.3f}  policy lag {rl['policy_lag']:.1f}"
                        extra += f"  stale {rl['stale']}" if rl["stale"] else ""
                    if result.rolled_back:
                        typer.echo(f"rolled back: {result.rolled_back}")
                    typer.echo(
                        f"step {result.step:5d}  loss {result.loss:.4f}  lr {result.lr:.3g}  "
                        f"{result.tokens_per_s:8.0f} tokens/s{extra}"
                    )
            if trainer.finished:  # on stderr with --jsonl, so stdout stays JSON lines
                m = trainer.manifest
                typer.echo(last_step_message(m.run_id, m.max_steps), err=jsonl)

    run_guarded(main)


for command in (probe, status, export, demo, keygen, whoami):  # after the roles in --help
    app.command()(command)


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
