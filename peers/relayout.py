"""A stage peer's side of a layout move: taking its stage in a new layout of the run, between
two steps, and serving its old stage's state to the peers that take its blocks.

The run gets a new layout (a new `RunManifest.layout_version`, with new stage bounds and who
serves which stage: its lead trainer re-plans it, `peers/trainer_layout.py`). At a step
boundary, with nothing in flight, the trainer sends every serving stage peer a `Relayout`.
Each peer then:
1. keeps a snapshot of its stage's state by swarm name (`StageRunner.export_named_state`),
   which it serves to the others until its next move;
2. takes the stage the layout gives it (or, if the layout leaves it out, the one the join
   rule gives it), and for each block of that stage the state of the old stage that held it:
   its own snapshot, or a named-state request (`StateRequest.layout`) to the peers of the run,
   the ones that held that stage first;
3. installs them (`import_named_state`, at the same step), announces its new stage and layout,
   and answers the trainer.
Nothing of the old layout is dropped before the peer holds the new one, so no block is ever
without a holder; a peer that cannot gather its blocks fails the move and keeps its old stage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from torch import Tensor

from swarmtrain.errors import BadFrameError, Cause, RemoteError
from swarmtrain.train.placement import choose_stage, stage_memory_figures, stages_that_fit
from swarmtrain.transport import handler_name
from swarmtrain.transport.in_turn import ask_in_turn
from swarmtrain.wire.frames import Frame, error_frame
from swarmtrain.wire.messages import StateRequest

logger = logging.getLogger(__name__)

STATE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class LayoutSnapshot:
    """A stage's state as it was when its peer moved to another layout."""

    layout: int
    stage: int
    step: int
    state: dict[str, Tensor]
    manifest: object
    """The run's manifest of that layout (`RunManifest`)."""


async def relayout(peer, step: int, layout: int) -> int:
    """Move `peer` (a serving StagePeer, idle at `step`) to layout `layout`; returns its stage
    there. RemoteError when the layout is not readable yet or a block's state cannot be had."""
    loop = asyncio.get_running_loop()
    old = peer.manifest
    if old.layout_version == layout:
        return peer.stage  # moved already (a repeated request)
    if layout < old.layout_version:
        return await _move_back(peer, step, layout)
    new = await loop.run_in_executor(None, peer.node.get_manifest, old.run_id)
    if new is None or new.layout_version != layout:
        have = "none" if new is None else new.layout_version
        raise RemoteError(
            f"asked to move to layout {layout}, but the run's manifest here has layout {have}",
            cause=Cause.OWN_FAILURE,
        )
    old_stage = peer.stage
    state = await peer.scheduler.call(peer.runner.export_named_state)
    peer.layout_snapshot = LayoutSnapshot(
        layout=old.layout_version, stage=old_stage, step=step, state=state, manifest=old
    )
    peer._faults.on("relayout")  # tests: die in the middle of a move
    records = await peer.node.peers_async(old.run_id)
    memory = await loop.run_in_executor(None, stage_memory_figures, new)
    fits = stages_that_fit(new, memory, peer.config.max_memory_bytes)
    stage = new.assignments.get(peer.peer_id)
    if stage is None or not fits[stage]:
        here = [r for r in records if r.layout == layout and r.peer_id != peer.peer_id]
        stage = choose_stage(new, here, fits, peer.capacity, peer_id=peer.peer_id)
    start, end = new.stage_span(stage)
    if stage == old_stage and (start, end) == old.stage_span(old_stage):  # nothing changes hands
        peer.manifest, peer._memory = new, memory
        return await _announce(peer, new, stage, old_stage, old.layout_version, step)
    merged: dict[str, Tensor] = {}
    for j in range(old.num_stages):
        a, b = old.stage_span(j)
        if b <= start or a >= end:
            continue
        merged |= state if j == old_stage else await _fetch(peer, records, old.layout_version, j, step)
    peer.manifest, peer._memory = new, memory
    peer._take_stage(stage)
    try:
        await peer.service.install_named_state(merged, step)
    except BadFrameError as e:
        raise RemoteError(
            f"the blocks gathered for stage {stage} do not fit: {e}", cause=Cause.OWN_FAILURE
        ) from None
    return await _announce(peer, new, stage, old_stage, old.layout_version, step)


async def _announce(peer, new, stage: int, old_stage: int, old_layout: int, step: int) -> int:
    """Tell the swarm (refresh routes, heartbeat) that `peer` serves `stage` of layout `new`."""
    peer.stage = stage
    await peer.refresh_replicas()
    await peer._heartbeat()
    start, end = new.stage_span(stage)
    logger.warning(
        "moved to layout %d at step %d: stage %d (blocks %d-%d), was stage %d of layout %d",
        new.layout_version, step, stage, start, end - 1, old_stage, old_layout,
    )  # fmt: skip
    return stage


async def _move_back(peer, step: int, layout: int) -> int:
    """A move that did not complete: take the stage of layout `layout` back from the snapshot
    this peer kept of it."""
    snap = peer.layout_snapshot
    if snap is None or snap.layout != layout or snap.step != step:
        raise RemoteError(
            f"asked back to layout {layout} at step {step}, but this peer holds no snapshot of it",
            cause=Cause.OWN_FAILURE,
        )
    loop = asyncio.get_running_loop()
    memory = await loop.run_in_executor(None, stage_memory_figures, snap.manifest)
    moved_from = peer.stage
    peer.manifest, peer._memory = snap.manifest, memory
    peer._take_stage(snap.stage)
    await peer.service.install_named_state(snap.state, step)
    return await _announce(peer, snap.manifest, snap.stage, moved_from, layout, step)


async def _fetch(peer, records, layout: int, stage: int, step: int) -> dict[str, Tensor]:
    """Stage `stage`'s state in layout `layout` at `step`, by name, from a peer that holds it:
    those whose record says they serve it first, then any other stage peer (one that moved
    already serves it from its snapshot)."""
    first = [r.peer_id for r in records if r.role == "stage" and r.layout == layout and r.stage == stage]
    rest = [r.peer_id for r in records if r.role == "stage" and r.peer_id not in first]
    order = [p for p in first + rest if p != peer.peer_id]
    meta = StateRequest(layout=layout).to_meta()
    request = Frame(kind="state", run_id=peer.manifest.run_id, stage=stage, step=step, meta=meta)

    async def take(_peer: str, reply: Frame) -> dict[str, Tensor]:
        if reply.step != step:
            raise BadFrameError(f"its state is of step {reply.step}, not {step}")
        return reply.tensors

    answer = await ask_in_turn(
        peer.transport,
        order,
        handler_name(peer.manifest.run_id),
        request,
        timeout_s=STATE_TIMEOUT_S,
        take=take,
    )
    if not answer.answered:
        raise RemoteError(
            f"no peer gave stage {stage}'s state of layout {layout} at step {step}", cause=Cause.OWN_FAILURE
        )
    return answer.value


def is_layout_state_request(frame: Frame) -> int | None:
    """The layout a 'state' frame asks a stage's named state of, None for any other frame."""
    if frame.kind != "state":
        return None
    try:
        return StateRequest.from_meta(frame.meta).layout
    except BadFrameError:
        return None  # the service answers it, with the error


async def serve_layout_state(peer, frame: Frame, caller: str, layout: int) -> Frame:
    """Answer a named-state request for stage `frame.stage` of layout `layout`: from the live
    stage if it is that one, else from the snapshot of the peer's last move. Only the run's
    stage peers may ask."""
    run_id = peer.manifest.run_id
    if caller not in peer._members:
        await peer.refresh_replicas()
    if caller not in peer._members:
        return error_frame(
            run_id, "only the run's stage peers read stage state for a layout move", cause=Cause.UNAUTHORIZED
        )
    snapshot = peer.layout_snapshot
    if peer.manifest.layout_version == layout and peer.stage == frame.stage:
        step, state = await peer.scheduler.call(lambda: (peer.runner.step, peer.runner.export_named_state()))
    elif snapshot is not None and (snapshot.layout, snapshot.stage) == (layout, frame.stage):
        step, state = snapshot.step, snapshot.state
    else:
        return error_frame(
            run_id,
            f"this peer holds no state of stage {frame.stage} in layout {layout}",
            cause=Cause.WRONG_STAGE,
        )
    return Frame(kind="state_data", run_id=run_id, stage=frame.stage, step=step, tensors=state)
