"""Policy versions: a stage replica's parameters by the run's step, for rollout peers.

Version v of the policy is its parameters after the run applied steps 0..v-1: the initial
weights (the run seed's, or those the run started from) are version 0, and a replica that
applied step s holds version s + 1. A replica's current version is its `StageRunner.step`.
Replicas of a stage are bit-identical at a step, so any of them serves a version it holds.

A replica serves its current version from its live parameters and keeps earlier ones as CPU
snapshots, `keep_versions` versions in all (the current one included), so that a fetch in
several requests reads one version even when a commit comes in the middle. Snapshots cost a
training run nothing until someone asks for weights: only a replica that served a weights
request in the last `interest_s` seconds copies its parameters at a commit (the outgoing
version, just before the optimizer steps). A version read in the last `lease_s` seconds is
kept one commit past `keep_versions` (at most one such version), so a slow fetch in flight is
not cut short.

`before_apply`, `read` and `reset` run on the replica's compute thread (with the optimizer
step they order against); `read_held` and `mark_interest` are safe from any thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from swarmtrain.errors import BadFrameError, Cause, ConfigError, RemoteError

Piece = tuple[str, int, int]
"""(parameter name, first row, row past the last): rows along dim 0; a 0-d parameter is one row."""


@dataclass(frozen=True, kw_only=True)
class VersionsConfig:
    """How many policy versions a replica keeps, and when it pays for them."""

    keep_versions: int = 2
    """Versions a replica serves: its current one and the `keep_versions - 1` before it
    (1: only the current one, and no snapshot is ever taken)."""
    interest_s: float = 600.0
    """After a weights request, the replica snapshots the outgoing version at every commit for
    this long; a replica nobody asked never copies anything."""
    lease_s: float = 30.0
    """A version read this recently is kept one commit longer than `keep_versions` says."""

    def __post_init__(self):
        if not isinstance(self.keep_versions, int) or not 1 <= self.keep_versions <= 16:
            raise ConfigError(f"keep_versions must be an integer in 1..16, got {self.keep_versions!r}")
        if not self.interest_s >= 0 or not self.lease_s >= 0:
            raise ConfigError(
                f"interest_s and lease_s must be >= 0 seconds, got {self.interest_s} and {self.lease_s}"
            )


@dataclass
class VersionStats:
    """What keeping versions cost a replica."""

    snapshots: int = 0
    """Snapshots taken (one per commit while someone was asking)."""
    snapshot_s: float = 0.0
    """Seconds the compute thread spent copying them."""
    longest_snapshot_s: float = 0.0
    held_bytes: int = 0
    """Bytes the snapshots held now take."""


def describe_versions(versions: list[int]) -> str:
    """'5..6', '4, 6..7' or 'none': versions for people."""
    runs: list[list[int]] = []
    for v in sorted(versions):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs) or "none"


def _rows(t: Tensor, start: int, end: int) -> Tensor:
    return t if t.dim() == 0 else t[start:end]


def check_pieces(shapes: Mapping[str, torch.Size], pieces: list[Piece]) -> None:
    """BadFrameError unless every piece names a parameter in `shapes` and rows it has."""
    for name, start, end in pieces:
        shape = shapes.get(name)
        if shape is None:
            raise BadFrameError(f"this stage has no parameter {name!r}")
        rows = shape[0] if len(shape) else 1
        if not 0 <= start < end <= rows:
            raise BadFrameError(f"parameter {name!r} has rows 0..{rows}, a piece asks for {start}..{end}")


class PolicyVersions:
    """The policy versions one replica holds (see the module docstring)."""

    def __init__(self, config: VersionsConfig | None = None, *, clock: Callable[[], float] = time.monotonic):
        self.config = config or VersionsConfig()
        self.clock = clock
        self.stats = VersionStats()
        self._snapshots: dict[int, dict[str, Tensor]] = {}
        self._read_at: dict[int, float] = {}
        self._asked_at = -math.inf
        self._lock = threading.Lock()

    def mark_interest(self) -> None:
        """Someone asked for weights: snapshot versions at commits for `interest_s` from now."""
        self._asked_at = self.clock()

    @property
    def interested(self) -> bool:
        return self.clock() - self._asked_at <= self.config.interest_s

    def held(self, current: int) -> list[int]:
        """The versions a replica at `current` serves, oldest first."""
        with self._lock:
            return sorted({*self._snapshots, current})

    def before_apply(self, version: int, params: Mapping[str, Tensor]) -> None:
        """The replica is about to step its optimizer from `version` to `version + 1`: snapshot
        `version` if someone asked lately and it will still be kept, and drop what will not."""
        keep_from = version + 2 - self.config.keep_versions  # oldest version kept after the step
        if self.interested and version >= keep_from and version not in self._snapshots:
            t0 = time.perf_counter()
            snapshot = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
            took = time.perf_counter() - t0
            self.stats.snapshots += 1
            self.stats.snapshot_s += took
            self.stats.longest_snapshot_s = max(self.stats.longest_snapshot_s, took)
            with self._lock:
                self._snapshots[version] = snapshot
        now = self.clock()
        with self._lock:
            leased = [
                v for v, at in self._read_at.items() if now - at <= self.config.lease_s and v < keep_from
            ]
            pinned = max(leased, default=None)
            for v in [v for v in self._snapshots if v < keep_from and v != pinned]:
                del self._snapshots[v]
            self._read_at = {v: at for v, at in self._read_at.items() if v in self._snapshots}
            self.stats.held_bytes = sum(t.nbytes for s in self._snapshots.values() for t in s.values())

    def reset(self) -> None:
        """The parameters were replaced (a replica's state taken, a rollback): forget every
        snapshot, whose versions may now name other weights."""
        with self._lock:
            self._snapshots.clear()
            self._read_at.clear()
            self.stats.held_bytes = 0

    def read_held(self, version: int, pieces: list[Piece]) -> list[Tensor] | None:
        """The pieces of snapshot `version` (views: snapshots never change), None if none is held."""
        with self._lock:
            snapshot = self._snapshots.get(version)
            if snapshot is None:
                return None
            self._read_at[version] = self.clock()
        check_pieces({k: t.shape for k, t in snapshot.items()}, pieces)
        return [_rows(snapshot[name], start, end) for name, start, end in pieces]

    def read(
        self, version: int, current: int, params: Mapping[str, Tensor], pieces: list[Piece]
    ) -> list[Tensor]:
        """The pieces of `version` (CPU copies) for a replica at `current` with live `params`.

        Raises RemoteError WRONG_STEP for a version this replica has not reached yet, and
        VERSION_GONE, naming the versions it holds, for one it no longer holds; BadFrameError
        for a piece that names no parameter or rows it lacks.
        """
        held = self.read_held(version, pieces)
        if held is not None:
            return held
        if version == current:
            check_pieces({k: p.shape for k, p in params.items()}, pieces)
            with self._lock:
                self._read_at[version] = self.clock()
            return [
                _rows(params[name].detach(), start, end).to("cpu", copy=True) for name, start, end in pieces
            ]
        holds = describe_versions(self.held(current))
        if version > current:
            raise RemoteError(
                f"version {version} is not here yet: this replica holds versions {holds}",
                cause=Cause.WRONG_STEP,
            )
        raise RemoteError(
            f"version {version} is gone: this replica holds versions {holds}", cause=Cause.VERSION_GONE
        )
