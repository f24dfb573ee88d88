"""What every `swarmtrain` command shares: its option types, flag parsers, and how errors end
(one line on stderr, exit code 2)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from swarmtrain.errors import ConfigError, SwarmError

USAGE_EXIT_CODE = 2
"""Exit code of every bad-input error, swarmtrain's own and typer's (as click uses for usage errors)."""


def check_run_id_flag(run_id: str | None) -> str | None:
    """Reject a malformed --run-id while the flags are parsed, before the network is touched."""
    if run_id is None:
        return None
    from swarmtrain.wire.records import check_run_id

    return check_run_id(run_id)


def check_writable_flag(ctx: typer.Context, param: typer.CallbackParam, path: Path | None) -> Path | None:
    """Reject a file flag whose folder is missing or read-only while the flags are parsed, not
    after the peer has joined the swarm."""
    if path is None:
        return None
    folder = path.absolute().parent
    if not folder.is_dir():
        raise ConfigError(
            f"{param.opts[0]} {path}: folder {folder} does not exist; create it or pick another path"
        )
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{param.opts[0]} {path}: folder {folder} is not writable; pick another path")
    return path


def read_initial_peers_flag(values: list[str] | None) -> list[str]:
    """--initial-peers as given, with each @FILE replaced by the addresses in that file (one per
    line: what `coordinator --address-file` writes)."""
    addresses = []
    for value in values or ():
        if not value.startswith("@"):
            addresses.append(value)
            continue
        path = Path(value[1:])
        try:
            lines = path.read_text().split()
        except OSError as e:
            raise ConfigError(
                f"--initial-peers {value}: cannot read {path} ({e.strerror or e}); the coordinator writes it "
                "with --address-file once it serves"
            ) from None
        if not lines:
            raise ConfigError(
                f"--initial-peers {value}: {path} is empty (the coordinator has not served yet)"
            )
        addresses.extend(lines)
    return addresses


InitialPeers = Annotated[
    list[str],
    typer.Option(
        "--initial-peers",
        help="Address of a peer already in the swarm, as printed by `swarmtrain coordinator` "
        "(/ip4/HOST/tcp/PORT/p2p/PEER_ID), or @FILE to read them from a file (`coordinator "
        "--address-file`). Repeat for several.",
        callback=read_initial_peers_flag,
    ),
]
RunId = Annotated[
    str | None,
    typer.Option(
        "--run-id",
        help="Run to take part in.",
        show_default="the only run the swarm announces",
        callback=check_run_id_flag,
    ),
]
Host = Annotated[
    str, typer.Option(help="IPv4 address to listen on; 0.0.0.0 accepts peers from other machines.")
]
Port = Annotated[
    int, typer.Option(min=0, max=65535, help="TCP port to listen on, 0..65535; 0 picks a free port.")
]
AnnounceHost = Annotated[
    str | None,
    typer.Option(
        help="Address other peers should dial, if not --host (behind NAT or in a container); with any "
        "--port, 0 included.",
        show_default="--host",
    ),
]
Threads = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="torch intra-op CPU threads.",
        show_default="torch's choice, about one per core",
        min=1,
    ),
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log progress to stderr.")]


def check_streams_flag(streams: str) -> str:
    """Reject an unknown --streams while the flags are parsed."""
    if streams not in ("reuse", "per-frame"):
        raise ConfigError(f"--streams must be 'reuse' or 'per-frame', got {streams!r}")
    return streams


Streams = Annotated[
    str,
    typer.Option(
        "--streams",
        help="'reuse': a call to a peer goes over an idle stream an earlier call opened; 'per-frame': "
        "every call opens a stream of its own (slower over a slow link; kept to compare against).",
        callback=check_streams_flag,
    ),
]


UplinkMbit = Annotated[
    float | None,
    typer.Option(
        "--uplink-mbit",
        help="This machine's uplink in Mbit/s: frames leave one after another at 95% of it, in the order "
        "they were sent, so over a slow link the next stage gets its first microbatch early instead of "
        "all of them late.",
        show_default="not paced",
        min=0.001,
    ),
]


def uplink_bytes_per_s(uplink_mbit: float | None) -> float | None:
    """--uplink-mbit as the transport's pacing rate: 95% of the link, for the daemon's and TCP's
    framing (a pacer at the full rate lets a queue build up at the link)."""
    return None if uplink_mbit is None else 0.95 * uplink_mbit * 1e6 / 8


def check_allow_model_flag(patterns: list[str] | None) -> list[str]:
    """Reject an --allow-model that is not a pattern of import paths while the flags are parsed."""
    from swarmtrain.model import ModelSources

    ModelSources(allow=tuple(patterns or ()))
    return list(patterns or ())


AllowModel = Annotated[
    list[str],
    typer.Option(
        "--allow-model",
        help="Let the run's manifest name this import path 'package.module:function' as its model "
        "(fnmatch pattern, e.g. 'mylab.models:*'): this peer imports and runs it, so allow only "
        "code you trust. Repeat for several. Registered names (tiny-gpt) and installed entry points "
        "(group swarmtrain.models) need no flag.",
        show_default="no import path",
        callback=check_allow_model_flag,
    ),
]


def print_error(message: str) -> None:
    """Print `message` as one red line on stderr, prefixed 'error: '."""
    typer.secho(f"error: {' '.join(message.split())}", fg="red", err=True)


def fail(message: str) -> None:
    """Print one clear line to stderr and exit non-zero, without a traceback."""
    print_error(message)
    raise typer.Exit(USAGE_EXIT_CODE)


LOG_LEVELS = ("debug", "info", "warning", "error")


def check_log_level_flag(level: str | None) -> str | None:
    """Reject an unknown --log-level while the flags are parsed."""
    if level is not None and level.lower() not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return None if level is None else level.lower()


def check_log_format_flag(fmt: str) -> str:
    if fmt not in ("text", "json"):
        raise ConfigError(f"--log-format must be 'text' or 'json', got {fmt!r}")
    return fmt


LogLevel = Annotated[
    str | None,
    typer.Option(
        "--log-level",
        help="Least severe log messages shown: debug, info, warning or error.",
        show_default="warning; info with -v",
        callback=check_log_level_flag,
    ),
]
LogFile = Annotated[
    Path | None,
    typer.Option(
        "--log-file",
        help="Also append the log to this file.",
        show_default="stderr only",
        callback=check_writable_flag,
    ),
]
LogFormat = Annotated[
    str,
    typer.Option(
        "--log-format",
        help="'text' (time, level, logger, message) or 'json' (one object a line, for log collectors).",
        callback=check_log_format_flag,
    ),
]


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(
    verbose: bool, level: str | None = None, file: Path | None = None, fmt: str = "text"
) -> None:
    """Logging for a command: `level` (else info with -v, warning without) to stderr, and to
    `file` too when given, as text or JSON lines."""
    name = level or ("info" if verbose else "warning")
    if fmt == "json":
        formatter: logging.Formatter = JsonLogFormatter()
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if file is not None:
        handlers.append(logging.FileHandler(file, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=getattr(logging, name.upper()), handlers=handlers)


def parse_model_config(text: str, flag: str = "--model-config") -> dict:
    """'{"n_layer": 4}' or 'n_layer=4,d_model=128' -> dict (numbers and booleans typed);
    ConfigError naming `flag` otherwise."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{flag} is not valid JSON ({e}): write an object like "
                """'{"n_layer": 4}', or KEY=VALUE,KEY=VALUE"""
            ) from None
        if not isinstance(value, dict):
            raise ConfigError(
                f"{flag} must be a JSON object like '{{\"n_layer\": 4}}', or KEY=VALUE,KEY=VALUE"
            )
        return value
    out = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"{flag} item {item!r} is not KEY=VALUE: write KEY=VALUE,KEY=VALUE, e.g. n_layer=4,d_model=128"
            )
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw.strip()
    return out


def parse_stage_bounds(text: str | None) -> tuple[int, ...] | None:
    """'0,3,5,6' -> (0, 3, 5, 6); the manifest checks that they rise from 0 to the block count."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--stage-bounds {text!r} must be comma-separated block indices, e.g. 0,3,5,6"
        ) from None


def run_guarded(fn, *args, **kwargs):
    """Call `fn`, turning swarmtrain's errors into one line and exit code 2."""
    try:
        return fn(*args, **kwargs)
    except SwarmError as e:
        fail(str(e))
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        raise typer.Exit(130) from None


# trust: who a peer is, which swarm it belongs to, whose run it accepts

IdentityPath = Annotated[
    Path | None,
    typer.Option(
        "--identity",
        help="Key file of this peer's identity, made on first use: the peer id (and a coordinator's "
        "address) stay the same across restarts.",
        show_default="<data dir>/identity/<role>-N.key, the first one no running peer holds",
    ),
]
SwarmKeyPath = Annotated[
    Path | None,
    typer.Option(
        "--swarm-key",
        help="Private swarm: the key file every peer of the swarm shares (make one with `swarmtrain keygen "
        "PATH`). Peers without it can neither read nor write the swarm's records nor open a stream to its peers.",
        show_default="an open swarm",
    ),
]


def check_peer_id_flag(flag: str, peer: str) -> str:
    """`peer` if it is a peer id, else ConfigError naming `flag`."""
    from swarmtrain.wire.records import PEER_ID_PATTERN

    if not PEER_ID_PATTERN.match(peer):
        raise ConfigError(
            f"{flag} {peer!r} is not a peer id (base58, like Qm... or 12D3KooW...): "
            "`swarmtrain whoami` on that peer's machine prints it"
        )
    return peer


def check_run_owner_flag(owner: str | None) -> str | None:
    if owner is None:
        return None
    from swarmtrain.wire.records import PEER_ID_PATTERN

    if not PEER_ID_PATTERN.match(owner):
        raise ConfigError(
            f"--run-owner {owner!r} is not a peer id (base58, like Qm... or 12D3KooW...): "
            "give the owner id the run's coordinator printed"
        )
    return owner


RunOwner = Annotated[
    str | None,
    typer.Option(
        "--run-owner",
        help="Peer id of the run's owner, as its coordinator prints it: only a manifest it signed is accepted.",
        show_default="the owner whose address --initial-peers gives, else the one this machine pinned "
        "for the run, else the only one (then pinned)",
        callback=check_run_owner_flag,
    ),
]

_held_identities: list = []
"""Default identities this process holds (their lock files stay locked until it exits)."""


def trust_settings(
    role: str, identity: Path | None, swarm_key: Path | None, run_owner: str | None = None
) -> dict:
    """NodeConfig fields for the trust flags: `--identity` (or the role's default key, held by
    this process), `--swarm-key`, `--run-owner`. ConfigError names a bad file."""
    from swarmtrain.trust.identity import Identity
    from swarmtrain.trust.swarmkey import load_swarm_key

    if swarm_key is not None:
        load_swarm_key(swarm_key)  # a bad key file fails here, before the network is touched
    held = Identity.default(role) if identity is None else Identity.load(identity)
    _held_identities.append(held)
    return {
        "identity_path": str(held.path),
        "swarm_key_path": None if swarm_key is None else str(swarm_key),
        "run_owner": run_owner,
    }


def parse_task_options(text: str) -> dict:
    """--task-options: like --model-config, '{"digits": 2}' or digits=2."""
    return parse_model_config(text, "--task-options")
