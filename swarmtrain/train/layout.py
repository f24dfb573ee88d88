"""A run's first layout, planned from the stage peers that actually come.

A coordinator given `--min-peers N` publishes its run with a pending layout (manifest
`layout_version` 0, its stage bounds a placeholder even split). Stage peers read it, measure
themselves (the probe, and a forward and backward of one block of the run's own model:
`self_measure.block_capacity`), announce themselves as candidates (`PeerRecord.role`
'candidate') and wait. Once N candidates are there, or `--plan-wait` seconds have passed, the
coordinator plans the stage bounds and who serves which stage from their announced capacity
(`first_layout`: the planner, with the run's stage count kept) and publishes the manifest again
as layout version 1. The candidates take the stages it assigns them; trainers waited for it
too, so nobody has trained on the placeholder. Peers that come later join the planned layout
as they would any other (`placement.choose_stage`).

`first_layout` and `layout_due` are deterministic functions of the records and the clock
reading they are given: any peer that read the same records would plan the same layout.

Later, `replan_proposal` asks the same planner what layout the serving peers would get now,
against the one they have (`swarmtrain.plan.layout`: a proposal, and the hysteresis a move
needs); the dashboard and `status` show it, and in a run with `--replan` the lead trainer
publishes it as the next layout version once it holds and moves the swarm to it between two
steps (`peers/trainer_layout.py`, `peers/relayout.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

from swarmtrain.errors import ConfigError
from swarmtrain.plan import BlockCost, LayoutProposal, even_split_plan, plan_swarm, propose_layout
from swarmtrain.train.placement import (
    capacity_of,
    layout_plan,
    live_capacities,
    live_stage_peers,
    manifest_costs,
    manifest_plan_config,
)
from swarmtrain.wire.layout_record import spans_text
from swarmtrain.wire.records import PeerRecord, RunManifest

logger = logging.getLogger(__name__)

PLAN_WAIT_S = 60.0
"""Default seconds a coordinator waits for `--min-peers` candidates before it plans with those there."""
LAYOUT_WAIT_S = 600.0
"""Seconds a trainer waits for a pending run's first layout before it gives up."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstLayoutConfig:
    """When a coordinator plans its run's first layout."""

    min_peers: int
    """Candidates to wait for (>= 1)."""
    plan_wait_s: float = PLAN_WAIT_S
    """Seconds after which it plans with the candidates there are, if at least as many as stages."""

    def __post_init__(self):
        if isinstance(self.min_peers, bool) or not isinstance(self.min_peers, int) or self.min_peers < 1:
            raise ConfigError(f"--min-peers must be an integer >= 1, got {self.min_peers!r}")
        wait = self.plan_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 86400:
            raise ConfigError(f"--plan-wait must be seconds in [0, 86400), got {wait!r}")


def candidates(records: Iterable[PeerRecord]) -> list[PeerRecord]:
    """The candidate records (stage peers waiting for the first layout), by peer id."""
    return sorted((r for r in records if r.role == "candidate"), key=lambda r: r.peer_id)


def pending_note(config: FirstLayoutConfig) -> str:
    """The pending manifest's `layout_note`: what the layout waits for."""
    return (
        f"pending: the coordinator plans the stages once {config.min_peers} stage peers have announced "
        f"themselves, or after {config.plan_wait_s:g} s with at least one per stage"
    )


def layout_due(config: FirstLayoutConfig, num_candidates: int, waited_s: float, num_stages: int) -> bool:
    """Plan now: `min_peers` candidates are there, or the wait is over with one per stage."""
    return num_candidates >= config.min_peers or (
        waited_s >= config.plan_wait_s and num_candidates >= num_stages
    )


def first_layout(
    manifest: RunManifest,
    records: Iterable[PeerRecord],
    costs: Sequence[BlockCost] | None = None,
    *,
    now: float = 0.0,
) -> RunManifest:
    """The manifest with its first layout (version 1, planned at DHT time `now`): stage bounds
    and assignments planned for the candidates among `records` with the manifest's stage
    count, or its even split kept when fewer candidates than stages came."""
    peers = [capacity_of(r) for r in candidates(records)]
    num_stages = manifest.num_stages
    if len(peers) < num_stages:
        return dataclasses.replace(
            manifest,
            layout_version=1,
            layout_at=now,
            assignments={},
            layout_note=f"even split kept: {len(peers)} stage peers came for {num_stages} stages",
        )
    costs = list(costs) if costs is not None else manifest_costs(manifest)
    config = dataclasses.replace(manifest_plan_config(manifest), min_stages=num_stages, max_stages=num_stages)
    plan = plan_swarm(costs, peers, config)
    even = even_split_plan(costs, peers, config, num_stages=num_stages)
    gain = (
        plan.throughput_tokens_per_s / even.throughput_tokens_per_s if even.throughput_tokens_per_s else 1.0
    )
    note = (
        f"planned from {len(peers)} peers: blocks {spans_text(plan.stage_bounds)}, "
        f"{plan.throughput_tokens_per_s:.0f} tokens/s predicted, {gain:.2f}x the even split"
    )
    return dataclasses.replace(
        manifest,
        stage_bounds=plan.stage_bounds,
        layout_version=1,
        layout_at=now,
        assignments=dict(plan.assignments),
        layout_note=note,
    )


async def await_first_layout(
    node,
    manifest: RunManifest,
    record: PeerRecord,
    *,
    stop: asyncio.Event,
    ttl_s: float,
    heartbeat_s: float,
    on_waiting: Callable[[str], None],
    poll_s: float = 0.5,
    say_every_s: float = 15.0,
) -> RunManifest:
    """A stage peer's wait for its run's first layout: announce `record` (the peer as a
    candidate, its capacity measured) every `heartbeat_s`, read the manifest every `poll_s`,
    and tell `on_waiting` every `say_every_s` how many candidates are there. The manifest with
    the layout, or the pending one if `stop` was set first."""
    loop = asyncio.get_running_loop()
    announced = said = -math.inf
    while manifest.layout_version == 0 and not stop.is_set():
        now = time.monotonic()
        if now - announced >= heartbeat_s:
            await node.announce_async(manifest.run_id, record, ttl_s=ttl_s)
            announced = now
        if now - said >= say_every_s:
            waiting = len(candidates(await node.peers_async(manifest.run_id)))
            on_waiting(
                f"waiting for the first layout of run {manifest.run_id!r} ({waiting} stage "
                f"peer{'' if waiting == 1 else 's'} announced): {manifest.layout_note.removeprefix('pending: ')}"
            )
            said = now
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=poll_s)
        manifest = await loop.run_in_executor(None, node.get_manifest, manifest.run_id) or manifest
    if manifest.layout_version:
        logger.info("run %s's first layout: %s", manifest.run_id, manifest.layout_note)
    return manifest


def wait_for_layout(
    read: Callable[[], RunManifest | None],
    manifest: RunManifest,
    *,
    who: str,
    timeout_s: float = LAYOUT_WAIT_S,
    poll_s: float = 0.5,
    log_every_s: float = 30.0,
) -> RunManifest:
    """`manifest` if its layout is set, else the run's manifest once it is (`read` reads it
    again), saying every `log_every_s` what it waits for. ConfigError after `timeout_s`."""
    start, last_log = time.monotonic(), -float("inf")
    while manifest.layout_version == 0:
        now = time.monotonic()
        if now - start > timeout_s:
            raise ConfigError(
                f"{who} waited {timeout_s:.0f} s for run {manifest.run_id!r}'s first layout ({manifest.layout_note}): "
                f"start more stage peers (`swarmtrain join --run-id {manifest.run_id}`), or restart the "
                "coordinator with a smaller --min-peers"
            )
        if now - last_log >= log_every_s:  # a wait people should see, not only in -v
            logger.warning(
                "%s waits for run %s's first layout: %s", who, manifest.run_id, manifest.layout_note
            )
            last_log = now
        time.sleep(poll_s)
        manifest = read() or manifest
    return manifest


def replan_proposal(
    manifest: RunManifest, records: Iterable[PeerRecord], costs: Sequence[BlockCost] | None = None
) -> LayoutProposal | None:
    """The planner's layout for the run's serving stage peers (their measured speeds, as
    `placement.live_capacities`), with the run's stage count, against the layout they serve;
    None when it would keep that layout, or while a stage has no serving replica."""
    live = live_stage_peers(manifest, records)
    if {r.stage for r in live} != set(range(manifest.num_stages)):
        return None
    costs = list(costs) if costs is not None else manifest_costs(manifest)
    try:
        peers = live_capacities(manifest, live, costs)
    except (TypeError, ValueError):  # a capacity that does not parse
        return None
    return propose_layout(costs, peers, manifest_plan_config(manifest, live), layout_plan(manifest, live))


def replan_note(proposal: LayoutProposal, live_version: int) -> str:
    """The `layout_note` of a layout re-planned from `proposal` over layout `live_version`."""
    gain = "from a stalled layout" if proposal.gain == float("inf") else f"{proposal.gain:+.0%}"
    return (
        f"re-planned from {len(proposal.assignments)} serving peers: blocks {spans_text(proposal.stage_bounds)}, "
        f"{proposal.planned_tokens_per_s:.0f} tokens/s predicted ({gain} over layout {live_version})"
    )
