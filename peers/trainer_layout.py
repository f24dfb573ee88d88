"""A trainer's side of a layout move: between two steps, it moves the swarm to the run's newest
layout (`RunManifest.layout_version`, which the owner publishes: `coordinator --replan`).

Before each step (reading the manifest at most every LAYOUT_CHECK_S), a trainer that finds a
newer layout than the one it trains on sends every serving stage peer of its layout a
`Relayout` for that step, with nothing in flight, and waits for them all
(`peers/relayout.py` is their side). The move succeeded when every stage of the new layout
has a peer that answered; the trainer then trains on the new layout from the same step. When
a stage of the new layout is left without a peer (its peers failed the move, or died), the
peers that did not move still serve the old layout, and those that moved still hold their old
stage's snapshot: the trainer stays on the old layout and raises StepFailedError.
"""

from __future__ import annotations

import asyncio
import logging
import time

from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError
from swarmtrain.train.step import StepFailedError
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import Relayout

logger = logging.getLogger(__name__)

LAYOUT_CHECK_S = 2.0
"""Most often a trainer reads the run's manifest for a newer layout."""
RELAYOUT_TIMEOUT_S = 120.0
"""How long a stage peer may take to move (it downloads its new blocks' state)."""


async def follow_layout(trainer, *, force: bool = False) -> float | None:
    """Move the swarm to the run's newest layout where its stage peers serve an older one; the
    seconds the move paused training, None when there was none to make. Reads the manifest at
    most every LAYOUT_CHECK_S unless `force`."""
    now = time.monotonic()
    if not force and now - getattr(trainer, "_layout_checked", -1e9) < LAYOUT_CHECK_S:
        return None
    trainer._layout_checked = now
    run_id = trainer.manifest.run_id
    new = await asyncio.get_running_loop().run_in_executor(None, trainer.node.get_manifest, run_id)
    if new is None or new.layout_version < trainer.manifest.layout_version:
        return None
    records = await trainer.node.peers_async(run_id)
    serving = [r for r in records if r.role == "stage" and r.state == "serving"]
    behind = [r for r in serving if r.layout < new.layout_version]
    if not behind:
        trainer.manifest = new
        return None
    started = time.monotonic()
    request = Relayout(layout=new.layout_version).to_meta()
    # between two of this trainer's steps; before its first, at the step the idle peers are at
    step = trainer.step if not force else max(r.step for r in behind)

    async def move(r) -> int | None:
        frame = Frame(kind="step", run_id=run_id, stage=r.stage, step=step, meta=request)
        try:
            reply = await trainer.transport.call(
                r.peer_id, trainer.handler, frame, timeout_s=RELAYOUT_TIMEOUT_S
            )
            return reply.stage
        except (RemoteError, PeerUnreachableError, BadFrameError) as e:
            logger.warning(
                "stage peer %s did not move to layout %d: %s", r.peer_id[-8:], new.layout_version, e
            )
            return None

    moved = await asyncio.gather(*(move(r) for r in behind))
    served = {s for s in moved if s is not None} | {
        r.stage for r in serving if r.layout == new.layout_version
    }
    unserved = sorted(set(range(new.num_stages)) - served)
    if unserved:
        raise StepFailedError(
            f"the move to layout {new.layout_version} at step {step} left stage(s) "
            f"{', '.join(map(str, unserved))} without a peer; the peers that did not move serve the old layout"
        )
    trainer.manifest = new
    paused = time.monotonic() - started
    logger.warning(
        "moved the swarm to layout %d at step %d in %.2f s: %s",
        new.layout_version, step, paused, new.layout_note,
    )  # fmt: skip
    trainer.layout_moves.append((step, new.layout_version, paused))
    return paused
