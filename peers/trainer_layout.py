"""A trainer's side of a layout move: between two steps, it re-plans the run's layout (the lead
trainer of a run with a re-plan rule) and moves the swarm to the run's newest layout.

Re-planning (`plan_layout`): in a run whose manifest carries a re-plan rule (`coordinator
--replan`), every `every_s` the lead trainer (`wire.layout_record.lead_trainer`: the least id
among the live trainers the run authorizes, so every trainer agrees from the same DHT view)
asks the planner for a layout of the serving peers at their measured speeds
(`train.layout.replan_proposal`). Once the same proposal has beaten the live layout by
`min_gain` for `patience` checks in a row (`plan.LayoutGate`), it publishes it as the run's
next layout version, signed by itself (`LayoutRecord` under `{run}.layout`), and moves the
swarm to it. No coordinator takes part; while the owner's runs, it signs the layout into the
manifest as well. A trainer that cannot trace the run's model (an import path it does not
allow) only follows.

Before each step (reading the manifest at most every LAYOUT_CHECK_S), a trainer that finds a
newer layout than the one it trains on sends every serving stage peer of its layout a
`Relayout` for that step, with nothing in flight, and waits for them all
(`peers/relayout.py` is their side). The move succeeded when every stage of the new layout
has a peer that answered; the trainer then trains on the new layout from the same step. When
a stage of the new layout is left without a peer (its peers failed the move, or died), the
move is undone: the peers that moved take their old stage back from the snapshot they kept
(the others never left it), and the trainer goes on with the old layout and does not try that
version again; in a run with a re-plan rule it publishes the layout the swarm is on as the
next version, so every peer reads the layout it trains on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time

from hivemind.utils import get_dht_time

from swarmtrain.errors import BadFrameError, ConfigError, PeerUnreachableError, RemoteError
from swarmtrain.plan import LayoutGate
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.keys import MANIFEST_TTL_S
from swarmtrain.wire.layout_record import LayoutRecord, lead_trainer
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
    if not force and now - trainer.layout_checked < LAYOUT_CHECK_S:
        return None
    trainer.layout_checked = now
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
        if trainer.manifest.replan is not None:  # the layout the swarm is on, as the next version
            back = [
                r for r in behind if r.layout == old_version and r.peer_id in {p.peer_id for p in serving}
            ]
            await _publish(
                trainer,
                version=new.layout_version + 1,
                stage_bounds=trainer.manifest.stage_bounds,
                assignments={r.peer_id: r.stage for r in back},
                note=f"the move to layout {new.layout_version} did not complete: layout {old_version}'s stages again",
            )
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


async def plan_layout(trainer) -> bool:
    """One re-plan check (at most every `replan.every_s` of the run's rule) by the lead trainer:
    publish the next layout once the gate lets a proposal through, and have the next
    `follow_layout` move the swarm to it. True when it published one."""
    m = trainer.manifest
    rule = m.replan
    now = time.monotonic()
    if rule is None or trainer.replan_costs is False or now - trainer.replan_checked < rule.every_s:
        return False
    trainer.replan_checked = now
    records = await trainer.node.peers_async(m.run_id)
    live = [r.peer_id for r in records if r.role == "trainer" and r.state in ("joining", "serving")]
    if lead_trainer(m, [*live, trainer.node.peer_id]) != trainer.node.peer_id:
        trainer.layout_gate = LayoutGate(rule)  # should it lead later, its count starts afresh
        return False
    serving = [r for r in records if r.role == "stage" and r.state == "serving"]
    if any(r.layout != m.layout_version for r in serving):
        return False  # a move under way: follow it first
    loop = asyncio.get_running_loop()
    latest = await loop.run_in_executor(None, trainer.node.get_manifest, m.run_id)
    if latest is not None and latest.layout_version > m.layout_version:
        return False  # a newer layout than this trainer's: follow it first
    from swarmtrain.train.layout import replan_note, replan_proposal
    from swarmtrain.train.placement import manifest_costs

    if trainer.replan_costs is None:
        try:
            trainer.replan_costs = await loop.run_in_executor(None, manifest_costs, m)
        except ConfigError as e:
            logger.warning("this trainer cannot re-plan run %s's layout (it only follows): %s", m.run_id, e)
            trainer.replan_costs = False
            return False
    proposal = trainer.layout_gate.observe(replan_proposal(m, serving, trainer.replan_costs))
    if proposal is None:
        return False
    await _publish(
        trainer,
        version=m.layout_version + 1,
        stage_bounds=proposal.stage_bounds,
        assignments=dict(proposal.assignments),
        note=replan_note(proposal, m.layout_version),
    )
    trainer.layout_gate = LayoutGate(rule)
    trainer.layout_checked = -math.inf  # the next follow_layout reads the run's layout at once
    return True


async def _publish(trainer, **layout) -> None:
    """Publish a layout of the run, planned by this trainer, as the run's newest."""
    record = LayoutRecord(planner=trainer.node.peer_id, at=get_dht_time(), **layout)
    await trainer.node.publish_layout(trainer.manifest.run_id, record, ttl_s=MANIFEST_TTL_S)
    logger.warning("run %s: layout %d: %s", trainer.manifest.run_id, record.version, record.note)
