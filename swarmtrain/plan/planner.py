"""Plans: stage boundaries, which peer replicates which stage, and the predicted throughput.

`plan_swarm` is the planner (Zorse-style: unequal contiguous stages, unequal replica counts),
`even_split_plan` the baseline it never falls below, and `evaluate` the one throughput model
both are judged by (peers joining a running plan: `swarmtrain.plan.join`). All are pure and deterministic: the same costs, peers (in any order) and config give the same plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from swarmtrain.errors import ConfigError
from swarmtrain.plan.cost_model import BlockCost, CostModel, PeerCapacity, PlanConfig, usable_memory
from swarmtrain.plan.search import TRAINER, Problem
from swarmtrain.plan.starts import (
    all_bounds,
    anchor_bounds,
    cover_bounds,
    flops_bounds,
    round_robin,
)
from swarmtrain.wire.records import even_split

QUICK_ROUNDS = 2
"""(assign, cut) rounds in the first pass at every stage count."""
AVERAGING_QUICK_ROUNDS = 1
"""The same, with averaging in swarms over LOCAL_SEARCH_PEERS peers: there the bound seldom
prunes a stage count, so the first pass only assigns peers to each starting cut."""
LOCAL_SEARCH_PEERS = 64
"""Swarms up to this many peers get local search in the first pass at every stage count."""
CUT_ENUMERATION_LIMIT = 2_000
"""Every cut is a starting point when (cuts x peers) is at most this."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Roles for every peer of a swarm and what the throughput model predicts for them."""

    stage_bounds: tuple[int, ...]
    """num_stages + 1 block indices: stage k holds blocks [stage_bounds[k], stage_bounds[k+1])."""
    assignments: dict[str, int]
    """Stage each stage peer replicates, by peer id (treat as read-only)."""
    trainers: tuple[str, ...]
    """Peers that host no stage (they fit none, or no stage needs them), sorted by id."""
    throughput_tokens_per_s: float
    """Predicted pipeline rate: the slowest stage's rate (0 while a stage has no replica)."""
    stage_tokens_per_s: tuple[float, ...]
    """Predicted rate of each stage: its replicas' summed token rate, less the gradient
    averaging between them when the config sets `tokens_per_step` (`CostModel.stage_rate`)."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_bounds) - 1

    @property
    def is_complete(self) -> bool:
        """Every stage has at least one replica, so the pipeline can run."""
        return len(set(self.assignments.values())) == self.num_stages

    def replicas(self, stage: int) -> tuple[str, ...]:
        """Peer ids replicating `stage`, sorted."""
        return tuple(sorted(p for p, s in self.assignments.items() if s == stage))


@dataclass(frozen=True, kw_only=True)
class PlanEvaluation:
    """A plan recomputed from scratch under the throughput and memory model."""

    throughput_tokens_per_s: float
    """The slowest stage's rate; 0 if a stage has no replica."""
    stage_tokens_per_s: tuple[float, ...]
    """Each stage's rate: `CostModel.stage_rate` of its replicas (their summed rate, less averaging)."""
    replica_tokens_per_s: dict[str, float]
    """Each stage peer's replica rate: min(compute rate, network rate)."""
    over_memory: tuple[str, ...]
    """Peers whose stage needs more than their usable memory (empty for a valid plan)."""


def _sorted_peers(peers: Iterable[PeerCapacity]) -> list[PeerCapacity]:
    ordered = sorted(peers, key=lambda p: p.peer_id)
    for a, b in itertools.pairwise(ordered):
        if a.peer_id == b.peer_id:
            raise ConfigError(
                f"peer id {a.peer_id!r} appears twice among the peers: each peer must be listed once"
            )
    return ordered


def _check_bounds(bounds: Sequence[int], num_blocks: int) -> None:
    if (
        len(bounds) < 2
        or bounds[0] != 0
        or bounds[-1] != num_blocks
        or any(a >= b for a, b in itertools.pairwise(bounds))
    ):
        raise ConfigError(
            f"stage bounds {tuple(bounds)} must rise strictly from 0 to the model's {num_blocks} blocks"
        )


def evaluate(
    plan: Plan, costs: Sequence[BlockCost], peers: Iterable[PeerCapacity], config: PlanConfig
) -> PlanEvaluation:
    """Recompute `plan`'s predicted rates and check every replica's memory.

    Raises ConfigError if the plan does not match the model (bounds) or names a peer, or a
    stage, that `peers` or the plan lacks. Peers of `peers` outside the plan are ignored.
    """
    model = CostModel(costs, config)
    _check_bounds(plan.stage_bounds, model.num_blocks)
    by_id = {p.peer_id: p for p in _sorted_peers(peers)}
    sums = [0.0] * plan.num_stages
    counts = [0] * plan.num_stages
    low = [math.inf] * plan.num_stages
    replica_rates: dict[str, float] = {}
    over_memory = []
    for peer_id in sorted(plan.assignments):
        s = plan.assignments[peer_id]
        if peer_id not in by_id:
            raise ConfigError(f"the plan assigns peer {peer_id!r}, which is not among the peers given")
        if not 0 <= s < plan.num_stages:
            raise ConfigError(
                f"the plan puts peer {peer_id!r} on stage {s}, but it has {plan.num_stages} stages"
            )
        start, stop = plan.stage_bounds[s], plan.stage_bounds[s + 1]
        replica_rates[peer_id] = model.replica_rate(by_id[peer_id], start, stop)
        sums[s] += replica_rates[peer_id]
        counts[s] += 1
        low[s] = min(low[s], by_id[peer_id].bandwidth_bytes_per_s)
        if model.stage_memory(start, stop) > usable_memory(by_id[peer_id], config):
            over_memory.append(peer_id)
    bounds = plan.stage_bounds
    totals = [
        model.stage_rate(sums[s], counts[s], low[s], bounds[s], bounds[s + 1]) for s in range(plan.num_stages)
    ]
    return PlanEvaluation(
        throughput_tokens_per_s=min(totals),
        stage_tokens_per_s=tuple(totals),
        replica_tokens_per_s=replica_rates,
        over_memory=tuple(over_memory),
    )


@dataclass(frozen=True)
class _Candidate:
    """A plan under construction: bounds, stage index per peer (peer-id order), stage rates."""

    bounds: tuple[int, ...]
    stage_of: list[int]
    totals: list[float]

    @property
    def score(self) -> tuple[float, int]:
        """Higher is better: throughput, then (for plans that cannot run yet) fewer empty stages."""
        return min(self.totals), len(set(self.stage_of) - {TRAINER}) - len(self.totals)


def _candidate(problem: Problem, bounds: tuple[int, ...], stage_of: list[int]) -> _Candidate:
    """Rates are summed in peer-id order, exactly as `evaluate` sums them."""
    return _Candidate(
        bounds, stage_of, problem.stage_totals(bounds, np.asarray(stage_of, dtype=np.int64)).tolist()
    )


def _better(candidate: _Candidate, best: _Candidate | None) -> bool:
    """Strictly better; on a tie the earlier candidate stays, which keeps the planner deterministic."""
    return best is None or candidate.score > best.score


def _to_plan(problem: Problem, c: _Candidate) -> Plan:
    ids = [p.peer_id for p in problem.peers]
    return Plan(
        stage_bounds=c.bounds,
        assignments={ids[p]: s for p, s in enumerate(c.stage_of) if s != TRAINER},
        trainers=tuple(ids[p] for p, s in enumerate(c.stage_of) if s == TRAINER),
        throughput_tokens_per_s=min(c.totals),
        stage_tokens_per_s=tuple(c.totals),
    )


def _stage_counts(num_blocks: int, num_peers: int, config: PlanConfig) -> range:
    cap = min(num_blocks, max(num_peers, 1))
    if config.max_stages is not None:
        cap = min(cap, config.max_stages)
    return range(min(config.min_stages, cap), cap + 1)


def _cannot_beat(problem: Problem, count: int, floor: float) -> bool:
    """True when no plan with `count` (or more) stages can beat throughput `floor`."""
    return floor > 0 and problem.throughput_bound(count) <= floor


def _even_split(problem: Problem, config: PlanConfig, num_stages: int | None) -> _Candidate:
    counts = (
        (num_stages,)
        if num_stages is not None
        else _stage_counts(problem.num_blocks, len(problem.peers), config)
    )
    best = None
    for count in counts:
        if best is not None and _cannot_beat(problem, count, best.score[0]):
            break
        bounds = even_split(problem.num_blocks, count)
        candidate = _candidate(problem, bounds, round_robin(problem, bounds))
        if _better(candidate, best):
            best = candidate
    return best


def even_split_plan(
    costs: Sequence[BlockCost],
    peers: Iterable[PeerCapacity],
    config: PlanConfig,
    num_stages: int | None = None,
) -> Plan:
    """The baseline: equal block counts, peers in id order take stages round-robin.

    A peer skips the stages it does not fit and is a trainer if it fits none. With
    `num_stages` None, every stage count the config allows is tried and the best plan kept.
    """
    model = CostModel(costs, config)
    if num_stages is not None and not 1 <= num_stages <= model.num_blocks:
        raise ConfigError(
            f"cannot split {model.num_blocks} blocks into {num_stages} stages: use 1..{model.num_blocks}"
        )
    problem = Problem(model, _sorted_peers(peers), config)
    return _to_plan(problem, _even_split(problem, config, num_stages))


def _refine(problem: Problem, start: _Candidate, rounds: int, local_search: bool = True) -> _Candidate:
    """Alternate assign (b) and cut (a) from `start`'s bounds until the plan stops improving."""
    best, bounds, num_stages = None, start.bounds, len(start.bounds) - 1
    stage_of = start.stage_of or None
    for round_ in range(rounds):
        options = [problem.assign(bounds, local_search=local_search)]
        if stage_of is not None:
            options.append(problem.assign(bounds, stage_of, local_search=local_search))
        improved = False
        for option in options:
            candidate = _candidate(problem, bounds, option)
            if _better(candidate, best):
                best, stage_of, improved = candidate, option, True
        if not improved or round_ == rounds - 1:
            break
        cut = problem.cut(stage_of, num_stages)
        if cut is None or cut == bounds:
            break
        bounds = cut
    return best


def _starts(problem: Problem, num_stages: int, enumerate_cuts: bool) -> list[tuple[int, ...]]:
    """Starting cuts for one stage count: all of them if affordable, else four good guesses."""
    n = problem.num_blocks
    if enumerate_cuts:
        return list(all_bounds(n, num_stages))
    guesses = [
        even_split(n, num_stages),
        flops_bounds(problem.model, num_stages),
        anchor_bounds(problem, num_stages, largest_first=True),
        anchor_bounds(problem, num_stages, largest_first=False),
    ]
    return [b for i, b in enumerate(guesses) if b is not None and b not in guesses[:i]]


def _search_count(problem: Problem, count: int, config: PlanConfig) -> tuple[list[_Candidate], bool]:
    """Candidates with `count` stages from a first pass, and whether the best of them is exact."""
    n, num_peers = problem.num_blocks, len(problem.peers)
    num_cuts = math.comb(n - 1, count - 1)
    if num_cuts * (count + 1) ** num_peers <= config.exhaustive_limit:
        return [_candidate(problem, b, problem.assign_exact(b)) for b in all_bounds(n, count)], True
    local_search = num_peers <= LOCAL_SEARCH_PEERS
    rounds = QUICK_ROUNDS if local_search or not problem.averages else AVERAGING_QUICK_ROUNDS
    starts = _starts(problem, count, num_cuts * num_peers <= CUT_ENUMERATION_LIMIT)
    found = [_refine(problem, _Candidate(b, [], []), rounds, local_search) for b in starts]
    if all(c.score[1] < 0 for c in found):  # a stage has no replica: find a cut the largest peers cover
        bounds = cover_bounds(problem, count)
        if bounds is not None:
            found.append(_refine(problem, _Candidate(bounds, [], []), rounds, local_search))
    return found, False


def plan_swarm(costs: Sequence[BlockCost], peers: Iterable[PeerCapacity], config: PlanConfig) -> Plan:
    """Choose stage boundaries and every peer's role to maximise predicted pipeline throughput.

    For each stage count: if (cuts x assignments) is within `config.exhaustive_limit`, try
    them all (exact). Otherwise assign peers to a few starting cuts (every cut when there
    are few, else even, FLOP-balanced, and cut for the peers with most memory; and a cut
    those peers can cover if none of these is). The `config.refine_top` best of all these
    are then refined: alternately re-cut the boundaries exactly for the assignment and
    re-assign peers to the new cut, until the plan stops improving. Stage counts whose
    bandwidth bound cannot beat the best plan so far are skipped. With averaging
    (`config.tokens_per_step`) that bound seldom prunes, so in swarms over LOCAL_SEARCH_PEERS
    peers the first pass only assigns peers to the starting cuts (AVERAGING_QUICK_ROUNDS).

    The result is never worse than `even_split_plan` and never over a peer's usable memory.
    Without averaging every peer that fits a stage of the chosen cut replicates one, the others
    are trainers; with it, so are peers whose replica would only slow the stages they fit
    (the averaging it adds outweighs its tokens).
    """
    model = CostModel(costs, config)
    problem = Problem(model, _sorted_peers(peers), config)
    best = _even_split(problem, config, None)
    heuristic: list[tuple[tuple[float, int], int, int, _Candidate]] = []
    for count in _stage_counts(model.num_blocks, len(problem.peers), config):
        if _cannot_beat(problem, count, max([best.score[0], *(h[0][0] for h in heuristic)])):
            break  # the bound only falls as stages are added
        found, exact = _search_count(problem, count, config)
        for k, candidate in enumerate(found):
            if exact:
                best = candidate if _better(candidate, best) else best
            else:
                heuristic.append((candidate.score, -count, -k, candidate))
    heuristic.sort(key=lambda h: h[:3], reverse=True)
    for *_, candidate in heuristic[: config.refine_top]:
        for option in (candidate, _refine(problem, candidate, config.max_rounds)):
            if _better(option, best):
                best = option
    return _to_plan(problem, best)


def stage_members(
    plan: Plan, model: CostModel, peers: Iterable[PeerCapacity]
) -> tuple[list[float], list[int], list[float]]:
    """Per stage of `plan`: its replicas' summed rate (in peer-id order, as `evaluate` sums),
    their count, and the slowest replica's bandwidth (inf for none): `CostModel.stage_rate`'s inputs."""
    by_id = {p.peer_id: p for p in peers}
    sums = [0.0] * plan.num_stages
    counts = [0] * plan.num_stages
    low = [math.inf] * plan.num_stages
    for peer_id in sorted(plan.assignments):
        s, p = plan.assignments[peer_id], by_id[peer_id]
        sums[s] += model.replica_rate(p, plan.stage_bounds[s], plan.stage_bounds[s + 1])
        counts[s] += 1
        low[s] = min(low[s], p.bandwidth_bytes_per_s)
    return sums, counts, low
