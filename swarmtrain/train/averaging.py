"""Exact gradient sums among the replicas of one stage.

At a step boundary every replica of a stage sends its local gradient sum to every other
replica of the group, then each adds the group's gradients up in the same order (sorted
peer ids). Every replica performs the very same float operations on the very same
inputs, so replicas that start equal stay bit-identical.

hivemind's DecentralizedAverager was the first choice and is not used for this: its
all-reduce returns deltas that each peer adds to its own tensor (local + (mean - local)),
which leaves replicas a few ulps apart; steps amplify that, and "identical after every
step" no longer holds. The all-gather costs (R - 1) gradient copies per replica a step,
against 2 (R - 1) / R for an all-reduce: the same for 2 replicas, more for many.
"""

from __future__ import annotations

import asyncio

import torch

from swarmtrain.errors import BadFrameError, Cause, RemoteError

Key = tuple[int, int]
"""(step, attempt): one try at a step's exchange."""


class GradientInbox:
    """Gradients received from other replicas, by (key, sender), until the step is summed."""

    def __init__(self):
        self._received: dict[tuple[Key, str], list[torch.Tensor]] = {}
        self._refused: dict[tuple[Key, str], str] = {}
        """(key, sender) -> why its gradients were refused."""
        self._arrived = asyncio.Condition()

    async def refuse(self, step: Key, sender: str, reason: str) -> None:
        """`sender`'s gradients of `step` were refused: a `take` of `step` that needs them fails."""
        async with self._arrived:
            self._refused[(step, sender)] = reason
            self._arrived.notify_all()

    async def put(self, step: Key, sender: str, grads: list[torch.Tensor], like: list[torch.Tensor]) -> None:
        """Store `sender`'s gradients of `step`; BadFrameError unless they match `like`'s shapes."""
        check_like(sender, grads, like)
        async with self._arrived:
            self._received[(step, sender)] = grads
            self._arrived.notify_all()

    async def take(self, step: Key, senders: list[str], timeout_s: float) -> dict[str, list[torch.Tensor]]:
        """Wait for the gradients of `step` from every one of `senders`; RemoteError (retryable)
        on timeout, or at once when one of them had its gradients of this step refused."""

        def refused() -> list[str]:
            return [f"{s[-8:]} ({why})" for s in senders if (why := self._refused.get((step, s)))]

        def ready() -> bool:
            return all((step, s) in self._received for s in senders) or bool(refused())

        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(ready), timeout_s)
                if refused():
                    raise RemoteError(
                        f"this replica refused the gradients of step {step[0]} from replica(s) "
                        f"{', '.join(refused())}: plan the commit again",
                        cause=Cause.REFUSED,
                        retryable=True,
                    )
            except asyncio.TimeoutError:
                missing = [s[-8:] for s in senders if (step, s) not in self._received]
                raise RemoteError(
                    f"gradients of step {step} did not arrive from replica(s) {', '.join(missing)} in {timeout_s:.0f} s",
                    retryable=True,
                ) from None
            out = {s: self._received[(step, s)] for s in senders}
            for key in [k for k in self._received if k[0] <= step]:
                del self._received[key]
            for key in [k for k in self._refused if k[0] <= step]:
                del self._refused[key]
            return out


def check_like(sender: str, grads: list[torch.Tensor], like: list[torch.Tensor]) -> None:
    """BadFrameError unless `sender`'s `grads` match `like`'s shapes and dtypes, in order."""
    if len(grads) != len(like) or any(g.shape != p.shape or g.dtype != p.dtype for g, p in zip(grads, like)):
        raise BadFrameError(f"gradients from {sender[-8:]} do not match this stage's parameters")


def group_sum(
    mine: str, local: list[torch.Tensor], received: dict[str, list[torch.Tensor]]
) -> list[torch.Tensor]:
    """Sum of every replica's gradients, added in sorted peer-id order (the same on every replica)."""
    grads = {mine: local, **received}
    order = sorted(grads)
    total = [g.detach().cpu().clone() for g in grads[order[0]]]
    for peer in order[1:]:
        for t, g in zip(total, grads[peer]):
            t.add_(g)
    return total
