"""Cuts and assignments the search starts from, and the baseline's.

`even_split` (the run manifest's split) + `round_robin` are the even-split baseline; `flops_bounds`, `anchor_bounds`
and `cover_bounds` are starting cuts for `Problem.assign`; `all_bounds` enumerates every cut.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np

from swarmtrain.plan.cost_model import CostModel
from swarmtrain.plan.search import TRAINER, Problem


def round_robin(problem: Problem, bounds: tuple[int, ...]) -> list[int]:
    """Peers in id order take stages in turn; a peer skips stages it does not fit, and a peer
    that fits none is a trainer (the baseline's assignment)."""
    _, fits = problem.stage_arrays(bounds)
    num_stages = len(bounds) - 1
    stage, turn = [], 0
    for row in fits.tolist():
        for k in range(num_stages):
            s = (turn + k) % num_stages
            if row[s]:
                stage.append(s)
                turn = s + 1
                break
        else:
            stage.append(TRAINER)
    return stage


def flops_bounds(model: CostModel, num_stages: int) -> tuple[int, ...]:
    """Boundaries that split the model's FLOPs/token as evenly as whole blocks allow."""
    total = model.flops[-1]
    bounds = [0]
    for s in range(1, num_stages):
        target = total * s / num_stages
        j = int(np.searchsorted(model.flops, target))
        j = min(max(j, bounds[-1] + 1), model.num_blocks - (num_stages - s))
        if j > bounds[-1] + 1 and target - model.flops[j - 1] < model.flops[j] - target:
            j -= 1
        bounds.append(j)
    bounds.append(model.num_blocks)
    return tuple(bounds)


def anchor_bounds(problem: Problem, num_stages: int, *, largest_first: bool) -> tuple[int, ...] | None:
    """Boundaries cut for one replica per stage: the `num_stages` peers with most memory.

    A starting point that is memory-feasible whenever a cut exists for those peers in that
    stage order (largest memory on stage 0, or on the last stage), which the even and
    FLOP-balanced cuts are not when peers differ in memory.
    """
    anchors = problem.by_memory[:num_stages].tolist()
    if not largest_first:
        anchors.reverse()
    assignment = [TRAINER] * len(problem.peers)
    for s, p in enumerate(anchors):
        assignment[p] = s
    return problem.cut(assignment, num_stages)


COVER_SEARCH_STAGES = 10
"""`cover_bounds` searches anchor orders (2^S states) up to this many stages."""


def cover_bounds(problem: Problem, num_stages: int) -> tuple[int, ...] | None:
    """A cut whose every stage fits one of the `num_stages` peers with most memory, if one exists.

    If any S peers can cover S stages, these can (a peer with more memory fits more). Which
    anchor goes on which stage matters when blocks differ: reach[used] is the furthest block
    the anchors in `used` can cover as the first stages, in their best order (furthest is
    best, since a stage starting later needs less). Exact, exponential in the stage count,
    so only up to COVER_SEARCH_STAGES; None beyond it or when no cut covers every stage.
    """
    if num_stages > min(COVER_SEARCH_STAGES, len(problem.peers)):
        return None
    n, prefix = problem.num_blocks, problem.model.memory
    anchors = problem.by_memory[:num_stages].tolist()
    reach = {0: 0}
    parent: dict[int, tuple[int, int]] = {}
    for used in sorted(range(1 << num_stages), key=lambda m: (m.bit_count(), m)):
        if used not in reach:
            continue
        start, placed = reach[used], used.bit_count()
        last = n - (num_stages - placed - 1)  # leave a block for each later stage
        for k, peer in enumerate(anchors):
            if used >> k & 1:
                continue
            stop = min(bisect.bisect_right(prefix, prefix[start] + problem.memory[peer]) - 1, last)
            while stop > start and prefix[stop] - prefix[start] > problem.memory[peer]:
                stop -= 1  # the bisection's sum and the model's difference may round apart
            if stop > start and stop > reach.get(used | 1 << k, -1):
                reach[used | 1 << k], parent[used | 1 << k] = stop, (used, k)
    full = (1 << num_stages) - 1
    if reach.get(full) != n:
        return None
    assignment, used = [TRAINER] * len(problem.peers), full
    for s in reversed(range(num_stages)):
        used, k = parent[used]
        assignment[anchors[k]] = s
    return problem.cut(assignment, num_stages)


def all_bounds(num_blocks: int, num_stages: int):
    """Every way to cut `num_blocks` blocks into `num_stages` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
        yield (0, *cuts, num_blocks)
