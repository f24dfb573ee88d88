"""A stage peer's side of the step commit: prepare, exchange, apply (and abort).

The trainer drives every stage's replicas through the commit together (`peers/trainer_step.py`):

1. prepare: a replica reports which microbatches' gradients are in its buffer ("fresh")
   and which replays it holds apart ("held"), and accepts gradients again.
2. exchange (once every stage's microbatches are each accounted for exactly once): the
   replica checks its buffer still holds exactly what it reported, closes the step, folds
   in the held copies the plan gives it, and swaps its gradient sum with the other replicas
   of its stage (`swarmtrain.train.averaging`). The group's total is kept aside, not yet
   applied: if a replica dies now, the trainer plans again and nothing is double counted.
3. apply (only once every stage has exchanged): write the total, step the optimizer. Every
   replica adds the same tensors in the same order, so replicas stay bit-identical; with
   `digest` the reply carries a hash of the parameters to prove it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch

from swarmtrain.compress.exchange import compress_for_exchange
from swarmtrain.compress.feedback import ErrorFeedback
from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError
from swarmtrain.train.averaging import GradientInbox, group_sum
from swarmtrain.transport import handler_name
from swarmtrain.wire.frames import Frame, error_frame

if TYPE_CHECKING:
    from swarmtrain.peers.stage import StagePeer

EXCHANGE_TIMEOUT_S = 30.0


def _ids(value) -> list[str]:
    if not isinstance(value, str):
        raise BadFrameError("commit meta lists must be space-separated strings")
    return value.split()


class StageCommit:
    """The commit protocol of one StagePeer (see the module docstring)."""

    def __init__(self, peer: StagePeer):
        self.peer = peer
        self.inbox = GradientInbox()
        self.feedback = ErrorFeedback()
        self._total: tuple[int, list[torch.Tensor] | None] | None = None
        """(step, the group's gradient total or None for a replica alone) once exchanged."""

    def reset(self) -> None:
        self.inbox = GradientInbox()
        self._total = None
        self.feedback = ErrorFeedback()
        """Error-feedback residuals of the averaging codec, per parameter."""

    @property
    def exchanged(self) -> bool:
        return self._total is not None and self._total[0] == self.peer.runner.step

    def _done(self, step: int, **meta) -> Frame:
        p = self.peer
        return Frame(kind="step_done", run_id=p.manifest.run_id, stage=p.stage, step=step, meta=meta)

    async def on_step(self, frame: Frame) -> Frame:
        p = self.peer
        runner, run_id = p.runner, p.manifest.run_id
        phase = frame.meta.get("phase")
        try:
            if phase == "prepare":
                await p.scheduler.call(runner.reopen)
                self._total = None
                fresh, held = runner.report()
                return self._done(runner.step, fresh=" ".join(sorted(fresh)), held=" ".join(sorted(held)))
            if phase == "abort":
                await p.scheduler.call(runner.discard_step)
                self._total = None
                p.work.clear_cache()
                return self._done(runner.step)
            if phase == "exchange":
                return await self._on_exchange(frame)
            if phase == "apply":
                return await self._on_apply(frame)
        except RemoteError as e:
            return error_frame(run_id, f"stage {p.stage}: {e}", retryable=e.retryable, stage=p.stage)
        return error_frame(run_id, f"unknown commit phase {phase!r}", retryable=False, stage=p.stage)

    async def _on_exchange(self, frame: Frame) -> Frame:
        p = self.peer
        runner = p.runner
        fresh, take, group = (_ids(frame.meta.get(k, "")) for k in ("fresh", "take", "group"))
        attempt = frame.meta.get("attempt", 0)
        if p.peer_id not in group or not isinstance(attempt, int):
            raise BadFrameError("an exchange names a group with this peer in it and an int attempt")
        self._total = None
        await p.scheduler.call(lambda: runner.fold(frame.step, fresh=set(fresh), take=take))
        others = [q for q in group if q != p.peer_id]
        total = await self._exchange(frame.step, attempt, others) if others else None
        self._total = (frame.step, total)
        return self._done(runner.step)

    async def _on_apply(self, frame: Frame) -> Frame:
        p = self.peer
        runner = p.runner
        scale = frame.meta.get("grad_scale", 1.0)
        if not isinstance(scale, float) or not 0 < scale <= 1e3:
            raise BadFrameError(f"grad_scale must be a positive float, got {scale!r}")
        if runner.step == frame.step + 1 and not runner.has_gradients:
            pass  # applied already; only the reply was lost
        elif self._total is None or self._total[0] != frame.step:
            raise RemoteError(f"step {frame.step} was not exchanged on this replica", retryable=False)
        else:
            total = self._total[1]
            await p.scheduler.call(lambda: runner.apply_step(frame.step, total, grad_scale=scale))
            self._total = None
            p.work.clear_cache()
            p.heartbeat_soon()  # routing sees the new step now
        meta = {}
        if frame.meta.get("digest"):
            meta["digest"] = await p.scheduler.call(runner.param_digest)
        return self._done(runner.step, **meta)

    async def _exchange(self, step: int, attempt: int, others: list[str]) -> list[torch.Tensor]:
        """Send this replica's gradient sum to `others`, take theirs; returns the group's total."""
        p = self.peer
        grads = p.runner.grads()
        codec = p.codec_for("averaging", others[0], sum(g.nbytes for g in grads))
        feedback = self.feedback if p.manifest.compression.error_feedback else None
        # Every replica adds, for itself too, what the others decode from its frame: the sums
        # stay bit-identical whatever the codec (swarmtrain.compress.exchange).
        sent, local = await p.scheduler.call(lambda: compress_for_exchange(grads, codec, feedback))
        frame = Frame(
            kind="grads",
            run_id=p.manifest.run_id,
            stage=p.stage,
            step=step,
            tensors=sent,
            meta={"attempt": attempt},
        )
        name = handler_name(p.manifest.run_id)
        sends = [p.transport.call(q, name, frame, timeout_s=EXCHANGE_TIMEOUT_S) for q in others]
        results = await asyncio.gather(
            *sends, self.inbox.take((step, attempt), others, EXCHANGE_TIMEOUT_S), return_exceptions=True
        )
        for result in results:
            if isinstance(result, (RemoteError, PeerUnreachableError, BadFrameError)):
                raise RemoteError(f"gradient exchange failed: {result}", retryable=True)
            if isinstance(result, BaseException):
                raise result
        return group_sum(p.peer_id, local, results[-1])

    async def on_grads(self, frame: Frame, sender: str) -> Frame:
        p = self.peer
        if frame.step != p.runner.step:
            return error_frame(
                p.manifest.run_id,
                f"stage {p.stage} is at step {p.runner.step}, not {frame.step}",
                retryable=True,
            )
        attempt = frame.meta.get("attempt", 0)
        grads = [frame.tensors.get(str(i)) for i in range(len(frame.tensors))]
        if any(g is None for g in grads) or not isinstance(attempt, int):
            raise BadFrameError("a grads frame names its tensors 0..N-1 and carries an int attempt")
        await self.inbox.put((frame.step, attempt), sender, grads, p.runner.grads())
        return Frame(kind="result", run_id=p.manifest.run_id, stage=p.stage, step=frame.step)
