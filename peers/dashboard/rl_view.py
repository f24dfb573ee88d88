"""What the dashboard and `swarmtrain status` show of an RL run, from trainers' points: pure.

A trainer of an RL run publishes an `RLPoint` with each step (`TrainerPoint.rl`). Here they
become JSON-ready dicts (NaN means, of a step of no samples, become null), per-trainer series,
and the run's summary: the newest step's figures over every trainer that reported one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from swarmtrain.wire.metrics import RLPoint, TrainerPoint

RL_SERIES = ("reward", "accuracy", "policy_lag", "samples_per_s", "stale", "rejected")
"""What of a trainer's RL points its series keep (null at a point without RL figures)."""


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN: a diverged loss or a missing mean is a gap


def rl_dict(rl: RLPoint | None) -> dict | None:
    """An RL point as JSON-ready primitives."""
    if rl is None:
        return None
    return {k: finite(v) if isinstance(v, float) else v for k, v in rl.to_dict().items()}


def rl_series(points: Iterable[TrainerPoint]) -> dict[str, list]:
    """One trainer's RL_SERIES, aligned with its points."""
    out: dict[str, list] = {name: [] for name in RL_SERIES}
    for p in points:
        rl = rl_dict(p.rl) or {}
        for name in RL_SERIES:
            out[name].append(rl.get(name))
    return out


def _weighted(points: list[RLPoint], name: str) -> float | None:
    """The mean of `name` over every sample of `points` (None when they trained on none)."""
    samples = sum(p.samples for p in points)
    return sum(getattr(p, name) * p.samples for p in points if p.samples) / samples if samples else None


def rl_summary(latest: Iterable[TrainerPoint], policy_version: int | None, rollouts: int) -> dict:
    """The RL run at a glance, from each trainer's latest point: the newest step any reported,
    the mean reward, accuracy and policy lag over the completions those steps trained on, the
    trainers' samples/s, stale and rejected completions summed, and the most rollout peers any
    trainer banned; `policy_version`, the newest a stage holds; `rollouts`, the serving rollout
    peers nobody bans."""
    points = [p for p in latest if p.rl is not None]
    rl = [p.rl for p in points]
    return {
        "policy_version": policy_version,
        "rollout_peers": rollouts,
        "step": max((p.step for p in points), default=None),
        "reward": _weighted(rl, "reward"),
        "accuracy": _weighted(rl, "accuracy"),
        "policy_lag": _weighted(rl, "policy_lag"),
        "samples_per_s": sum(p.samples_per_s for p in rl),
        "stale": sum(p.stale for p in rl),
        "rejected": sum(p.rejected for p in rl),
        "banned": max((p.banned for p in rl), default=0),
    }
