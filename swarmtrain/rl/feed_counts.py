"""What a rollout feed counted (`swarmtrain.rl.feed`): per step, and since it started."""

from __future__ import annotations

from dataclasses import dataclass, field

NAN = float("nan")


@dataclass
class StepStats:
    """What one step trained on."""

    samples: int = 0
    """Completions fed into the step."""
    reward_sum: float = 0.0
    """Their rewards, summed."""
    correct: int = 0
    """Those fully right (`Task.is_correct`)."""
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each."""

    @property
    def reward(self) -> float:
        """Mean reward; NaN for a step of no samples."""
        return self.reward_sum / self.samples if self.samples else NAN

    @property
    def accuracy(self) -> float:
        """The fraction fully right; NaN for a step of no samples."""
        return self.correct / self.samples if self.samples else NAN

    def policy_lag(self, step: int) -> float:
        """Mean of `step` minus each sample's policy version; NaN for a step of no samples."""
        return sum(step - v for v in self.versions) / len(self.versions) if self.versions else NAN


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
