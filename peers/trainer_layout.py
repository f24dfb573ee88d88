"""A trainer's side of a layout move: between two steps, it moves the swarm to the run's newest
layout (`RunManifest.layout_version`, which the owner publishes: `coordinator --replan`).

Before each step (reading the manifest at most every LAYOUT_CHECK_S), a trainer that finds a
newer layout than the one it trains on sends every serving stage peer of its layout a
`Relayout` for that step, with nothing in flight, and waits for them all
(`peers/relayout.py` is their side). The move succeeded when every stage of the new layout
has a peer that answered; the trainer then trains on the new layout from the same step. When
a stage of the new layout is left without a peer (its peers failed the move, or died), the
move is undone: the peers that moved take their old stage back from the snapshot they kept
(the others never left it), and the trainer goes on with the old layout and does not try that
version again; the owner then publishes the layout the swarm is on as the next version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import Relayout

logger = logging.getLogger(__name__)

LAYOUT_CHECK_S = 2.0
"""Most often a trainer reads the run's manifest for a newer layout."""
RELAYOUT_TIMEOUT_S = 120.0
"""How long a stage peer may take to move (it downloads its new blocks' state)."""


async def follow_layout(trainer, *, force: bool = False) -> float | None:
    """Move the swarm to the run's newest layout where its stage peers serve an older one; the
    seconds the move paused training, None when there was none to make (or it was undone).
    Reads the manifest at most every LAYOUT_CHECK_S unless `force`."""
    now = time.monotonic()
    if not force and now - getattr(trainer, "_layout_checked", -1e9) < LAYOUT_CHECK_S:
        return None
    trainer._layout_checked = now
    run_id = trainer.manifest.run_id
    new = await asyncio.get_running_loop().run_in_executor(None, trainer.node.get_manifest, run_id)
    if new is None or new.layout_version < trainer.manifest.layout_version:
        return None
    if new.layout_version in trainer.failed_layouts:
        return None
    records = await trainer.node.peers_async(run_id)
    serving = [r for r in records if r.role == "stage" and r.state == "serving"]
    behind = [r for r in serving if r.layout < new.layout_version]
    if not behind:
        trainer.manifest = new
        return None
    started = time.monotonic()
    # between two of this trainer's steps; before its first, at the step the idle peers are at
    step = trainer.step if not force else max(r.step for r in behind)

    async def move(r, layout: int, stage: int | None = None) -> int | None:
        """Ask `r`'s peer, serving `stage` now (default: its record's), to move to `layout`."""
        meta = Relayout(layout=layout).to_meta()
        frame = Frame(
            kind="step", run_id=run_id, stage=r.stage if stage is None else stage, step=step, meta=meta
        )
        try:
            reply = await trainer.transport.call(
                r.peer_id, trainer.handler, frame, timeout_s=RELAYOUT_TIMEOUT_S
            )
            return reply.stage
        except (RemoteError, PeerUnreachableError, BadFrameError) as e:
            logger.warning("stage peer %s did not move to layout %d: %s", r.peer_id[-8:], layout, e)
            return None

    moved = await asyncio.gather(*(move(r, new.layout_version) for r in behind))
    served = {s for s in moved if s is not None} | {
        r.stage for r in serving if r.layout == new.layout_version
    }
    unserved = sorted(set(range(new.num_stages)) - served)
    if unserved:  # back to the layout the peers came from: those that moved kept its state
        old_version = min(r.layout for r in behind)
        await asyncio.gather(  # each from the stage it moved to
            *(move(r, old_version, s) for r, s in zip(behind, moved, strict=True) if s is not None)
        )
        trainer.failed_layouts.add(new.layout_version)
        if trainer.manifest.layout_version != old_version:  # routes go by version; the stage count is kept
            trainer.manifest = dataclasses.replace(trainer.manifest, layout_version=old_version)
        logger.warning(
            "the move to layout %d at step %d left stage(s) %s without a peer: the swarm went back to layout %d",
            new.layout_version, step, ", ".join(map(str, unserved)), old_version,
        )  # fmt: skip
        return None
    trainer.manifest = new
    await trainer.replicas(refresh=True)  # routes of the new layout before its first microbatch
    paused = time.monotonic() - started
    logger.warning(
        "moved the swarm to layout %d at step %d in %.2f s: %s",
        new.layout_version, step, paused, new.layout_note,
    )  # fmt: skip
    trainer.layout_moves.append((step, new.layout_version, paused))
    return paused
