"""A stage peer's checkpoints: written every `checkpoint_every` steps, served to whoever may ask.

`StageCheckpointer.after_apply` runs once the replica applied a step. On a multiple of the run's
`checkpoint_every` it copies the stage's state on the compute thread (the only pause training
sees: a copy of parameters and optimizer state in memory), then writes it atomically on a
worker thread (`swarmtrain.train.checkpoint`) while the replica goes on computing, and keeps the
newest `keep`. The steps it holds go into the peer's record, so a peer that has to bring back a
stage nobody serves any more can find one; `state_at(step)` reads one back for a 'state'
request that names a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from torch import Tensor

from swarmtrain.train import checkpoint as ckpt
from swarmtrain.train.archive import read_meta, stage_init_state
from swarmtrain.trust.identity import data_dir
from swarmtrain.wire.records import MAX_CHECKPOINTS_LISTED, PeerRecord, RunManifest

logger = logging.getLogger(__name__)


def default_checkpoint_dir() -> Path:
    """Where a peer keeps checkpoints without --checkpoint-dir: `<data dir>/checkpoints`."""
    return data_dir() / "checkpoints"


@dataclass
class CheckpointStats:
    """What checkpointing cost this peer: the longest compute pause and the bytes per checkpoint."""

    written: int = 0
    last_bytes: int = 0
    longest_pause_s: float = 0.0
    last_write_s: float = 0.0
    failures: list[str] = field(default_factory=list)


class StageCheckpointer:
    """Checkpoints of one stage peer under `root` (see the module docstring)."""

    def __init__(self, root: Path | str, manifest: RunManifest, *, keep: int = 2):
        self.root = Path(root)
        self.manifest = manifest
        self.keep = max(1, keep)
        self.stats = CheckpointStats()
        self._writing: asyncio.Task | None = None

    def held(self, stage: int) -> tuple[int, ...]:
        """Steps of the whole checkpoints of `stage` on this peer's disk, newest last."""
        steps = ckpt.stage_checkpoint_steps(self.root, self.manifest.disk_key, stage)
        return tuple(steps[-MAX_CHECKPOINTS_LISTED:])

    def due(self, step: int) -> bool:
        every = self.manifest.checkpoint_every
        return every > 0 and step > 0 and step % every == 0

    def after_apply(self, runner, scheduler, stage: int, *, force: bool = False) -> None:
        """The replica applied a step: checkpoint it if due or `force` (in the background)."""
        writing = self._writing if self._writing is not None and not self._writing.done() else None
        if not (force or self.due(runner.step)) or (writing is not None and not force):
            return
        self._writing = asyncio.create_task(self._after(writing, runner, scheduler, stage))

    async def _after(self, writing: asyncio.Task | None, runner, scheduler, stage: int) -> None:
        if writing is not None:
            await asyncio.gather(writing, return_exceptions=True)
        await self.save(runner, scheduler, stage)

    async def save(self, runner, scheduler, stage: int) -> Path | None:
        """Copy the state on the compute thread, write it on a worker thread; the directory written."""
        t0 = time.perf_counter()
        step, state, names, digest = await scheduler.call(
            lambda: (runner.step, runner.export_state(), list(runner.named_params), runner.param_digest())
        )
        pause = time.perf_counter() - t0  # queued behind compute already running, and the copy
        self.stats.longest_pause_s = max(self.stats.longest_pause_s, pause)
        start, end = self.manifest.stage_span(stage)
        meta = {
            "blocks": [start, end],
            "num_blocks": self.manifest.num_blocks,
            "model": self.manifest.model,
            "model_config": dict(self.manifest.model_config),
            "optimizer": self.manifest.optimizer.to_dict(),
            "param_digest": digest,
        }
        t1 = time.perf_counter()
        try:
            where, written = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: ckpt.write_stage_checkpoint(
                    self.root,
                    run_id=self.manifest.disk_key,
                    stage=stage,
                    step=step,
                    state=state,
                    param_names=names,
                    meta=meta,
                ),
            )
            ckpt.prune_stage_checkpoints(self.root, self.manifest.disk_key, stage, self.keep)
        except OSError as e:  # a full disk must not stop training: say so and go on
            self.stats.failures.append(f"step {step}: {e}")
            logger.warning("could not write the checkpoint of stage %d at step %d: %s", stage, step, e)
            return None
        self.stats.last_write_s = time.perf_counter() - t1
        if written:
            self.stats.written += 1
            self.stats.last_bytes = written
            logger.info(
                "checkpointed stage %d at step %d: %d bytes in %s (copy %.1f ms, write %.1f ms)",
                stage, step, written, where, pause * 1e3, self.stats.last_write_s * 1e3,
            )  # fmt: skip
        return where

    def state_at(self, stage: int, step: int, param_names: list[str]) -> dict[str, Tensor] | None:
        """The state of checkpoint `step` of `stage`, as `import_state` takes it; None if not held."""
        if step not in self.held(stage):
            return None
        return ckpt.checkpoint_state(
            ckpt.read_stage_checkpoint(self.root, self.manifest.disk_key, stage, step), param_names
        )

    async def wait(self) -> None:
        """Let a checkpoint being written finish (before the peer leaves)."""
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)


def run_progressed(records: list[PeerRecord], committed: int | None, stage: int, *, start: int = 0) -> bool:
    """Whether the run is past its start (step `start`: 0, or the step a resumed run starts at):
    a trainer it authorizes committed a step from there, or a replica of another stage or a
    coordinator (it keeps the furthest committed step it saw) claims a step past it. A stage
    nobody serves is then lost, not new: starting it again would silently throw away what it
    learned. (A claim alone can only make a peer wait, visibly, never reset a stage.)"""
    if committed is not None and committed >= start:
        return True
    return any(
        ((r.role == "stage" and r.stage != stage) or r.role == "coordinator") and r.step > start
        for r in records
    )


def checkpoint_sources(
    records: list[PeerRecord], stage: int, local: tuple[int, ...], me: str
) -> list[tuple[int, str]]:
    """(step, holder) of every checkpoint of `stage` in the swarm, newest first, this peer's own
    (holder `me`) before another's of the same step. Stage peers hold their own stage's; an
    archivist (a coordinator) holds every stage of the steps it lists."""
    found = {(step, me) for step in local}
    for r in records:
        if r.peer_id != me and ((r.role == "stage" and r.stage == stage) or r.role == "coordinator"):
            found.update((step, r.peer_id) for step in r.checkpoints)
    return sorted(found, key=lambda s: (-s[0], s[1] != me, s[1]))


async def bring_back(peer, points) -> bool:
    """Nobody serves this stage. In a new run the seed's initialisation is its state; in a run
    past its start the stage was lost: it comes back from the newest checkpoint of it in the
    swarm, else waits in the 'lost' state (or starts again from the seed if the run allows)."""
    manifest, warned = peer.manifest, False
    run_id, init_from = manifest.run_id, manifest.init_from
    start = int(read_meta(init_from)["step"]) if init_from and manifest.resume else 0
    while not peer._stop.is_set():
        records = await peer.node.peers_async(run_id)
        local = peer.checkpoints.held(peer.stage)  # a checkpoint of it: the stage had trained
        progressed = run_progressed(records, peer._claims.committed(points), peer.stage, start=start)
        if not progressed and not (local and max(local) > start):
            if init_from is None:
                return False  # a new run: the seed's initialisation
            read = partial(
                stage_init_state, init_from, list(peer.runner.named_params), resume=manifest.resume
            )
            state, step = await asyncio.get_running_loop().run_in_executor(None, read)
            await peer.service.install_state(state, step)
            logger.info("stage %d starts from %s at step %d", peer.stage, init_from, step)
            return True
        for step, holder in checkpoint_sources(records, peer.stage, local, peer.peer_id):
            if holder == peer.peer_id:
                state = peer.checkpoints.state_at(peer.stage, step, list(peer.runner.named_params))
                await peer.service.install_state(state, step)
            elif await peer.service.take_state([holder], checkpoint=step) is None:
                continue
            logger.warning(
                "stage %d had no live replica: restored from the checkpoint of step %d (held by %s); "
                "the run goes back to that step",
                peer.stage,
                step,
                "this peer" if holder == peer.peer_id else holder,
            )
            peer.restored_from = step
            return True
        if peer.manifest.allow_reinit:
            logger.warning(
                "stage %d was lost and no checkpoint of it is in the swarm: starting it "
                "again from the run seed (the run allows it)",
                peer.stage,
            )
            return False
        if not warned:
            logger.warning(
                "stage %d of run %s lost its last replica and no checkpoint of it is in the swarm: "
                "waiting for one (start a peer that holds one, or restart the run with "
                "`coordinator --resume DIR` or --allow-reinit)",
                peer.stage,
                run_id,
            )
            peer.state, warned = "lost", True
        await peer._heartbeat()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(peer._stop.wait(), peer.config.heartbeat_s)
        points = await peer.node.trainer_points_async(run_id)
    return False
