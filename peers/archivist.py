"""The archivist: whole-run checkpoints, gathered from the stages' own (`coordinator --checkpoint-dir`).

Stage replicas checkpoint their own stage every `checkpoint_every` steps and announce the steps
they hold (`peers/checkpoints.py`). The archivist, run by the run's owner (its coordinator),
watches those announcements; once every stage holds a step it has not archived, it pulls each
stage's checkpoint of that step from a replica that holds it (a 'state' request naming the
checkpoint: the owner may read any stage) and writes them together as one run checkpoint
(`swarmtrain.train.archive`: safetensors + JSON, the manifest included), so the directory
resumes the run (`coordinator --resume DIR/RUN/INSTANCE/step-N`) and outlives every stage peer.

It also serves what it archived: a peer bringing back a stage nobody serves any more finds the
archivist's steps in its record and asks it, as it would ask a replica.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import threading
from pathlib import Path

from swarmtrain.errors import BadFrameError, Cause, RemoteError
from swarmtrain.model.param_names import stage_param_names
from swarmtrain.swarm import SwarmNode
from swarmtrain.train.archive import RUN_FORMAT, stage_init_state, write_model_dir
from swarmtrain.train.checkpoint import to_files
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.transport.in_turn import ask_in_turn
from swarmtrain.wire.frames import Frame, error_frame
from swarmtrain.wire.messages import StateRequest
from swarmtrain.wire.records import MAX_CHECKPOINTS_LISTED, RunManifest

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
FETCH_TIMEOUT_S = 120.0


def archive_dir(root: Path | str, disk_key: str, step: int) -> Path:
    """`root/RUN/INSTANCE/step-N` (`RunManifest.disk_key`)."""
    return Path(root) / disk_key / f"step-{step:08d}"


class Archivist:
    """Gather and serve whole-run checkpoints under `root` (see the module docstring)."""

    def __init__(
        self, node: SwarmNode, manifest: RunManifest, root: Path | str, *, keep: int = 2, every_s: float = 2.0
    ):
        self.node, self.manifest, self.root = node, manifest, Path(root)
        self.keep, self.every_s = max(1, keep), every_s
        self._names = [stage_param_names(manifest, k) for k in range(manifest.num_stages)]
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="archivist", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=60)
        self._task = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)

    def held(self) -> tuple[int, ...]:
        """Steps of the run checkpoints under `root`, newest last."""
        where = self.root / self.manifest.disk_key
        if not where.is_dir():
            return ()
        steps = sorted(int(m.group(1)) for d in where.iterdir() if (m := _STEP_DIR.match(d.name)))
        return tuple(steps[-MAX_CHECKPOINTS_LISTED:])

    async def _start(self) -> None:
        self.transport = TensorTransport(await self.node.p2p(), swarm_key=self.node.swarm_key)
        await self.transport.serve(handler_name(self.manifest.run_id), self._handle)

    async def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                await self.archive_once()
            except Exception as e:  # a peer leaving mid-pull, a full disk: try again later
                logger.warning("archiving failed: %r", e)
            await asyncio.sleep(self.every_s)

    async def archive_once(self) -> int | None:
        """Archive the newest step every stage holds and this archivist does not; the step, or None."""
        m = self.manifest
        records = await self.node.peers_async(m.run_id)
        holders = {k: {} for k in range(m.num_stages)}  # stage -> step -> peers
        for r in records:
            if r.role == "stage" and r.stage in holders:
                for step in r.checkpoints:
                    holders[r.stage].setdefault(step, []).append(r.peer_id)
        common = set.intersection(*(set(h) for h in holders.values())) - set(self.held())
        if not common or (self.held() and max(common) < max(self.held())):
            return None
        step = max(common)
        params, optimizer = {}, {}
        for k in range(m.num_stages):
            state = await self._fetch(k, step, holders[k][step])
            stage_params, stage_optim = to_files(state, self._names[k])
            params.update(stage_params)
            optimizer.update(stage_optim)
        meta = {
            "format": RUN_FORMAT,
            "run_id": m.run_id,
            "step": step,
            "model": m.model,
            "model_config": dict(m.model_config),
            "num_blocks": m.num_blocks,
            "loss": m.loss,
            "manifest": m.to_dict() | {"init_from": None, "resume": False},
        }
        where = await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: write_model_dir(
                archive_dir(self.root, m.disk_key, step), params=params, meta=meta, optimizer=optimizer
            ),
        )
        for old in self.held()[: -self.keep]:
            shutil.rmtree(archive_dir(self.root, m.disk_key, old), ignore_errors=True)
        logger.info("archived run %s at step %d in %s", m.run_id, step, where)
        return step

    async def _fetch(self, stage: int, step: int, peers: list[str]) -> dict:
        request = Frame(
            kind="state",
            run_id=self.manifest.run_id,
            stage=stage,
            meta=StateRequest(checkpoint=step).to_meta(),
        )
        answer = await ask_in_turn(
            self.transport, peers, handler_name(self.manifest.run_id), request, timeout_s=FETCH_TIMEOUT_S
        )
        if not answer.answered:
            raise RemoteError(
                f"no replica of stage {stage} gave its checkpoint of step {step}: {answer.reasons()}"
            )
        return answer.value.tensors

    # serving

    async def _handle(self, frame: Frame, caller: str) -> Frame:
        m = self.manifest
        if frame.run_id != m.run_id or frame.kind != "state" or not 0 <= frame.stage < m.num_stages:
            self.transport.strike(
                caller, f"a {frame.kind!r} frame for stage {frame.stage} of run {frame.run_id!r}"
            )
            return error_frame(
                m.run_id, "the archivist serves only checkpoints of its run's stages", cause=Cause.BAD_FRAME
            )
        try:
            step = StateRequest.from_meta(frame.meta).checkpoint
        except BadFrameError as e:
            self.transport.strike(caller, str(e))
            return error_frame(m.run_id, str(e), cause=Cause.BAD_FRAME)
        if not await self._may_read(caller, frame.stage):
            self.transport.strike(caller, "not a member of the stage")
            return error_frame(
                m.run_id,
                f"only members of stage {frame.stage} and the run's trainers may read its checkpoints",
                cause=Cause.UNAUTHORIZED,
            )
        if step is None or step not in self.held():
            return error_frame(
                m.run_id, f"the archivist holds no checkpoint of step {step}", cause=Cause.OWN_FAILURE
            )
        state = await asyncio.get_running_loop().run_in_executor(None, self._stage_state, frame.stage, step)
        return Frame(kind="state_data", run_id=m.run_id, stage=frame.stage, step=step, tensors=state)

    async def _may_read(self, caller: str, stage: int) -> bool:
        trainers = self.manifest.trainers
        if not trainers or caller in trainers:
            return True
        records = await self.node.peers_async(self.manifest.run_id)
        return any(r.peer_id == caller and r.role == "stage" and r.stage == stage for r in records)

    def _stage_state(self, stage: int, step: int) -> dict:
        where = archive_dir(self.root, self.manifest.disk_key, step)
        return stage_init_state(where, self._names[stage], resume=True)[0]

    def close(self) -> None:
        self._stop.set()
        self._task.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
