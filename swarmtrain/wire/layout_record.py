"""A run's layout as a trainer re-planned it, and the run's rule for re-planning (both records).

A run whose owner opted in to live re-planning (`coordinator --replan`) carries its rule in
the manifest (`RunManifest.replan`: the gain a new layout must promise, for how many checks,
how often to check). Every trainer of the run applies that rule to the same DHT view, and the
lead one (`lead_trainer`) publishes the layouts it moves the swarm to under `{run}.layout`,
signed by itself: `LayoutRecord`. No coordinator is needed for a layout to change, nor any
other single peer: when the lead trainer goes, the next one leads.

`apply_layout` is how every peer reads a run's layout: the owner's manifest, with the newest
layout record of an authorized trainer laid over it where that one is newer. The owner's
coordinator, while it runs, signs such a layout into its manifest too, so the run's layout
outlives its trainers' records.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.wire.run_config import _from_dict, _is_int, _is_number

MAX_LAYOUT_NOTE = 300
"""Longest note a layout carries (`RunManifest.layout_note`)."""
MAX_ASSIGNMENTS = 512
"""Most peers a layout names (`RunManifest.assignments`)."""


@dataclass(frozen=True, kw_only=True)
class ReplanConfig:
    """When a re-planned layout is worth moving the swarm to (the run's rule, in its manifest)."""

    min_gain: float = 0.2
    """Smallest predicted relative gain worth a layout move: blocks change hands, so a move
    costs more than one peer's (`RebalanceConfig.min_gain`, 0.10) (--replan-gain)."""
    patience: int = 3
    """Consecutive checks the same proposal must keep that gain (--replan-patience)."""
    every_s: float = 10.0
    """Seconds between checks (--replan-every)."""

    def __post_init__(self):
        gain = self.min_gain
        if not _is_number(gain) or not (gain >= 0 and math.isfinite(gain)):
            raise ConfigError(
                f"ReplanConfig: min_gain must be a finite number >= 0, got {gain!r} (--replan-gain)"
            )
        if not _is_int(self.patience) or self.patience < 1:
            raise ConfigError(
                f"ReplanConfig: patience must be an integer >= 1, got {self.patience!r} (--replan-patience)"
            )
        every = self.every_s
        if not _is_number(every) or not (0 < every < math.inf):
            raise ConfigError(
                f"ReplanConfig: every_s must be a number of seconds > 0, got {every!r} (--replan-every)"
            )
        object.__setattr__(self, "min_gain", float(gain))
        object.__setattr__(self, "every_s", float(every))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ReplanConfig:
        return _from_dict(cls, data, "replan")


def spans_text(bounds) -> str:
    """Stage bounds as people read them: (0, 5, 6) -> '0-4, 5-5' (each stage's first and last block)."""
    return ", ".join(f"{a}-{b - 1}" for a, b in zip(bounds, bounds[1:], strict=False))


def check_assignments(assignments: Any, num_stages: int, what: str) -> dict[str, int]:
    """`assignments` (peer id -> stage) as a dict sorted by peer id; ConfigError if it is not one."""
    from swarmtrain.wire.records import PEER_ID_PATTERN

    if (
        not isinstance(assignments, dict)
        or len(assignments) > MAX_ASSIGNMENTS
        or not all(
            isinstance(p, str) and PEER_ID_PATTERN.match(p) and _is_int(k) and 0 <= k < num_stages
            for p, k in assignments.items()
        )
    ):
        raise ConfigError(
            f"{what}: assignments must map at most {MAX_ASSIGNMENTS} peer ids to stages "
            f"0..{num_stages - 1}, got {assignments!r:.200}"
        )
    return dict(sorted(assignments.items()))


@dataclass(frozen=True, kw_only=True)
class LayoutRecord:
    """A layout a trainer moves the run to, under `{run}.layout` (subkey: that trainer)."""

    planner: str
    """Peer id of the trainer that planned it (the record's signer)."""
    version: int
    """Its layout version: one past the version the swarm was on."""
    stage_bounds: tuple[int, ...]
    """Stage k serves blocks [stage_bounds[k], stage_bounds[k+1])."""
    assignments: dict[str, int] = field(default_factory=dict)
    """The stage the layout gives each peer it was planned from."""
    note: str = ""
    """Why, for people (`RunManifest.layout_note`)."""
    at: float = 0.0
    """DHT time it was planned."""

    def __post_init__(self):
        from swarmtrain.wire.records import PEER_ID_PATTERN

        if not isinstance(self.planner, str) or not PEER_ID_PATTERN.match(self.planner):
            raise ConfigError(f"layout: planner must be a peer id, got {self.planner!r:.80}")
        if not _is_int(self.version) or not 2 <= self.version < 2**31:
            raise ConfigError(
                f"layout: version must be an integer >= 2 (1 is the owner's), got {self.version!r}"
            )
        b = self.stage_bounds
        if (
            not isinstance(b, list | tuple)
            or not 2 <= len(b) <= 1025
            or not all(_is_int(x) for x in b)
            or b[0] != 0
            or any(x >= y for x, y in zip(b, b[1:], strict=False))
        ):
            raise ConfigError(f"layout: stage_bounds must rise strictly from 0, got {b!r:.200}")
        object.__setattr__(self, "stage_bounds", tuple(b))
        object.__setattr__(self, "assignments", check_assignments(self.assignments, len(b) - 1, "layout"))
        if not isinstance(self.note, str) or len(self.note) > MAX_LAYOUT_NOTE:
            raise ConfigError(f"layout: note must be text of at most {MAX_LAYOUT_NOTE} characters")
        if not _is_number(self.at) or not (self.at >= 0 and math.isfinite(self.at)):
            raise ConfigError(f"layout: at must be a DHT time >= 0, got {self.at!r}")

    def to_dict(self) -> dict:
        return {
            "planner": self.planner,
            "version": self.version,
            "stage_bounds": list(self.stage_bounds),
            "assignments": dict(self.assignments),
            "note": self.note,
            "at": self.at,
        }

    @classmethod
    def from_dict(cls, data: Any) -> LayoutRecord:
        return _from_dict(cls, data, "layout")


def fits(manifest, record: LayoutRecord) -> bool:
    """Whether `record` is a layout of `manifest`'s run that may replace its own: newer, with
    its stage count and blocks, planned by a trainer the run authorizes (any, in an open run)."""
    return (
        manifest.replan is not None
        and manifest.layout_version >= 1
        and record.version > manifest.layout_version
        and len(record.stage_bounds) == len(manifest.stage_bounds)
        and record.stage_bounds[-1] == manifest.num_blocks
        and (not manifest.trainers or record.planner in manifest.trainers)
    )


def apply_layout(manifest, records: Iterable[LayoutRecord]):
    """`manifest` (a `RunManifest`) with the newest of `records` that `fits` it laid over its
    layout (ties: the later planned, then the greater planner id), or as it is."""
    usable = [r for r in records if fits(manifest, r)]
    if not usable:
        return manifest
    newest = max(usable, key=lambda r: (r.version, r.at, r.planner))
    return dataclasses.replace(
        manifest,
        stage_bounds=newest.stage_bounds,
        assignments=dict(newest.assignments),
        layout_version=newest.version,
        layout_note=newest.note,
        layout_at=newest.at,
    )


def lead_trainer(manifest, trainer_ids: Iterable[str]) -> str | None:
    """The trainer that re-plans the run's layout: the least peer id among the live trainers
    `trainer_ids` the run authorizes (all, in an open run); None if none."""
    ids = [t for t in trainer_ids if not manifest.trainers or t in manifest.trainers]
    return min(ids, default=None)
