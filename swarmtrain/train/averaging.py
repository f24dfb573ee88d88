"""Gradient averaging among the replicas of one stage, over hivemind's DecentralizedAverager.

Every replica of stage k of a run joins averaging groups under one prefix. At a step
boundary each replica contributes its local gradient sum with weight 1; the group's mean
times the group size is the sum over all replicas, i.e. the gradient of the whole step.
All members receive the same reduced bytes, so replicas that start equal stay equal.

A group is accepted only if it has exactly the size the trainer announced: a partial
group (a replica died, or was slow to match) leaves every member's gradients untouched
and reports a retryable error, so no replica ever steps on a different gradient.
"""

from __future__ import annotations

import logging

import torch
from hivemind import DHT, DecentralizedAverager

from swarmtrain.errors import RemoteError

logger = logging.getLogger(__name__)

MATCHMAKING_S = 1.0
"""How long a replica waits for others to join its averaging group."""
REQUEST_TIMEOUT_S = 0.8
"""hivemind's per-request matchmaking timeout; kept below MATCHMAKING_S, as hivemind advises."""


def averaging_prefix(run_id: str, stage: int) -> str:
    """hivemind group prefix of a stage's replicas (hivemind forbids '.' in prefixes)."""
    return f"{run_id.replace('.', '_')}_stage{stage}_grads"


class ReplicaAverager:
    """Average gradient buffers with the other replicas of a stage. Create in the main thread."""

    def __init__(self, dht: DHT, run_id: str, stage: int, like: list[torch.Tensor]):
        self.prefix = averaging_prefix(run_id, stage)
        self._averager = DecentralizedAverager(
            [torch.zeros_like(t, device="cpu") for t in like],
            dht,
            prefix=self.prefix,
            min_group_size=2,
            min_matchmaking_time=MATCHMAKING_S,
            request_timeout=REQUEST_TIMEOUT_S,
            start=True,
        )
        self.peer_id = dht.peer_id.to_base58()
        self.rounds = 0

    def sum_over_group(
        self, grads: list[torch.Tensor], *, group_size: int, step: int, timeout_s: float
    ) -> None:
        """Replace `grads` in place by their sum over a group of exactly `group_size` replicas.

        Raises RemoteError (retryable) when no such group forms within `timeout_s`; `grads`
        are then unchanged.
        """
        if group_size <= 1:
            return
        with self._averager.get_tensors() as buffers:
            for buf, g in zip(buffers, grads):
                buf.copy_(g.detach().cpu())
        try:
            gathered = self._averager.step(weight=1.0, gather=step, timeout=timeout_s, allow_retries=False)
        except Exception as e:
            raise RemoteError(f"gradient averaging failed: {e!r}", retryable=True) from None
        if gathered is None:
            raise RemoteError(
                f"no averaging group of {group_size} replicas formed in {timeout_s:.0f} s", retryable=True
            )
        if len(gathered) != group_size or set(gathered.values()) != {step}:
            raise RemoteError(
                f"averaging group had {len(gathered)} replicas at steps {sorted(set(gathered.values()))}, "
                f"expected {group_size} at step {step}",
                retryable=True,
            )
        with self._averager.get_tensors() as buffers:
            for buf, g in zip(buffers, grads):
                g.copy_(buf.to(g.device)).mul_(group_size)
        self.rounds += 1

    def shutdown(self) -> None:
        self._averager.shutdown()
