"""Run files: a command's settings in a TOML file (`--config FILE`), flags overriding it, and
`--print-config` to write the settings in force out as one.

A run file holds one table per command, named after it, whose keys are the command's flags
(`initial-peers` or `initial_peers`); keys above the tables apply to every command that has
such a flag (a run's `run-id`, say):

    run-id = "demo"

    [coordinator]
    stages = 2
    compress-activations = "int8"

    [join]
    initial-peers = ["/ip4/10.0.0.5/tcp/31337/p2p/Qm..."]
    gpu = "auto"

The file's values go through the same parsing and checks as flags (they are the command's
defaults for this run), so a bad value gets the flag's own message, with the file named.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import tomllib
import typer
from typer._click.exceptions import UsageError
from typer.core import TyperCommand

from swarmtrain.errors import ConfigError

RunFile = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="A run file (TOML): this command's settings in its [table], keys named as the flags; "
        "flags given here override it. `--print-config` writes one.",
        show_default="flags only",
    ),
]
PrintConfig = Annotated[
    bool,
    typer.Option(
        "--print-config",
        help="Print the settings in force (run file, then flags) as a run file and exit without running.",
    ),
]
OWN = {"config", "print_config"}
"""The run file's own flags: never in a run file."""


def _flag_names(command) -> dict[str, str]:
    """Setting name (a flag's, with underscores) -> parameter name, for the command's options."""
    names = {}
    for param in command.params:
        if param.name in OWN:
            continue
        for opt in getattr(param, "opts", []):
            if opt.startswith("--"):
                names[opt[2:].replace("-", "_")] = param.name
    return names


def _config_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def load_run_file(path: str, command_name: str, command) -> dict[str, Any]:
    """The settings `path` gives `command_name`, by parameter name; ConfigError naming what is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    names = _flag_names(command)
    shared = {k: v for k, v in data.items() if not isinstance(v, dict)}
    own = data.get(command_name, {})
    if not isinstance(own, dict):
        raise ConfigError(f"--config {path}: [{command_name}] must be a table of settings")
    settings = {}
    for key, value in shared.items():
        name = names.get(key.replace("-", "_"))
        if name is not None:  # a shared key another command may have instead
            settings[name] = value
    unknown = [k for k in own if k.replace("-", "_") not in names]
    if unknown:
        hidden = {p.name for p in command.params if getattr(p, "hidden", False)}
        known = ", ".join(sorted(n.replace("_", "-") for n, pname in names.items() if pname not in hidden))
        raise ConfigError(
            f"--config {path}: [{command_name}] has no setting {', '.join(repr(k) for k in unknown)}; "
            f"`swarmtrain {command_name}` takes: {known}"
        )
    for key, value in own.items():
        settings[names[key.replace("-", "_")]] = value
    multiple = {p.name for p in command.params if getattr(p, "multiple", False)}
    return {
        name: [value] if name in multiple and not isinstance(value, list) else _as_flag_value(value)
        for name, value in settings.items()
    }


def _as_flag_value(value: Any) -> Any:
    """A TOML value as the parser takes a default: scalars as they are, lists of scalars as lists."""
    if isinstance(value, list):
        return [_as_flag_value(v) for v in value]
    if isinstance(value, dict):
        raise ConfigError(f"a setting cannot be a table: {value!r}")
    return value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string


def render_run_file(command_name: str, command, params: dict[str, Any]) -> str:
    """The settings in `params` as a run file of one [command_name] table (unset ones left out)."""
    lines = [
        f"# swarmtrain {command_name}: its settings, as `--print-config` wrote them",
        f"[{command_name}]",
    ]
    for param in command.params:
        if param.name in OWN or getattr(param, "hidden", False) or param.name not in params:
            continue
        value = params[param.name]
        if value is None or value == [] or value == ():
            continue
        flag = next((o[2:] for o in getattr(param, "opts", []) if o.startswith("--")), param.name)
        lines.append(f"{flag} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


class RunFileCommand(TyperCommand):
    """A command whose settings may come from a run file (`--config`) and be printed as one."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        path = _config_path(args)
        if path is None:
            return super().parse_args(ctx, args)
        ctx.default_map = load_run_file(path, ctx.info_name, self)
        try:
            return super().parse_args(ctx, args)
        except UsageError as e:  # the bad value may be the file's: say where to look
            e.message = f"{e.message} (flags and run file {path})"
            raise

    def invoke(self, ctx):
        if ctx.params.get("print_config"):
            typer.echo(render_run_file(ctx.info_name, self, ctx.params), nl=False)
            return None
        return super().invoke(ctx)
