"""What the dashboard knows about a swarm: a pure aggregator over successive DHT snapshots.

`SwarmView.update(records, manifest, now)` takes one poll of `{run}.peers` and `{run}.manifest`
and turns the difference from the previous poll into events (joins, leaves, state changes,
stage moves, completed steps) and into one point of each bounded time series. No I/O and no
clock of its own: the caller passes `now`, so tests drive it with plain data.

The view is read from the web server's thread while the poller writes it; one lock guards it.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from swarmtrain.errors import ConfigError
from swarmtrain.wire.metrics import TrainerPoint
from swarmtrain.wire.records import PeerRecord, RunManifest

EVENT_KINDS = ("join", "leave", "state", "stage", "step")


@dataclass(frozen=True, kw_only=True)
class ViewConfig:
    """How much history the dashboard keeps."""

    history_len: int = 600
    """Points kept per series (600 one-second polls: the last ten minutes)."""
    events_len: int = 200
    """Events kept in the log, newest last."""
    leave_after_missing: int = 2
    """Consecutive polls a peer must be missing from before it counts as gone (one DHT read can miss)."""

    def __post_init__(self):
        for name in ("history_len", "events_len", "leave_after_missing"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"dashboard {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Event:
    """Something that changed in the swarm between two polls."""

    t: float
    """Time of the poll that saw it."""
    kind: str
    """One of EVENT_KINDS."""
    peer_id: str
    """Peer concerned ('' for swarm-wide events such as a completed step)."""
    text: str
    """One line for people."""

    def to_dict(self) -> dict:
        return {"t": self.t, "kind": self.kind, "peer_id": self.peer_id, "text": self.text}


@dataclass(frozen=True, kw_only=True)
class PeerPoint:
    """One poll of one peer's counters."""

    t: float
    served: int
    step: int
    served_per_s: float
    """Microbatches per second since this peer's previous point (0 for its first)."""


def _short(peer_id: str) -> str:
    return peer_id[-8:]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN; a diverged loss shows as a gap


def _describe(r: PeerRecord) -> str:
    where = f"stage {r.stage}" if r.role == "stage" else r.role
    return f"{r.role} {_short(r.peer_id)} ({where}, {r.device})"


class SwarmView:
    """The swarm as the dashboard shows it. Feed it with `update()`; read it with `snapshot()`."""

    def __init__(self, config: ViewConfig | None = None):
        self.config = config or ViewConfig()
        self._lock = threading.Lock()
        self.manifest: RunManifest | None = None
        self.peers: dict[str, PeerRecord] = {}
        """Peers currently in the swarm (including ones missing from fewer than `leave_after_missing` polls)."""
        self._missing: dict[str, int] = {}
        self.events: deque[Event] = deque(maxlen=self.config.events_len)
        self.times: deque[float] = deque(maxlen=self.config.history_len)
        """Time of each swarm-level point; `peers_per_stage` and `step` are aligned with it."""
        self.peers_per_stage: deque[tuple[int, ...]] = deque(maxlen=self.config.history_len)
        self.step: deque[int] = deque(maxlen=self.config.history_len)
        self.peer_series: dict[str, deque[PeerPoint]] = {}
        self.trainer_series: dict[str, deque[TrainerPoint]] = {}
        self._max_step = -1
        self.version = 0
        """Bumped by every update; lets the event stream skip unchanged views."""

    # writing

    def update(self, records: list[PeerRecord], manifest: RunManifest | None, now: float) -> list[Event]:
        """Take one poll of the DHT; returns the events it produced (also appended to the log)."""
        with self._lock:
            new: list[Event] = []
            if manifest is not None:
                self.manifest = manifest
            seen = {r.peer_id: r for r in records}
            for peer_id, r in seen.items():
                self._missing.pop(peer_id, None)
                old = self.peers.get(peer_id)
                if old is None:
                    new.append(Event(t=now, kind="join", peer_id=peer_id, text=f"{_describe(r)} joined"))
                else:
                    if old.state != r.state:
                        text = f"{_describe(r)}: {old.state} -> {r.state}"
                        new.append(Event(t=now, kind="state", peer_id=peer_id, text=text))
                    if old.stage != r.stage:
                        text = f"{r.role} {_short(peer_id)} moved from stage {old.stage} to stage {r.stage}"
                        new.append(Event(t=now, kind="stage", peer_id=peer_id, text=text))
                self.peers[peer_id] = r
                if r.role == "stage":  # only stage peers serve microbatches
                    self._add_peer_point(r, now)
            for peer_id in [p for p in self.peers if p not in seen]:
                self._missing[peer_id] = self._missing.get(peer_id, 0) + 1
                if self._missing[peer_id] >= self.config.leave_after_missing:
                    r = self.peers.pop(peer_id)
                    del self._missing[peer_id]
                    new.append(Event(t=now, kind="leave", peer_id=peer_id, text=f"{_describe(r)} left"))
            stage_steps = [r.step for r in self.peers.values() if r.role == "stage"]
            step = max(stage_steps, default=0)
            if stage_steps and step > self._max_step:
                if self._max_step >= 0:  # the first poll finds a step, it does not see it complete
                    new.append(Event(t=now, kind="step", peer_id="", text=f"step {step} completed"))
                self._max_step = step
            self.times.append(now)
            self.peers_per_stage.append(self._count_per_stage())
            self.step.append(step)
            self._forget_old_series()
            self.events.extend(new)
            self.version += 1
            return new

    def add_trainer_point(
        self, step: int, loss: float, tokens_per_s: float, *, now: float, trainer: str = "trainer"
    ) -> None:
        """Record one optimizer step as a trainer saw it (the hook for trainer-side metrics)."""
        point = TrainerPoint(trainer=trainer, step=step, loss=loss, tokens_per_s=tokens_per_s, t=now)
        with self._lock:
            series = self.trainer_series.setdefault(trainer, deque(maxlen=self.config.history_len))
            series.append(point)
            self.version += 1

    def _add_peer_point(self, r: PeerRecord, now: float) -> None:
        series = self.peer_series.setdefault(r.peer_id, deque(maxlen=self.config.history_len))
        rate = 0.0
        if series and now > series[-1].t and r.served >= series[-1].served:  # a restart resets `served`
            rate = (r.served - series[-1].served) / (now - series[-1].t)
        series.append(PeerPoint(t=now, served=r.served, step=r.step, served_per_s=rate))

    def _count_per_stage(self) -> tuple[int, ...]:
        num_stages = self.manifest.num_stages if self.manifest else 0
        counts = [0] * num_stages
        for r in self.peers.values():
            if r.role == "stage" and r.state == "serving" and 0 <= r.stage < num_stages:
                counts[r.stage] += 1
        return tuple(counts)

    def _forget_old_series(self) -> None:
        """Drop the series of gone peers once their last point has aged out of the swarm history."""
        oldest = self.times[0]
        for peer_id in [p for p, s in self.peer_series.items() if p not in self.peers and s[-1].t < oldest]:
            del self.peer_series[peer_id]

    # reading

    def stages(self) -> list[dict]:
        """The swarm map: one column per stage of the manifest, its blocks and its replicas."""
        with self._lock:
            return self._stages()

    def _stages(self) -> list[dict]:
        if self.manifest is None:
            return []
        columns = []
        for k in range(self.manifest.num_stages):
            start, end = self.manifest.stage_span(k)
            replicas = sorted(
                (r for r in self.peers.values() if r.role == "stage" and r.stage == k),
                key=lambda r: (r.since, r.peer_id),
            )
            columns.append(
                {
                    "stage": k,
                    "blocks": [start, end],
                    "num_serving": sum(r.state == "serving" for r in replicas),
                    "replicas": [self._peer_dict(r) for r in replicas],
                }
            )
        return columns

    def _peer_dict(self, r: PeerRecord) -> dict:
        series = self.peer_series.get(r.peer_id)
        rate = series[-1].served_per_s if series else 0.0
        return r.to_dict() | {"served_per_s": rate, "missing_polls": self._missing.get(r.peer_id, 0)}

    def _manifest_summary(self) -> dict | None:
        m = self.manifest
        if m is None:
            return None
        return {
            "run_id": m.run_id,
            "model": m.model,
            "model_config": m.model_config,
            "num_blocks": m.num_blocks,
            "num_stages": m.num_stages,
            "stage_bounds": list(m.stage_bounds),
            "batch": m.batch.to_dict(),
            "optimizer": m.optimizer.to_dict(),
            "max_steps": m.max_steps,
        }

    def _series(self) -> dict:
        return {
            "t": list(self.times),
            "peers_per_stage": [list(c) for c in self.peers_per_stage],
            "step": list(self.step),
            "peers": {
                peer_id: {
                    "t": [p.t for p in s],
                    "served": [p.served for p in s],
                    "served_per_s": [p.served_per_s for p in s],
                    "step": [p.step for p in s],
                }
                for peer_id, s in self.peer_series.items()
            },
            "trainers": {
                name: {
                    "t": [p.t for p in s],
                    "step": [p.step for p in s],
                    "loss": [_finite(p.loss) for p in s],
                    "tokens_per_s": [p.tokens_per_s for p in s],
                }
                for name, s in self.trainer_series.items()
            },
        }

    def snapshot(self) -> dict:
        """Everything `/api/swarm` serves, as JSON-ready primitives."""
        with self._lock:
            return {
                "version": self.version,
                "updated_at": self.times[-1] if self.times else None,
                "manifest": self._manifest_summary(),
                "stages": self._stages(),
                "peers": [
                    self._peer_dict(r)
                    for r in sorted(self.peers.values(), key=lambda r: (r.role, r.stage, r.peer_id))
                ],
                "series": self._series(),
                "events": [e.to_dict() for e in self.events],
            }
