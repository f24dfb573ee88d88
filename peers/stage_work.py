"""A stage peer's forward and backward work: compute in ready-queue order, hops by readiness.

A forward request carries a microbatch. The stage queues its forward on the compute thread
(`schedule.runtime`), then sends the output to the replica of the next stage it expects to
finish soonest (`schedule.routing`), and waits for that call's reply: the gradient of its
output. It queues the backward and replies upstream with the gradient of its input. The last
stage runs forward, loss and backward as one task. Gradients come back along the open calls.

Failures are states, not crashes. A hop that times out, breaks, or is refused by a draining
peer bans that replica (capped exponential backoff) and the stage replays the microbatch from
the output it still holds to another replica: the nearest upstream peer that holds the work's
input replays it. A replay is marked, so replicas keep its parameter gradient apart until the
commit decides which copy counts (`schedule.accounting`). Each stage also keeps, until the
step commits, the input gradient it returned for each microbatch and the input it came from:
when an upstream replica dies mid-backward and the microbatch is replayed to a sibling, an
identical input is answered from this cache, so the backward is replayed from the nearest
peer that still holds its input instead of recomputing the rest of the pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError
from swarmtrain.schedule import Task
from swarmtrain.transport import handler_name
from swarmtrain.wire.frames import Frame

if TYPE_CHECKING:
    from swarmtrain.peers.stage import StagePeer

logger = logging.getLogger(__name__)

HOP_MARGIN_S = 0.5
"""Time a stage keeps for itself when it passes the remaining budget downstream."""
NO_REPLICA_WAIT_S = 0.25
"""How long a hop waits before looking again when every replica downstream is banned or gone."""


@dataclass
class _Cached:
    x: torch.Tensor
    loss: float
    grad: torch.Tensor | None
    route: str


def readiness_meta(ready: dict) -> dict:
    """Readiness as reply meta (short keys: it rides on every reply)."""
    return {"r_backlog": ready["backlog_s"], "r_service": ready["service_s"], "r_queue": ready["queue_depth"]}


class StageWork:
    """Serves forward requests for one StagePeer (see the module docstring)."""

    def __init__(self, peer: StagePeer):
        self.peer = peer
        self._cache: dict[str, _Cached] = {}
        self._cache_step = -1
        self.replayed = 0
        self.cache_hits = 0

    def clear_cache(self) -> None:
        self._cache.clear()

    async def on_forward(self, frame: Frame, caller: str) -> Frame:
        peer = self.peer
        runner, manifest = peer.runner, peer.manifest
        started = time.monotonic()
        x, targets = frame.tensors.get("x"), {k: t for k, t in frame.tensors.items() if k != "x"}
        if x is None:
            raise BadFrameError("a forward frame needs tensor 'x' and the loss inputs")
        runner.check_inputs(x, targets)
        meta = frame.meta
        loss_scale, budget_s, order = meta.get("loss_scale"), meta.get("budget_s"), meta.get("order", 0)
        replay = meta.get("replay", False)
        if not isinstance(loss_scale, float) or not 0 < loss_scale <= 1:
            raise BadFrameError(f"meta loss_scale must be a float in (0, 1], got {loss_scale!r}")
        if not isinstance(budget_s, (int, float)) or budget_s <= 0:
            raise BadFrameError(f"meta budget_s must be a positive number, got {budget_s!r}")
        if not isinstance(order, int) or order < 0 or not isinstance(replay, bool):
            raise BadFrameError("meta order must be an int >= 0 and replay a bool")
        if frame.step != runner.step:
            if runner.from_seed and runner.num_pending == 0 and not runner.has_gradients:
                runner.step = frame.step  # a stage nobody served starts from the seed at the run's step
            else:
                if frame.step > runner.step:
                    peer.resync_soon()
                raise RemoteError(
                    f"stage {peer.stage} is at step {runner.step}, not {frame.step}", retryable=True
                )
        if self._cache_step != frame.step:
            self._cache.clear()
            self._cache_step = frame.step
        peer.expect_static(frame)
        mb, deadline = frame.mb_id, started + budget_s
        # The cache may answer only when no stage from here on lacks the work (a commit's
        # repair names the stages that lost it with a dead replica: they must recompute).
        needed_by = [int(k) for k in str(meta.get("needed_by", "")).split() if k.isdigit()]
        usable = replay and all(k < peer.stage for k in needed_by)
        cached = self._cache.get(mb) if usable else None
        if cached is not None and cached.x.shape == x.shape and torch.equal(cached.x, x):
            self.cache_hits += 1
            loss, grad_x, route, replays = cached.loss, cached.grad, cached.route, 0
        else:
            try:
                loss, grad_x, route, replays = await self._compute(frame, x, targets, deadline)
            except (RuntimeError, IndexError, ValueError) as e:  # the model refused this input
                raise BadFrameError(f"forward/backward failed on this input: {e}") from None
            self._cache[mb] = _Cached(x=x, loss=loss, grad=grad_x, route=route)
        tensors, codecs = {}, {}
        if grad_x is not None:
            tensors["grad"] = grad_x
            codec = peer.codec_for("gradients", caller, grad_x.nbytes)
            if codec != "none":
                codecs["grad"] = codec
        reply_meta = {
            "loss": loss,
            "route": route,
            "replays": replays,
            "service_s": time.monotonic() - started,
        }
        reply_meta.update(readiness_meta(peer.scheduler.readiness()))
        return Frame(
            kind="result",
            run_id=manifest.run_id,
            mb_id=mb,
            stage=peer.stage,
            step=frame.step,
            tensors=tensors,
            codecs=codecs,
            meta=reply_meta,
        )

    async def _compute(self, frame: Frame, x, targets, deadline: float):
        """(loss, input gradient, route from here on, replays downstream) for one microbatch."""
        peer, mb = self.peer, frame.mb_id
        runner, sched = peer.runner, peer.scheduler
        replay, order = frame.meta.get("replay", False), frame.meta.get("order", 0)
        task = Task(kind="loss", mb_id=mb, step=frame.step, order=order)
        if peer.stage == peer.manifest.num_stages - 1:
            fn = partial(runner.forward_loss_backward, replay=replay)
            loss, grad_x = await sched.run(task, fn, mb, x, targets, frame.meta["loss_scale"])
            return loss, grad_x, peer.peer_id, 0
        out = await sched.run(
            Task(kind="forward", mb_id=mb, step=frame.step, order=order), runner.forward, mb, x
        )
        try:
            reply, replays = await self._hop(frame, out, targets, deadline)
            grad_x = await sched.run(
                Task(kind="backward", mb_id=mb, step=frame.step, order=order),
                partial(runner.backward, replay=replay),
                mb,
                reply.tensors["grad"],
            )
        finally:
            runner.drop(mb)
            sched.wake()
        route = f"{peer.peer_id} {reply.meta.get('route', '')}"
        return reply.meta["loss"], grad_x, route, replays + int(reply.meta.get("replays", 0))

    async def _hop(self, frame: Frame, out: torch.Tensor, targets, deadline: float) -> tuple[Frame, int]:
        """Send the output on to a replica of the next stage, replaying to another on failure.

        Returns (the reply, how many replays it took). Raises RemoteError when the downstream
        refused the microbatch itself (not retryable) or no replica answered within the budget.
        """
        peer = self.peer
        nxt = peer.stage + 1
        prefer = str(frame.meta.get("prefer", "")).split()
        preferred = prefer[nxt] if len(prefer) > nxt and prefer[nxt] != "-" else None
        replays, last_error = 0, "no replica of the next stage was found"
        while True:
            remaining = deadline - time.monotonic() - HOP_MARGIN_S
            if remaining <= 0:
                raise RemoteError(
                    f"stage {nxt} did not complete microbatch {frame.mb_id} in time ({last_error})",
                    retryable=True,
                )
            target = peer.choose_replica(
                nxt, order=frame.meta.get("order", 0), nbytes=out.nbytes, prefer=preferred
            )
            if target is None:
                await peer.refresh_replicas(wait_s=min(NO_REPLICA_WAIT_S, remaining))
                continue
            codec = peer.codec_for("activations", target, out.nbytes)
            request = Frame(
                kind="forward",
                run_id=frame.run_id,
                mb_id=frame.mb_id,
                stage=nxt,
                step=frame.step,
                tensors={"x": out, **targets},
                codecs={} if codec == "none" else {"x": codec},
                meta=dict(
                    frame.meta, budget_s=remaining, replay=bool(frame.meta.get("replay")) or replays > 0
                ),
            )
            peer.router.sent(target, time.monotonic())
            try:
                reply = await peer.transport.call(
                    target, handler_name(frame.run_id), request, timeout_s=remaining
                )
                grad, loss = reply.tensors.get("grad"), reply.meta.get("loss")
                if grad is None or not isinstance(loss, float):
                    raise BadFrameError("the reply lacks a gradient or a loss")
            except RemoteError as e:
                peer.router.done(target, time.monotonic(), ok=not e.retryable)
                if not e.retryable:
                    raise RemoteError(str(e), retryable=False) from None
                last_error = f"{target[-8:]}: {e}"
            except (PeerUnreachableError, BadFrameError) as e:
                if isinstance(e, BadFrameError):  # the downstream peer's fault, not our caller's
                    peer.transport.strike(target, str(e))
                peer.router.done(target, time.monotonic(), ok=False)
                last_error = f"{target[-8:]}: {e}"
            else:
                now = time.monotonic()
                peer.router.done(target, now, ok=True)
                peer.router.report(
                    target,
                    backlog_s=float(reply.meta.get("r_backlog", 0.0)),
                    service_s=float(reply.meta.get("r_service", 0.0)),
                    now=now,
                )
                return reply, replays
            replays += 1
            self.replayed += 1
            preferred = None
            logger.info(
                "replaying microbatch %s to another replica of stage %d: %s", frame.mb_id, nxt, last_error
            )
            await asyncio.sleep(0)
