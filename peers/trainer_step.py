"""One optimizer step, driven by the trainer: send every microbatch, then commit every stage.

Flow. At most `window` microbatches are in flight. Each goes to the stage-0 replica the
router expects to finish it first (static schedule: round-robin, with the whole route
fixed); stages chain it on, replaying failed hops themselves. A call that fails here bans
that replica and the microbatch is replayed (marked as a replay) from the trainer, which
holds its input. Every microbatch ends completed or dropped with a cause (`StepLedger`).

Commit (`peers/stage_commit.py` is the replicas' side), in rounds until it goes through:
prepare every live replica of every stage; plan each stage so every completed microbatch
counts exactly once (`plan_stage_commit`); replay what no live replica holds (a replica
died with it), steering each stage to the replica that already has the work; discard a
stage whose buffers cannot be made exact and replay its microbatches; exchange gradients
within each stage; once every stage has exchanged, apply everywhere. Nothing is applied
before every stage can apply, so a death anywhere before that costs a replay, not data.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError, SwarmError
from swarmtrain.schedule import ReplicaReport, StepLedger, plan_stage_commit
from swarmtrain.wire.frames import Frame

if TYPE_CHECKING:
    from swarmtrain.peers.trainer import StepResult, Trainer

logger = logging.getLogger(__name__)

_epochs = itertools.count()
PREPARE_TIMEOUT_S = 10.0
"""Prepare, apply and abort are bookkeeping on the replica: a replica silent this long is gone."""
COMMIT_TIMEOUT_S = 60.0
"""The exchange moves a stage's gradients between its replicas."""


class StepFailedError(SwarmError):
    """A step could not complete; the message says which microbatch or stage and why."""


class Step:
    """One optimizer step (see the module docstring); `await run()` returns its StepResult."""

    def __init__(self, trainer: Trainer, microbatches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.t = trainer
        self.microbatches = microbatches
        self.step = trainer.step
        self.num_stages = trainer.manifest.num_stages
        epoch = next(_epochs)
        self.ids = [f"{trainer.trainer_id}:{self.step}.{epoch}:{n}" for n in range(len(microbatches))]
        self.ledger = StepLedger(issued=tuple(self.ids))
        self.timeouts = 0
        self.run_id = trainer.manifest.run_id

    # flow

    async def _send(
        self, n: int, *, replay: bool, prefer: list[str] | None, needed_by: tuple[int, ...] = ()
    ) -> None:
        """Get microbatch `n` through the pipeline once; record its loss and route."""
        t, mb = self.t, self.ids[n]
        x, y = self.microbatches[n]
        cfg, static = t.config, t.manifest.schedule == "static"
        deadline = time.monotonic() + cfg.microbatch_timeout_s * (cfg.max_retries + 1)
        attempt, last = 0, "no replica of stage 0 was found"
        while attempt <= cfg.max_retries:
            if time.monotonic() > deadline:
                break
            replicas = await t.replicas()
            meta = {
                "loss_scale": 1.0 / len(self.microbatches),
                "budget_s": cfg.microbatch_timeout_s,
                "order": n,
                "replay": replay or attempt > 0,
            }
            route = prefer
            if static and route is None:
                slots, route = [], []
                for k in range(self.num_stages):
                    ranked = sorted(replicas.get(k, [])) or ["-"]
                    slots.append(f"{n % len(ranked)}/{len(ranked)}")
                    route.append(ranked[n % len(ranked)])
                meta |= {"slots": " ".join(slots), "microbatches": len(self.microbatches)}
            if route is not None:
                meta["prefer"] = " ".join(route)
            if needed_by:
                meta["needed_by"] = " ".join(map(str, needed_by))
            target = t.router.choose(
                replicas.get(0, []), time.monotonic(), order=n, prefer=(route or [None])[0]
            )
            if target is None:
                await t.refresh_replicas(wait=True)
                continue
            frame = Frame(
                kind="forward", run_id=self.run_id, mb_id=mb, stage=0, step=self.step,
                tensors={"x": x, "targets": y}, meta=meta,
            )  # fmt: skip
            t.router.sent(target, time.monotonic())
            try:
                reply = await t.transport.call(target, t.handler, frame, timeout_s=cfg.microbatch_timeout_s)
                loss = reply.meta.get("loss")
                route_taken = tuple(str(reply.meta.get("route", "")).split())
                if not isinstance(loss, float) or len(route_taken) != self.num_stages:
                    raise BadFrameError("stage 0 replied without a loss or a full route")
            except RemoteError as e:
                t.router.done(target, time.monotonic(), ok=not e.retryable)
                if not e.retryable:
                    if self._may_drop():
                        self.ledger.drop(mb, str(e))
                        return
                    raise StepFailedError(f"step {self.step}, microbatch {n}: {e}") from None
                last, cause = str(e), "refused" if "leaving" in str(e) else "downstream failure"
            except (PeerUnreachableError, BadFrameError) as e:
                t.router.done(target, time.monotonic(), ok=False)
                last = str(e)
                cause = "timeout" if "did not answer" in last else "peer unreachable"
                self.timeouts += cause == "timeout"
            else:
                now = time.monotonic()
                t.router.done(target, now, ok=True)
                backlog, service = reply.meta.get("r_backlog", 0.0), reply.meta.get("r_service", 0.0)
                t.router.report(target, backlog_s=float(backlog), service_s=float(service), now=now)
                self.ledger.complete(mb, loss, route_taken)
                replays = int(reply.meta.get("replays", 0))
                self.ledger.replay("hop failure (replayed by a stage)", replays)
                return
            attempt += 1
            self.ledger.replay(cause)
            logger.warning("replaying microbatch %d of step %d: %s", n, self.step, last)
        raise StepFailedError(f"step {self.step}, microbatch {n} failed {attempt} times, last: {last}")

    def _may_drop(self) -> bool:
        allowed = int(self.t.config.max_dropped_fraction * len(self.ids))
        return len(self.ledger.dropped) < allowed

    async def _all(self, jobs) -> None:
        tasks = [asyncio.create_task(job) for job in jobs]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _flow(self) -> None:
        window = asyncio.Semaphore(self.t.window.size)

        async def one(n: int) -> None:
            async with window:
                await self._send(n, replay=False, prefer=None)

        await self._all(one(n) for n in range(len(self.microbatches)))

    # commit

    async def _call_stage(self, peer: str, stage: int, phase: str, **meta) -> Frame:
        frame = Frame(
            kind="step", run_id=self.run_id, stage=stage, step=self.step, meta={"phase": phase, **meta}
        )
        return await self.t.transport.call(peer, self.t.handler, frame, timeout_s=60)

    async def _prepare(self) -> dict[int, list[ReplicaReport]]:
        """Every reachable replica of every stage at this step, with what it holds."""
        replicas = await self.t.replicas(refresh=True)
        now = time.monotonic()
        groups = {  # a replica that just failed us is left out: it is most likely dead
            k: {
                p
                for p in set(replicas.get(k, [])) | self.ledger.routed_to(k)
                if not self.t.router.bans.is_banned(p, now)
            }
            for k in range(self.num_stages)
        }
        reports: dict[int, list[ReplicaReport]] = {k: [] for k in range(self.num_stages)}

        async def ask(k: int, peer: str) -> None:
            try:
                reply = await self._call_stage(peer, k, "prepare")
            except (RemoteError, PeerUnreachableError, BadFrameError) as e:
                self.t.router.done(peer, time.monotonic(), ok=False)
                logger.info("stage %d replica %s left the commit: %s", k, peer[-8:], e)
                return
            if reply.step == self.step:
                fresh, held = (frozenset(str(reply.meta.get(key, "")).split()) for key in ("fresh", "held"))
                reports[k].append(ReplicaReport(peer=peer, fresh=fresh, held=held))

        await asyncio.gather(*(ask(k, p) for k, peers in groups.items() for p in peers))
        return reports

    async def _repair(self, missing: dict[int, set[str]], reports: dict[int, list[ReplicaReport]]) -> None:
        """Replay microbatches some stage lacks, each stage steered to the replica that has it."""
        lacking = sorted(set().union(*missing.values()))
        self.ledger.replay("lost with a replica (repaired at commit)", len(lacking))
        for mb in lacking:
            route = []
            for k in range(self.num_stages):
                holder = next((r.peer for r in reports[k] if mb in r.fresh or mb in r.held), "-")
                route.append(holder)
            n = self.ids.index(mb)
            del self.ledger.losses[mb]
            needed_by = tuple(k for k in sorted(missing) if mb in missing[k])
            await self._send(n, replay=True, prefer=route, needed_by=needed_by)

    async def _commit(self) -> None:
        completed = self.ledger.completed
        for attempt in range(self.t.config.max_retries + 3):
            if attempt:
                await asyncio.sleep(min(0.25 * 2**attempt, 2.0))
            reports = await self._prepare()
            empty = [k for k, rs in reports.items() if not rs]
            if empty:
                logger.warning("stage(s) %s have no live replica at step %d: waiting", empty, self.step)
                await self.t.replicas(refresh=True, wait_for_all=True)
                continue
            plans = {k: plan_stage_commit(completed, rs) for k, rs in reports.items()}
            conflicted = [k for k, plan in plans.items() if plan.conflicts]
            if conflicted:
                logger.warning("stage(s) %s hold inexact gradients: discarding and replaying", conflicted)
                await asyncio.gather(
                    *(self._call_stage(r.peer, k, "abort") for k in conflicted for r in reports[k]),
                    return_exceptions=True,
                )
                continue
            missing = {k: set(plan.missing) for k, plan in plans.items() if plan.missing}
            if missing:
                logger.warning(
                    "commit of step %d: %s lost with a replica; replaying them",
                    self.step,
                    "; ".join(f"stage {k}: {len(v)} microbatches" for k, v in missing.items()),
                )

                await self._repair(missing, reports)
                continue

            calls = [
                self._call_stage(
                    r.peer,
                    k,
                    "exchange",
                    fresh=" ".join(plans[k].fresh[r.peer]),
                    take=" ".join(plans[k].take[r.peer]),
                    group=" ".join(sorted(q.peer for q in rs)),
                    attempt=attempt,
                )  # fmt: skip
                for k, rs in reports.items()
                for r in rs
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            errors = [e for e in results if isinstance(e, BaseException)]
            if errors:
                if any(isinstance(e, RemoteError) and not e.retryable for e in errors):
                    bad = next(e for e in errors if isinstance(e, RemoteError) and not e.retryable)
                    raise StepFailedError(f"step {self.step}: a stage refused to commit: {bad}")
                logger.warning(
                    "commit of step %d: exchange failed (%s); planning again", self.step, errors[0]
                )
                continue
            self.committed_by = {k: [r.peer for r in rs] for k, rs in reports.items()}
            await self._apply()
            return
        raise StepFailedError(f"step {self.step} could not be committed after {attempt + 1} rounds")

    async def _apply(self) -> None:
        """Every stage has exchanged: step every replica (a dead one is simply gone)."""
        dropped = len(self.ledger.dropped)
        scale = len(self.ids) / (len(self.ids) - dropped) if dropped else 1.0
        verify = self.t.config.verify_replicas
        self.digests: dict[int, dict[str, str]] = {k: {} for k in self.committed_by}

        async def apply(k: int, peer: str) -> None:
            for attempt in range(3):
                try:
                    reply = await self._call_stage(peer, k, "apply", grad_scale=float(scale), digest=verify)
                except PeerUnreachableError as e:
                    logger.warning(
                        "replica %s of stage %d did not apply step %d: %s", peer[-8:], k, self.step, e
                    )
                    await asyncio.sleep(0.5 * (attempt + 1))
                    continue
                except RemoteError as e:
                    logger.warning(
                        "replica %s of stage %d refused to apply step %d: %s", peer[-8:], k, self.step, e
                    )
                    return
                self.t.known_step[peer] = reply.step
                if verify:
                    self.digests[k][peer] = str(reply.meta.get("digest"))
                return

        await asyncio.gather(*(apply(k, p) for k, peers in self.committed_by.items() for p in peers))

    async def run(self) -> StepResult:
        from swarmtrain.peers.trainer import StepResult

        started = time.monotonic()
        await self._flow()
        if not self.ledger.losses:
            raise StepFailedError(f"step {self.step}: every microbatch was dropped: {self.ledger.dropped}")
        unaccounted = self.ledger.unaccounted()
        assert not unaccounted, f"microbatches {unaccounted} neither completed nor dropped"
        await self._commit()
        self.t.step = self.step + 1
        x0 = self.microbatches[0][0]
        done = [self.ids.index(mb) for mb in self.ledger.losses]
        samples = sum(self.microbatches[n][0].shape[0] for n in done)
        tokens = samples if x0.is_floating_point() else sum(self.microbatches[n][0].numel() for n in done)
        work = {k: dict(Counter(r[k] for r in self.ledger.routes.values())) for k in range(self.num_stages)}
        equal = None
        if self.t.config.verify_replicas:
            equal = all(len(set(d.values())) <= 1 for d in self.digests.values())
        return StepResult(
            step=self.step,
            loss=sum(self.ledger.losses.values()) / len(self.ledger.losses),
            samples=samples,
            tokens=tokens,
            seconds=time.monotonic() - started,
            replays=sum(self.ledger.replays.values()),
            dropped=len(self.ledger.dropped),
            completed=len(self.ledger.losses),
            replay_causes=dict(self.ledger.replays),
            dropped_causes=dict(Counter(self.ledger.dropped.values())),
            work=work,
            window=self.t.window.size,
            timeouts=self.timeouts,
            replicas_equal=equal,
        )


__all__ = ["Step", "StepFailedError"]
