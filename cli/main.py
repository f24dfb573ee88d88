"""`swarmtrain`: the command line. Each command parses flags into a config, builds the
object, runs it and closes it; the logic lives in the Python API under it."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

# Before hivemind is imported anywhere. CRITICAL: the p2p daemon's own errors reach the user
# as one explained line (swarm.node._explain_daemon_error), not as its raw log.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "CRITICAL")

import typer  # noqa: E402

from swarmtrain.cli.coordinator import coordinator  # noqa: E402
from swarmtrain.cli.join import join  # noqa: E402
from swarmtrain.cli.keys import keygen, whoami  # noqa: E402
from swarmtrain.cli.options import (  # noqa: E402
    USAGE_EXIT_CODE,
    AllowModel,
    IdentityPath,
    InitialPeers,
    LogFile,
    LogFormat,
    LogLevel,
    RunId,
    RunOwner,
    Streams,
    SwarmKeyPath,
    Threads,
    UplinkMbit,
    Verbose,
    print_error,
    run_guarded,
    setup_logging,
    trust_settings,
    uplink_bytes_per_s,
)
from swarmtrain.cli.runfile import PrintConfig, RunFile, RunFileCommand  # noqa: E402
from swarmtrain.cli.simulate import simulate  # noqa: E402
from swarmtrain.cli.tools import demo, export, probe, status  # noqa: E402
from swarmtrain.errors import SwarmError  # noqa: E402

app = typer.Typer(
    name="swarmtrain",
    help="Elastic, decentralized training over spot and consumer GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(cls=RunFileCommand)(coordinator)
app.command(cls=RunFileCommand)(join)


@app.command(cls=RunFileCommand)
def train(
    initial_peers: InitialPeers,
    run_id: RunId = None,
    steps: Annotated[
        int, typer.Option(min=1, help="Optimizer steps to run, then exit (sooner at the run's last step).")
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
    streams: Streams = "reuse",
    uplink_mbit: UplinkMbit = None,
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
    """Train a run: feed microbatches of text (bytes, or token ids from the model's tokenizer) into
    the swarm and step it. Several trainers may feed one run, each its shard of every step."""
    setup_logging(verbose, log_level, log_file, log_format)
    from swarmtrain.model import ModelSources
    from swarmtrain.peers.trainer import Trainer, TrainerConfig
    from swarmtrain.swarm import NodeConfig
    from swarmtrain.train.data import text_batches_for
    from swarmtrain.train.run_length import last_step_message
    from swarmtrain.transport import TransportConfig

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
            transport=TransportConfig(
                reuse_streams=streams == "reuse", uplink_bytes_per_s=uplink_bytes_per_s(uplink_mbit)
            ),
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


for command in (probe, status, export, demo, simulate, keygen, whoami):  # after the roles in --help
    app.command(cls=RunFileCommand if command is demo else None)(command)


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
