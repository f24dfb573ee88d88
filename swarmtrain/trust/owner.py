"""Which owner's manifest a peer accepts for a run.

Anyone may sign a manifest for any run id; a run is the run id together with its owner's
peer id. A peer takes the owner
1. it was told (`--run-owner ID`), else
2. whose address it was given (an `--initial-peers` address ends in the coordinator's
   peer id, and the coordinator is the run's owner), else
3. it pinned the first time it joined the run (`<data dir>/pins.json`), else
4. the only one there is, which it then pins (trust on first use).
A manifest from any other owner is refused with a message naming the flag that settles it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from swarmtrain.errors import ConfigError, RunNotFoundError
from swarmtrain.trust.identity import data_dir

logger = logging.getLogger(__name__)


class OwnerPins:
    """The owner this machine pinned for each run id, in a small JSON file."""

    def __init__(self, path: Path | None = None):
        self.path = path or data_dir() / "pins.json"

    def read(self) -> dict[str, str]:
        try:
            pins = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in pins.items()} if isinstance(pins, dict) else {}

    def get(self, run_id: str) -> str | None:
        return self.read().get(run_id)

    def pin(self, run_id: str, owner: str) -> None:
        pins = self.read()
        if pins.get(run_id) == owner:
            return
        pins[run_id] = owner
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(pins, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:
            logger.warning("could not pin the owner of run %r in %s: %s", run_id, self.path, e)


def choose_owner(
    run_id: str,
    owners: list[str],
    *,
    run_owner: str | None,
    initial_peer_ids: tuple[str, ...],
    pins: OwnerPins,
) -> str:
    """The owner whose manifest of `run_id` to accept among `owners` (those that signed one).
    Raises RunNotFoundError or ConfigError saying which owners there are and what to pass."""
    listed = ", ".join(owners)
    if run_owner is not None:
        if run_owner in owners:
            pins.pin(run_id, run_owner)
            return run_owner
        raise RunNotFoundError(
            f"run {run_id!r} has no manifest signed by --run-owner {run_owner} (it has one from {listed}): "
            "check the owner id the run's coordinator printed"
        )
    told = [o for o in owners if o in initial_peer_ids]
    if len(told) == 1:
        pins.pin(run_id, told[0])
        return told[0]
    pinned = pins.get(run_id)
    if pinned is not None:
        if pinned in owners:
            return pinned
        raise ConfigError(
            f"run {run_id!r} is announced by owner {listed}, but this machine pinned owner {pinned} for it "
            f"when it first joined ({pins.path}): a manifest from another owner is refused. If the run "
            f"really has a new owner, pass --run-owner with its id"
        )
    if len(owners) == 1:
        logger.warning(
            "trusting %s as the owner of run %r from now on (pinned in %s)", owners[0], run_id, pins.path
        )
        pins.pin(run_id, owners[0])
        return owners[0]
    raise ConfigError(
        f"run {run_id!r} is announced by {len(owners)} different owners ({listed}): pass --run-owner with "
        "the id its coordinator printed, or join through the coordinator's own address"
    )
