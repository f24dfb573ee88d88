"""`swarmtrain keygen` and `swarmtrain whoami`: make a private swarm's key, and show the peer
id an identity key file gives (what a run's owner lists with `coordinator --trainer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from swarmtrain.cli.options import run_guarded


def keygen(
    path: Annotated[Path, typer.Argument(help="File to write the new key to (it must not exist yet).")],
) -> None:
    """Make a private swarm's key: give the same file to every peer of the swarm with --swarm-key."""
    from swarmtrain.trust.swarmkey import generate_swarm_key

    def main() -> None:
        key = generate_swarm_key(path)
        typer.echo(f"wrote swarm key {key.fingerprint} to {path} (readable by you alone)")
        typer.echo(f"give every peer of the swarm this file: swarmtrain join --swarm-key {path} ...")

    run_guarded(main)


def whoami(
    role: Annotated[
        str, typer.Option(help="Whose default identity to show: coordinator, stage or trainer.")
    ] = "trainer",
    identity: Annotated[
        Path | None,
        typer.Option(
            "--identity",
            help="Show this key file's peer id instead (made if missing).",
            show_default="this machine's default key of --role",
        ),
    ] = None,
) -> None:
    """Print the peer id this machine's peer of a role runs as (or that --identity gives).

    It is the id a run's owner passes to `swarmtrain coordinator --trainer ID` to let that
    trainer drive the run."""
    from swarmtrain.errors import ConfigError
    from swarmtrain.trust.identity import Identity, default_identity_path

    def main() -> None:
        if role not in ("coordinator", "stage", "trainer"):
            raise ConfigError(f"--role {role!r}: choose coordinator, stage or trainer")
        key = Identity.load(identity if identity is not None else default_identity_path(role))
        typer.echo(key.peer_id)

    run_guarded(main)
