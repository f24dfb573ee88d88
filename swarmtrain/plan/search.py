"""The planner's two alternating steps, over peers indexed in peer-id order.

- `cut`: given which peers replicate each stage, the contiguous boundaries that maximise the
  slowest stage's rate with every replica's memory respected (exact dynamic programming over
  block boundaries).
- `assign`: given boundaries, which stage each peer replicates: cover every stage first
  (scarcest stage first, non-spot peers first, augmenting paths where needed), then each
  remaining peer to the slowest stage it fits (least flexible peers first, then fastest),
  then single moves and swaps that lift the slowest stage (local search).

An assignment is a list with one entry per peer: its stage index, or -1 for a trainer.
Everything here is deterministic: ties go to the lower peer index and the lower stage index.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from swarmtrain.plan.costs import CostModel, PeerCapacity, PlanConfig, usable_memory

TRAINER = -1
SWAP_PEER_LIMIT = 128
"""Swaps are tried only in swarms up to this many peers; beyond it single moves suffice."""
ARRAY_CACHE_SIZE = 256
"""Cuts whose (rate, fits) arrays a Problem keeps; the search revisits the same cuts often."""
_RELATIVE_GAIN = 1e-9
"""A local-search step must lift the slowest stage by this fraction, so float noise cannot cycle."""


def stage_totals(stage: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """Each stage's rate (S,): the sum of its replicas' rates, for an assignment `stage` (P,)."""
    assigned = np.flatnonzero(stage >= 0)
    return np.bincount(stage[assigned], weights=rate[assigned, stage[assigned]], minlength=rate.shape[1])


class Problem:
    """One planning instance: the cost model and the peers (sorted by id) as arrays."""

    def __init__(self, model: CostModel, peers: list[PeerCapacity], config: PlanConfig):
        self.model = model
        self.peers = peers
        self.num_blocks = model.num_blocks
        self.flops = np.array([p.flops_per_s for p in peers], dtype=np.float64)
        self.bandwidth = np.array([p.bandwidth_bytes_per_s for p in peers], dtype=np.float64)
        self.memory = np.array([usable_memory(p, config) for p in peers], dtype=np.float64)
        self.is_spot = np.array([p.is_spot for p in peers], dtype=bool)
        self.by_memory = np.lexsort((np.arange(len(peers)), -self.flops, -self.memory))
        """Peer indices, most memory first (then most FLOP/s, then id)."""
        n = model.num_blocks
        starts, stops = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")  # (i, j)
        self.valid = stops > starts
        flops = np.asarray(model.flops)
        memory = np.asarray(model.memory)
        self.cell_flops = np.where(self.valid, flops[stops] - flops[starts], 1.0)  # (i, j)
        self.cell_memory = np.where(self.valid, memory[stops] - memory[starts], np.inf)  # (i, j)
        boundary = np.asarray([0.0, *model.boundary])  # boundary[k]: bytes after block k-1
        inbound = np.where(starts > 0, boundary[starts], 0.0)
        outbound = np.where(stops < n, boundary[stops], 0.0)
        self.cell_traffic = 2.0 * (inbound + outbound)  # (i, j)
        self._arrays: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def throughput_bound(self, num_stages: int) -> float:
        """An upper bound on the throughput of any plan with `num_stages` stages (non-increasing in it).

        Each token crosses num_stages - 1 cuts, and each cut costs the two replicas beside it
        2 x (boundary bytes) apiece, so stage rate tau needs tau x 4 x (S - 1) x (smallest
        boundary) bytes/s, out of the summed bandwidth of peers that fit at least one block.
        The compute bound, tau x (FLOPs of the model) <= summed FLOP/s, holds too.
        """
        single = self.cell_memory[np.arange(self.num_blocks), np.arange(1, self.num_blocks + 1)].min()
        useful = self.memory >= single
        compute = self.flops[useful].sum() / self.model.flops[-1]
        cut_bytes = min(self.model.boundary[:-1], default=0.0)
        if num_stages < 2 or cut_bytes == 0:
            return compute
        return min(compute, self.bandwidth[useful].sum() / (4.0 * (num_stages - 1) * cut_bytes))

    # -- step (a): boundaries for a fixed assignment ------------------------------------------

    def _stage_matrix(self, members: np.ndarray) -> np.ndarray:
        """Rate of a stage replicated by `members` for every span (i, j); -inf where it cannot be."""
        if members.size == 0:
            return np.where(self.valid, 0.0, -np.inf)
        # A replica is compute-bound iff flops/F <= bandwidth/B, i.e. iff flops/bandwidth <= F/B:
        # with peers sorted by that ratio the compute-bound ones are a prefix, so the stage rate is
        # (prefix flops) / F + (suffix bandwidth) / B, one binary search per span.
        ratio = self.flops[members] / self.bandwidth[members]
        order = np.argsort(ratio, kind="stable")
        ratio = ratio[order]
        flops_prefix = np.concatenate(([0.0], np.cumsum(self.flops[members][order])))
        bandwidth_prefix = np.concatenate(([0.0], np.cumsum(self.bandwidth[members][order])))
        traffic = self.cell_traffic
        has_traffic = traffic > 0
        threshold = np.where(has_traffic, self.cell_flops / np.where(has_traffic, traffic, 1.0), np.inf)
        k = np.searchsorted(ratio, threshold, side="right")
        network = (bandwidth_prefix[-1] - bandwidth_prefix[k]) / np.where(has_traffic, traffic, 1.0)
        rate = flops_prefix[k] / self.cell_flops + network
        fits = self.valid & (self.cell_memory <= self.memory[members].min())
        return np.where(fits, rate, -np.inf)

    def cut(self, assignment: list[int], num_stages: int) -> tuple[int, ...] | None:
        """Boundaries maximising the slowest stage's rate for this assignment, or None if none fit.

        Exact: best[s][j] = max over i of min(best[s-1][i], rate of stage s over blocks [i, j)).
        Among equally good cuts the earliest boundaries win.
        """
        stage_of = np.asarray(assignment)
        n = self.num_blocks
        best = self._stage_matrix(np.flatnonzero(stage_of == 0))[0]  # (j,): stage 0 is [0, j)
        back = []
        for s in range(1, num_stages):
            candidates = np.minimum(
                best[:, None], self._stage_matrix(np.flatnonzero(stage_of == s))
            )  # (i, j)
            arg = candidates.argmax(axis=0)  # (j,)
            best = candidates[arg, np.arange(n + 1)]
            back.append(arg)
        if not np.isfinite(best[n]):
            return None
        bounds = [n]
        for arg in reversed(back):
            bounds.append(int(arg[bounds[-1]]))
        bounds.append(0)
        return tuple(reversed(bounds))

    # -- step (b): assignment for fixed boundaries ---------------------------------------------

    def stage_arrays(self, bounds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(rate, fits), both (peers, stages): each peer's replica rate on each stage, and whether it fits.

        Cached per cut; callers must not write to them.
        """
        if bounds not in self._arrays:
            if len(self._arrays) >= ARRAY_CACHE_SIZE:
                self._arrays.pop(next(iter(self._arrays)))
            self._arrays[bounds] = self._stage_arrays(bounds)
        return self._arrays[bounds]

    def _stage_arrays(self, bounds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        starts, stops = np.asarray(bounds[:-1]), np.asarray(bounds[1:])
        flops = self.cell_flops[starts, stops]
        traffic = self.cell_traffic[starts, stops]
        compute = self.flops[:, None] / flops[None, :]  # (P, S)
        with np.errstate(divide="ignore"):
            network = np.where(
                traffic > 0, self.bandwidth[:, None] / np.where(traffic > 0, traffic, 1.0), np.inf
            )
        rate = np.minimum(compute, network)  # (P, S)
        fits = self.memory[:, None] >= self.cell_memory[starts, stops][None, :]  # (P, S)
        return rate, fits

    def assign(
        self, bounds: tuple[int, ...], start: list[int] | None = None, *, local_search: bool = True
    ) -> list[int]:
        """Assign peers to the stages of `bounds`, keeping `start`'s placements where given.

        Peers of `start` that no longer fit their stage, or are trainers there, are placed anew.
        Peers that fit no stage stay trainers.
        """
        rate, fits = self.stage_arrays(bounds)
        num_peers, num_stages = rate.shape
        stage = np.full(num_peers, TRAINER)
        if start is not None:
            kept = np.asarray(start)
            ok = kept >= 0
            ok[ok] = fits[np.flatnonzero(ok), kept[ok]]
            stage[ok] = kept[ok]
        self._cover(stage, rate, fits)
        self._fill(stage, rate, fits)
        if local_search:
            self._improve(stage, rate, fits)
        return stage.tolist()

    def assign_exact(self, bounds: tuple[int, ...]) -> list[int]:
        """The best assignment for `bounds` by enumerating every peer's options (small swarms only).

        Among equally good assignments the first in enumeration order wins; then any peer left
        out that fits a stage is added, as in `assign`.
        """
        rate, fits = self.stage_arrays(bounds)
        num_peers, num_stages = rate.shape
        if num_peers == 0:
            return []
        options = [[*np.flatnonzero(fits[p]).tolist(), TRAINER] for p in range(num_peers)]
        table = np.array(list(itertools.product(*options)), dtype=np.int64).reshape(-1, num_peers)  # (K, P)
        rows = np.arange(table.shape[0])
        totals = np.zeros((table.shape[0], num_stages + 1))  # (K, S + 1): the last column collects trainers
        padded = np.concatenate((rate, np.zeros((num_peers, 1))), axis=1)  # (P, S + 1)
        for p in range(num_peers):
            totals[rows, table[:, p]] += padded[p, table[:, p]]
        best = int(np.argmax(totals[:, :num_stages].min(axis=1)))
        stage = table[best].copy()
        self._fill(stage, rate, fits)
        return stage.tolist()

    def _cover(self, stage: np.ndarray, rate: np.ndarray, fits: np.ndarray) -> None:
        """Give every stage that has none a replica, if a matching of free peers allows it."""
        counts = np.bincount(stage[stage >= 0], minlength=rate.shape[1])
        candidates = fits.sum(axis=0)
        empty = sorted(
            np.flatnonzero(counts == 0).tolist(), key=lambda s: (candidates[s], s)
        )  # scarcest first
        for s in empty:
            free = fits[:, s] & (stage == TRAINER)
            if free.any():
                # Prefer non-spot peers for a stage's first replica, then the fastest there.
                steady = free & ~self.is_spot
                pool = steady if steady.any() else free
                stage[int(np.argmax(np.where(pool, rate[:, s], -1.0)))] = s
                counts[s] += 1
            else:
                self._augment(stage, fits, s, counts)
                counts = np.bincount(stage[stage >= 0], minlength=rate.shape[1])

    def _augment(self, stage: np.ndarray, fits: np.ndarray, target: int, counts: np.ndarray) -> None:
        """Cover `target` along an alternating path: a peer leaves a stage that keeps a replica,
        or is replaced there by another peer, recursively (Kuhn's augmenting path)."""
        seen: set[int] = set()

        def find(s: int) -> bool:
            for p in np.flatnonzero(fits[:, s]).tolist():
                if p in seen:
                    continue
                seen.add(p)
                owner = int(stage[p])
                if owner == TRAINER or counts[owner] >= 2 or find(owner):
                    stage[p] = s
                    return True
            return False

        find(target)

    def _fill(self, stage: np.ndarray, rate: np.ndarray, fits: np.ndarray) -> None:
        """Place the remaining peers, each on the slowest stage it fits.

        Peers that fit the fewest stages go first (they have no choice; the others can then
        top up the stages only they fit), faster peers first among equals.
        """
        totals = stage_totals(stage, rate).tolist()
        waiting = np.flatnonzero((stage == TRAINER) & fits.any(axis=1))
        if waiting.size == 0:
            return
        # A peer fits the stages needing at most its memory, so the number of stages it fits
        # names the set. Peers with the same set share a heap of (stage total, stage); totals
        # only grow, so an entry is stale iff its total is no longer the stage's: dropped lazily.
        keys = fits[waiting].sum(axis=1).tolist()
        heaps: dict[int, list[tuple[float, int]]] = {}
        holders: list[list[list[tuple[float, int]]]] = [[] for _ in totals]  # stage -> heaps with it
        for p, key in zip(waiting.tolist(), keys, strict=True):
            if key not in heaps:
                members = np.flatnonzero(fits[p]).tolist()
                heaps[key] = sorted((totals[s], s) for s in members)
                for s in members:
                    holders[s].append(heaps[key])
        order = np.lexsort((-self.flops[waiting], keys))  # fewest stages first, then fastest
        chosen = []
        for p, key in zip(waiting[order].tolist(), [keys[i] for i in order.tolist()], strict=True):
            heap = heaps[key]
            while heap[0][0] != totals[heap[0][1]]:
                heapq.heappop(heap)
            s = heap[0][1]
            chosen.append((p, s))
            totals[s] += float(rate[p, s])
            for other in holders[s]:
                heapq.heappush(other, (totals[s], s))
        for p, s in chosen:
            stage[p] = s

    def _improve(self, stage: np.ndarray, rate: np.ndarray, fits: np.ndarray) -> None:
        """Single moves into, and swaps with, the slowest stage while they lift it.

        A step is taken only if both changed stages end above the old minimum, so the sorted
        vector of stage rates rises lexicographically and the search terminates.
        """
        num_peers, num_stages = rate.shape
        peers = np.arange(num_peers)
        for _ in range(4 * num_peers):
            assigned = stage >= 0
            own = np.where(assigned, stage, 0)
            totals = stage_totals(stage, rate)
            counts = np.bincount(stage[assigned], minlength=num_stages)
            b = int(np.argmin(totals))
            floor = totals[b] * (1 + _RELATIVE_GAIN)
            own_rate = rate[peers, own]
            source_after = totals[own] - own_rate
            movable = assigned & (stage != b) & (counts[own] >= 2) & fits[:, b]
            gain = np.where(movable, np.minimum(source_after, totals[b] + rate[:, b]), -np.inf)
            best_p, best_q = int(np.argmax(gain)), -1
            best = gain[best_p]
            if num_peers <= SWAP_PEER_LIMIT:
                for q in np.flatnonzero(stage == b).tolist():
                    ok = assigned & (stage != b) & fits[:, b] & fits[q, own]
                    after_src = source_after + rate[q, own]
                    after_dst = totals[b] - rate[q, b] + rate[:, b]
                    swap_gain = np.where(ok, np.minimum(after_src, after_dst), -np.inf)
                    p = int(np.argmax(swap_gain))
                    if swap_gain[p] > best:
                        best, best_p, best_q = swap_gain[p], p, q
            if not best > floor:
                return
            if best_q >= 0:
                stage[best_q] = stage[best_p]
            stage[best_p] = b
