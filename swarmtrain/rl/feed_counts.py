"""What a rollout feed counted (`swarmtrain.rl.feed`): per step, and since it started."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """What one step trained on."""

    samples: int = 0
    reward_sum: float = 0.0
    versions: list[int] = field(default_factory=list)

    @property
    def reward(self) -> float:
        return self.reward_sum / self.samples if self.samples else float("nan")


@dataclass
class FeedCounts:
    """What the feed took and refused since it started."""

    samples: int = 0
    """Completions received and checked."""
    stale: int = 0
    """Completions dropped as more than max_staleness versions old."""
    rejected: int = 0
    """Completions refused with their peer (a malformed reply, a wrong reward)."""
    lost: int = 0
    """Completions asked of a peer that failed or died before answering."""
    refused: int = 0
    """Requests a rollout peer refused (behind the version asked for, draining, ...)."""
    verified: int = 0
    """Replies whose behaviour log-probs were recomputed through the pipeline and held."""
    verify_failed: int = 0
    """Replies whose log-probs did not hold (each banned its peer)."""
    verify_skipped: int = 0
    """Replies drawn for a check but not checked: sampled by an older version than the stages
    hold, or their score pass failed."""
    logprob_gap: float = float("nan")
    """The last check's mean |claimed - recomputed| log-prob over completion tokens (nats)."""
    max_logprob_gap: float = float("nan")
    """The largest such gap seen (nats)."""
