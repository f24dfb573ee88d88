"""What the dashboard knows about a swarm: a pure aggregator over successive DHT snapshots.

`SwarmView.update(records, manifest, now)` takes one poll of `{run}.peers` and `{run}.manifest`
and turns the difference from the previous poll into events (joins, leaves, state changes,
stage moves, bans, replays, completed steps) and into one point of each bounded time series;
`add_trainer_point()` takes a trainer's `TrainerPoint` from `{run}.trainers`. No I/O and no
clock of its own: the caller passes `now`, so tests drive it with plain data.

An RL run (`rl` in the snapshot, null for others) shows more: each rollout peer's policy lag
(versions behind the newest its stages serve) and sampling rate, each trainer's rewards,
accuracy, samples per second and its feed's stale and rejected completions
(`TrainerPoint.rl`), and the run's summary of them (`rl_view`).

A peer's display state (`status` in the snapshot) is its own state (joining, serving,
draining, finished), except `banned` while another live peer lists it in its `banned`, and `gone` for
a while after it left. Everything kept is bounded: series by `history_len` points, the log
by `events_len`, gone peers by `gone_keep_s` and `max_gone`, forgotten peers' and trainers'
series once they age out of the history.

The view is read from the web server's thread while the poller writes it; one lock guards it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from swarmtrain.errors import ConfigError
from swarmtrain.peers.dashboard.layout_view import LayoutWatch
from swarmtrain.peers.dashboard.rl_view import finite, rl_dict, rl_series, rl_summary
from swarmtrain.wire.metrics import TrainerPoint
from swarmtrain.wire.records import PeerRecord, RunManifest

EVENT_KINDS = ("join", "leave", "state", "move", "ban", "replay", "drop", "step", "layout")
DISPLAY_STATES = ("joining", "serving", "draining", "lost", "finished", "banned", "gone")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ViewConfig:
    """How much history the dashboard keeps."""

    history_len: int = 600
    """Points kept per series (600 one-second polls: the last ten minutes)."""
    events_len: int = 200
    """Events kept in the log, newest last."""
    leave_after_missing: int = 2
    """Consecutive polls a peer must be missing from before it counts as gone (one DHT read can miss)."""
    gone_keep_s: float = 120.0
    """Seconds a peer that left stays on the map (greyed, as 'gone')."""
    max_gone: int = 64
    """Gone peers kept at most, the oldest dropped first (bounds the map under heavy churn)."""

    def __post_init__(self):
        for name in ("history_len", "events_len", "leave_after_missing", "max_gone"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"dashboard {name} must be a positive integer, got {value!r}")
        if not self.gone_keep_s >= 0:
            raise ConfigError(f"dashboard gone_keep_s must be >= 0, got {self.gone_keep_s}")


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
    count: int = 1
    """Routine events folded into this one line (completed steps in a row)."""
    steps: tuple[int, int] | None = None
    """A step event's first and last completed step."""

    def to_dict(self) -> dict:
        return {
            "t": self.t,
            "kind": self.kind,
            "peer_id": self.peer_id,
            "text": self.text,
            "count": self.count,
        }


@dataclass(frozen=True, kw_only=True)
class PeerPoint:
    """One poll of one peer's counters, with its rates since the peer's previous point (0 for its first)."""

    t: float
    role: str
    """The peer's role then: 'stage' (served counts microbatches) or 'rollout' (completions)."""
    served: int
    step: int
    bytes_sent: int
    raw_bytes_sent: int
    served_per_s: float
    bytes_sent_per_s: float
    """Tensor bytes per second this peer put on the wire (after compression)."""
    raw_bytes_sent_per_s: float
    """The same bytes before compression."""


def rate(new: int, old: int, dt_s: float) -> float:
    """Growth per second of a counter; 0 when time did not advance or the counter was reset (a restart)."""
    return (new - old) / dt_s if dt_s > 0 and new >= old else 0.0


def _short(peer_id: str) -> str:
    return peer_id[-8:]


def _describe(r: PeerRecord) -> str:
    where = f"stage {r.stage}" if r.role == "stage" else r.role
    return f"{r.role} {_short(r.peer_id)} ({where}, {r.device})"


def _changes(old: PeerRecord | None, r: PeerRecord, now: float) -> list[Event]:
    """The events one peer's new record makes against its previous one."""
    if old is None:
        return [Event(t=now, kind="join", peer_id=r.peer_id, text=f"{_describe(r)} joined")]
    out = []
    if old.state != r.state:
        text = f"{_describe(r)}: {old.state} -> {r.state}"
        out.append(Event(t=now, kind="state", peer_id=r.peer_id, text=text))
    if old.stage != r.stage:
        text = f"{r.role} {_short(r.peer_id)} moved from stage {old.stage} to stage {r.stage} (rebalance)"
        out.append(Event(t=now, kind="move", peer_id=r.peer_id, text=text))
    if r.replayed > old.replayed:
        text = f"{_describe(r)} replayed {r.replayed - old.replayed} microbatch(es) ({r.replayed} in all)"
        out.append(Event(t=now, kind="replay", peer_id=r.peer_id, text=text))
    return out


class SwarmView:
    """The swarm as the dashboard shows it. Feed it with `update()`; read it with `snapshot()`."""

    def __init__(self, config: ViewConfig | None = None):
        self.config = config or ViewConfig()
        self._lock = threading.Lock()
        self.manifest: RunManifest | None = None
        self.peers: dict[str, PeerRecord] = {}
        """Peers currently in the swarm (including ones missing from fewer than `leave_after_missing` polls)."""
        self._missing: dict[str, int] = {}
        self.gone: dict[str, tuple[PeerRecord, float]] = {}
        """Peers that left, with the time they were seen leaving, oldest first."""
        self.banned_by: dict[str, tuple[str, ...]] = {}
        """Peer id -> the live peers that ban it now."""
        self.events: deque[Event] = deque(maxlen=self.config.events_len)
        n = self.config.history_len
        self.times: deque[float] = deque(maxlen=n)
        """Time of each swarm-level point; the other swarm series are aligned with it."""
        self.peers_per_stage: deque[tuple[int, ...]] = deque(maxlen=n)
        self.step: deque[int] = deque(maxlen=n)
        self.bytes_sent_per_s: deque[float] = deque(maxlen=n)
        """Sum over stage peers of their bytes_sent rate: the swarm's traffic on the wire."""
        self.raw_bytes_sent_per_s: deque[float] = deque(maxlen=n)
        self.predicted_tokens_per_s: deque[float | None] = deque(maxlen=n)
        """The cost model's tokens/s for the live layout (`placement.layout_prediction`); None
        while a stage has no serving replica."""
        self.prediction: dict | None = None
        """The latest `layout_prediction`."""
        self._costs: tuple[RunManifest, list] | None = None  # the manifest's traced block costs
        self.replan: dict | None = None
        """The layout the planner would give the serving peers now, against theirs (`LayoutWatch`)."""
        self._layout_watch = LayoutWatch()
        self.peer_series: dict[str, deque[PeerPoint]] = {}
        self.trainer_series: dict[str, deque[TrainerPoint]] = {}
        self._max_step = -1
        self.version = 0
        """Bumped by every change; lets the event stream skip unchanged views."""

    # writing

    def update(self, records: list[PeerRecord], manifest: RunManifest | None, now: float) -> list[Event]:
        """Take one poll of the DHT; returns the events it produced (also appended to the log)."""
        with self._lock:
            new: list[Event] = []
            if manifest is not None:
                old = self.manifest
                planned = (
                    manifest.layout_version == 0 or manifest.layout_note
                )  # else a layout set from the start
                if (old is None and planned) or (
                    old is not None and old.layout_version != manifest.layout_version
                ):
                    note, version = manifest.layout_note, manifest.layout_version
                    text = (
                        f"layout {note}"
                        if version == 0
                        else f"layout {version}" + (f": {note}" if note else "")
                    )
                    new.append(Event(t=now, kind="layout", peer_id="", text=text))
                self.manifest = manifest
            seen = {r.peer_id: r for r in records}
            sent = raw = 0.0
            for peer_id, r in seen.items():
                self._missing.pop(peer_id, None)
                self.gone.pop(peer_id, None)
                new += _changes(self.peers.get(peer_id), r, now)
                self.peers[peer_id] = r
                if r.role == "stage":  # only stage peers serve microbatches
                    point = self._add_peer_point(r, now)
                    sent, raw = sent + point.bytes_sent_per_s, raw + point.raw_bytes_sent_per_s
                elif r.role == "rollout":  # their served count is completions sampled
                    self._add_peer_point(r, now)
            for peer_id in [p for p in self.peers if p not in seen]:
                self._missing[peer_id] = self._missing.get(peer_id, 0) + 1
                if self._missing[peer_id] >= self.config.leave_after_missing:
                    r = self.peers.pop(peer_id)
                    del self._missing[peer_id]
                    self.gone[peer_id] = (r, now)
                    new.append(Event(t=now, kind="leave", peer_id=peer_id, text=f"{_describe(r)} left"))
            self._expire_gone(now)
            new += self._update_bans(now)
            stage_steps = [r.step for r in self.peers.values() if r.role == "stage"]
            step = max(stage_steps, default=0)
            if stage_steps and step > self._max_step:
                if self._max_step >= 0:  # the first poll finds a step, it does not see it complete
                    text = f"step {step} completed"
                    new.append(Event(t=now, kind="step", peer_id="", text=text, steps=(step, step)))
                self._max_step = step
            self.times.append(now)
            self.peers_per_stage.append(self._count_per_stage())
            self.step.append(step)
            self.bytes_sent_per_s.append(sent)
            self.raw_bytes_sent_per_s.append(raw)
            self.prediction = self._predict()
            self.replan = None
            if self.prediction is not None:  # every stage served, and a cost model
                self.replan = self._layout_watch.observe(
                    self.manifest, list(self.peers.values()), self._costs[1]
                )
            self.predicted_tokens_per_s.append(
                None if self.prediction is None else self.prediction["predicted_tokens_per_s"]
            )
            self._forget_old_series()
            self._log(new)
            self.version += 1
            return new

    def add_trainer_point(self, point: TrainerPoint) -> list[Event]:
        """Record one optimizer step as a trainer saw it; a point already seen (same or older
        `t`) is ignored. Returns the events it made (replays, drops), also appended to the log."""
        with self._lock:
            series = self.trainer_series.setdefault(point.trainer, deque(maxlen=self.config.history_len))
            last = series[-1] if series else None
            if last is not None and point.t <= last.t:
                return []
            new = []
            who = f"trainer {_short(point.trainer)}"
            if last is not None and point.replayed > last.replayed:
                text = f"{who} replayed {point.replayed - last.replayed} microbatch(es) ({point.replayed} in all)"
                new.append(Event(t=point.t, kind="replay", peer_id=point.trainer, text=text))
            if last is not None and point.dropped > last.dropped:
                text = f"{who} dropped {point.dropped - last.dropped} microbatch(es) ({point.dropped} in all)"
                new.append(Event(t=point.t, kind="drop", peer_id=point.trainer, text=text))
            if point.rolled_back:
                new.append(Event(t=point.t, kind="rollback", peer_id=point.trainer, text=point.rolled_back))
            series.append(point)
            self._log(new)
            self.version += 1
            return new

    def _add_peer_point(self, r: PeerRecord, now: float) -> PeerPoint:
        series = self.peer_series.setdefault(r.peer_id, deque(maxlen=self.config.history_len))
        if series:
            last, dt = series[-1], now - series[-1].t
            rates = (
                rate(r.served, last.served, dt),
                rate(r.bytes_sent, last.bytes_sent, dt),
                rate(r.raw_bytes_sent, last.raw_bytes_sent, dt),
            )
        else:
            rates = (0.0, 0.0, 0.0)
        point = PeerPoint(
            t=now, role=r.role, served=r.served, step=r.step, bytes_sent=r.bytes_sent, raw_bytes_sent=r.raw_bytes_sent,
            served_per_s=rates[0], bytes_sent_per_s=rates[1], raw_bytes_sent_per_s=rates[2],
        )  # fmt: skip
        series.append(point)
        return point

    def _update_bans(self, now: float) -> list[Event]:
        """Recompute who bans whom from the live peers' records; a newly listed pair is a 'ban' event."""
        before = {(banner, banned) for banned, banners in self.banned_by.items() for banner in banners}
        pairs = sorted((r.peer_id, banned) for r in self.peers.values() for banned in r.banned)
        by: dict[str, list[str]] = {}
        for banner, banned in pairs:
            by.setdefault(banned, []).append(banner)
        self.banned_by = {banned: tuple(banners) for banned, banners in by.items()}
        new = []
        for banner, banned in pairs:
            if (banner, banned) not in before:
                target = self.peers.get(banned)
                whom = _describe(target) if target else _short(banned)
                text = f"{_describe(self.peers[banner])} banned {whom}"
                new.append(Event(t=now, kind="ban", peer_id=banned, text=text))
        return new

    def _expire_gone(self, now: float) -> None:
        for peer_id, (_, left_at) in list(self.gone.items()):
            if now - left_at > self.config.gone_keep_s or len(self.gone) > self.config.max_gone:
                del self.gone[peer_id]

    def _count_per_stage(self) -> tuple[int, ...]:
        num_stages = self.manifest.num_stages if self.manifest else 0
        counts = [0] * num_stages
        for r in self.peers.values():
            if r.role == "stage" and r.state == "serving" and 0 <= r.stage < num_stages:
                counts[r.stage] += 1
        return tuple(counts)

    def _predict(self) -> dict | None:
        """`layout_prediction` of the live stage peers; the manifest's block costs are traced
        once per manifest. None without a manifest, or when its model cannot be traced here."""
        from swarmtrain.train.placement import layout_prediction, manifest_costs

        m = self.manifest
        if m is None:
            return None
        if self._costs is None or self._costs[0] != m:
            try:
                self._costs = (m, manifest_costs(m))
            except (ConfigError, RuntimeError) as e:  # a model this process may not build
                self._costs = (m, [])
                logger.debug("no cost model for run %s: %s", m.run_id, e)
        if not self._costs[1]:
            return None
        return layout_prediction(m, self.peers.values(), self._costs[1])

    def _log(self, new: list[Event]) -> None:
        """Append `new` to the event log, folding completed steps in a row into one line (the
        latest event stays the line's time), so routine progress never buries joins, leaves,
        bans, replays, drops and moves."""
        for event in new:
            last = self.events[-1] if self.events else None
            if event.kind == "step" and last is not None and last.kind == "step":
                steps, count = (last.steps[0], event.steps[1]), last.count + 1
                text = f"steps {steps[0]}-{steps[1]} completed"
                self.events[-1] = Event(
                    t=event.t, kind="step", peer_id="", text=text, count=count, steps=steps
                )
            else:
                self.events.append(event)

    def _forget_old_series(self) -> None:
        """Drop the series of gone peers and silent trainers once their last point has aged out
        of the swarm history."""
        oldest = self.times[0]
        for peer_id in [p for p, s in self.peer_series.items() if p not in self.peers and s[-1].t < oldest]:
            del self.peer_series[peer_id]
        for name in [n for n, s in self.trainer_series.items() if not s or s[-1].t < oldest]:
            del self.trainer_series[name]

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
            live = sorted(
                (r for r in self.peers.values() if r.role == "stage" and r.stage == k),
                key=lambda r: (r.since, r.peer_id),
            )
            gone = [(r, t) for r, t in self.gone.values() if r.role == "stage" and r.stage == k]
            columns.append(
                {
                    "stage": k,
                    "blocks": [start, end],
                    "num_serving": sum(r.state == "serving" for r in live),
                    "codecs": self._stage_codecs(k),
                    "replicas": [self._peer_dict(r) for r in live]
                    + [self._peer_dict(r, left_at=t) for r, t in gone],
                }
            )
        return columns

    def _policy_version(self) -> int | None:
        """The newest policy version (step) a live stage peer holds; None without stage peers."""
        return max((r.step for r in self.peers.values() if r.role == "stage"), default=None)

    def _peer_dict(self, r: PeerRecord, *, left_at: float | None = None) -> dict:
        """A peer record as the page and `swarmtrain status` show it: the record's fields plus
        its display state, who bans it, its rates, its compression ratio and, for a rollout
        peer, its policy lag."""
        version = self._policy_version() if r.role == "rollout" else None
        series = self.peer_series.get(r.peer_id)
        last = series[-1] if series and left_at is None else None
        status = "gone" if left_at is not None else "banned" if r.peer_id in self.banned_by else r.state
        return r.to_dict() | {
            "status": status,
            "banned_by": list(self.banned_by.get(r.peer_id, ())),
            "served_per_s": last.served_per_s if last else 0.0,
            "bytes_sent_per_s": last.bytes_sent_per_s if last else 0.0,
            "compression": r.raw_bytes_sent / r.bytes_sent if r.raw_bytes_sent and r.bytes_sent else None,
            "memory_total_bytes": r.capacity.get("memory_bytes") or None,
            "missing_polls": self._missing.get(r.peer_id, 0),
            "left_at": left_at,
            "policy_lag": None if version is None else version - r.step,
        }

    def _stage_codecs(self, k: int) -> dict[str, str | None]:
        c, last = self.manifest.compression, self.manifest.num_stages - 1
        return {
            "forward": c.sent_by("activations", k) if k < last else None,
            "backward": c.sent_by("gradients", k) if k > 0 else None,
            "averaging": c.sent_by("averaging", k),
        }

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
            "layout_version": m.layout_version,
            "layout_note": m.layout_note,
            "layout_at": m.layout_at,
            "batch": m.batch.to_dict(),
            "optimizer": m.optimizer.to_dict(),
            "max_steps": m.max_steps,
            "schedule": m.schedule,
            "loss": m.loss,
            "compression": m.compression.to_dict(),
            "compressed": m.compression.is_enabled,
            "rl": None if m.rl is None else m.rl.to_dict(),
        }

    def _rl(self) -> dict | None:
        """An RL run's summary (`rl_view.rl_summary`); None unless the run is an RL run: its
        manifest names a task, or (without a manifest) a rollout peer or an RL step is seen."""
        latest = [s[-1] for s in self.trainer_series.values() if s]
        rollouts = [r for r in self.peers.values() if r.role == "rollout"]
        if self.manifest is not None:
            is_rl = self.manifest.rl is not None
        else:
            gone = any(r.role == "rollout" for r, _ in self.gone.values())
            is_rl = bool(rollouts) or gone or any(p.rl is not None for p in latest)
        if not is_rl:
            return None
        serving = sum(r.state == "serving" and r.peer_id not in self.banned_by for r in rollouts)
        return rl_summary(latest, self._policy_version(), serving)

    def _finished(self) -> bool:
        """Whether the run applied its last step, as far as the polls seen tell: a stage peer
        reached it, a trainer reported it, or the coordinator announces it (a finished
        coordinator's record carries the run's last step)."""
        m = self.manifest
        if m is None or not m.max_steps:
            return False
        trained = [s[-1].step + 1 for s in self.trainer_series.values() if s]
        announced = [r.step for r in self.peers.values()]
        return max([self._max_step, *trained, *announced]) >= m.max_steps

    def _series(self) -> dict:
        return {
            "t": list(self.times),
            "peers_per_stage": [list(c) for c in self.peers_per_stage],
            "step": list(self.step),
            "bytes_sent_per_s": list(self.bytes_sent_per_s),
            "raw_bytes_sent_per_s": list(self.raw_bytes_sent_per_s),
            "predicted_tokens_per_s": list(self.predicted_tokens_per_s),
            "peers": {
                peer_id: {
                    "t": [p.t for p in s],
                    "role": s[-1].role,
                    "served": [p.served for p in s],
                    "served_per_s": [p.served_per_s for p in s],
                    "bytes_sent_per_s": [p.bytes_sent_per_s for p in s],
                    "step": [p.step for p in s],
                }
                for peer_id, s in self.peer_series.items()
            },
            "trainers": {
                name: {
                    "t": [p.t for p in s],
                    "step": [p.step for p in s],
                    "loss": [finite(p.loss) for p in s],
                    "tokens_per_s": [p.tokens_per_s for p in s],
                    "completed": [p.completed for p in s],
                    "replayed": [p.replayed for p in s],
                    "dropped": [p.dropped for p in s],
                    "window": [p.window for p in s],
                    **rl_series(s),
                }
                for name, s in self.trainer_series.items()
            },
        }

    def _trainers(self) -> list[dict]:
        """The latest point of each trainer, most recent first."""
        latest = sorted((s[-1] for s in self.trainer_series.values() if s), key=lambda p: -p.t)
        return [p.to_dict() | {"loss": finite(p.loss), "rl": rl_dict(p.rl)} for p in latest]

    def snapshot(self, *, with_history: bool = True) -> dict:
        """Everything `/api/swarm` serves, as JSON-ready primitives; without `with_history`,
        only the present (no series, no events): what `swarmtrain status` prints."""
        with self._lock:
            out = {
                "version": self.version,
                "updated_at": self.times[-1] if self.times else None,
                "manifest": self._manifest_summary(),
                "stages": self._stages(),
                "peers": [
                    self._peer_dict(r)
                    for r in sorted(self.peers.values(), key=lambda r: (r.role, r.stage, r.peer_id))
                ],
                "gone": [self._peer_dict(r, left_at=t) for r, t in reversed(self.gone.values())],
                "trainers": self._trainers(),
                "finished": self._finished(),
                "rl": self._rl(),
                "prediction": self.prediction,
                "replan": self.replan,
            }
            if with_history:
                out["series"] = self._series()
                out["events"] = [e.to_dict() for e in self.events]
            return out
