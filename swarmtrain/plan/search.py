"""The planner's two alternating steps, over peers indexed in peer-id order.

- `cut`: given which peers replicate each stage, the contiguous boundaries that maximise the
  slowest stage's rate with every replica's memory respected (exact dynamic programming over
  block boundaries).
- `assign`: given boundaries, which stage each peer replicates: cover every stage first
  (scarcest stage first, non-spot peers first, augmenting paths where needed), then each
  remaining peer to the slowest stage it fits (least flexible peers first, then fastest),
  with averaging a trim of each stage's worst-linked replicas (and a refill with them), then
  single moves and swaps that lift the slowest stage (local search).

A stage's rate is `CostModel.stage_rate` of its replicas (vectorised here as `Problem.rates`):
their summed rate, less the gradient averaging when the config sets `tokens_per_step`. With
averaging an extra replica can slow a stage (fixed overhead, or a slower link), so a peer is
placed only where it does not, and the local search may also return a peer to training.

An assignment is a list with one entry per peer: its stage index, or -1 for a trainer.
Everything here is deterministic: ties go to the lower peer index and the lower stage index.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from swarmtrain.plan.cost_model import CostModel, PeerCapacity, PlanConfig, usable_memory

TRAINER = -1
SWAP_PEER_LIMIT = 128
"""Swaps are tried only in swarms up to this many peers; beyond it single moves suffice."""
ARRAY_CACHE_SIZE = 256
"""Cuts whose (rate, fits) arrays a Problem keeps; the search revisits the same cuts often."""
MATRIX_CACHE_SIZE = 512
"""Replica sets whose span-rate matrix a Problem keeps (the anchor cuts reuse single peers)."""
_RELATIVE_GAIN = 1e-9
"""A local-search step must lift the slowest stage by this fraction, so float noise cannot cycle."""
FILL_SCAN_STAGES = 4
"""With averaging, a peer that would slow the slowest stage it fits tries at most this many
stages (slowest first) before it is left a trainer."""
AVERAGING_STEP_LIMIT = 64
"""With averaging, local search in swarms over this many peers takes at most this many steps
(one peer each; the trim before it does the bulk moves)."""


def rate_sums(stage: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """Each stage's summed replica rate (S,), in peer order, for an assignment `stage` (P,)."""
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
        has_traffic = self.cell_traffic > 0
        self._cell_traffic_or_1 = np.where(has_traffic, self.cell_traffic, 1.0)  # (i, j)
        # compute-bound iff flops/bandwidth <= F/B (inf: no traffic, always compute-bound)
        self._cell_threshold = np.where(has_traffic, self.cell_flops / self._cell_traffic_or_1, np.inf)
        grad = np.asarray(model.grad)
        self.cell_grad = np.where(self.valid, grad[stops] - grad[starts], 0.0)  # (i, j)
        self.averages = model.averages
        self._arrays: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        self._matrices: dict[bytes, np.ndarray] = {}

    # -- the stage-rate model, vectorised -------------------------------------------------------

    def rates(self, sums, counts, min_bandwidth, grad):
        """`CostModel.stage_rate`, elementwise over broadcastable arrays (same float operations).

        sums: summed replica rates; counts: replicas; min_bandwidth: slowest replica link
        (anything where counts < 2); grad: the stage's gradient bytes.
        """
        if not self.averages:
            return sums
        counts = np.asarray(counts)
        with np.errstate(divide="ignore", invalid="ignore"):
            averaging = (
                self.model.averaging_overhead_s
                + 2.0 * grad * (counts - 1) / np.maximum(counts, 1) / min_bandwidth
            )
        averaging = np.where(counts >= 2, averaging, 0.0)
        return sums / (1.0 + sums * averaging / self.model.tokens_per_step)

    def _rate(self, rate_sum: float, count: int, min_bandwidth: float, grad: float) -> float:
        """`rates` for one stage, in plain floats (the fill's inner loop)."""
        if count < 2 or not self.averages:
            return rate_sum
        averaging = self.model.averaging_overhead_s + 2.0 * grad * (count - 1) / count / min_bandwidth
        return rate_sum / (1.0 + rate_sum * averaging / self.model.tokens_per_step)

    def links(self, stage: np.ndarray, num_stages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stage (S,): the slowest replica bandwidth, the peer holding it, and the second
        slowest (what is left when that peer leaves); inf and -1 where there is none.

        Ties go to the lower peer index. Without averaging nothing is computed (all inf / -1).
        """
        low = np.full(num_stages, np.inf)
        holder = np.full(num_stages, -1)
        second = np.full(num_stages, np.inf)
        if not self.averages:
            return low, holder, second
        members = np.flatnonzero(stage >= 0)
        if members.size == 0:
            return low, holder, second
        order = members[np.lexsort((members, self.bandwidth[members], stage[members]))]
        stages = stage[order]
        first = np.flatnonzero(np.concatenate(([True], stages[1:] != stages[:-1])))
        low[stages[first]] = self.bandwidth[order[first]]
        holder[stages[first]] = order[first]
        nxt = first + 1
        pair = nxt < order.size
        pair[pair] = stages[nxt[pair]] == stages[first[pair]]
        second[stages[first[pair]]] = self.bandwidth[order[nxt[pair]]]
        return low, holder, second

    def slowest_links(self, stage: np.ndarray, num_stages: int) -> np.ndarray:
        """Per stage (S,): the slowest replica bandwidth, inf for none (`links`' first array)."""
        low = np.full(num_stages, np.inf)
        if self.averages:
            members = stage >= 0
            np.minimum.at(low, stage[members], self.bandwidth[members])
        return low

    def stage_totals(self, bounds: tuple[int, ...], stage: np.ndarray) -> np.ndarray:
        """Each stage's rate (S,) under the model, for an assignment `stage` (P,) to `bounds`."""
        rate, _ = self.stage_arrays(bounds)
        num_stages = rate.shape[1]
        sums = rate_sums(stage, rate)
        if not self.averages:
            return sums
        counts = np.bincount(stage[stage >= 0], minlength=num_stages)
        return self.rates(sums, counts, self.slowest_links(stage, num_stages), self.stage_grad(bounds))

    def stage_grad(self, bounds: tuple[int, ...]) -> np.ndarray:
        """Gradient bytes (S,) a replica of each stage of `bounds` averages."""
        return self.cell_grad[np.asarray(bounds[:-1]), np.asarray(bounds[1:])]

    def throughput_bound(self, num_stages: int) -> float:
        """An upper bound on the throughput of any plan with `num_stages` stages (non-increasing in it).

        Each token crosses num_stages - 1 cuts, and each cut costs the two replicas beside it
        2 x (boundary bytes) apiece, so stage rate tau needs tau x 4 x (S - 1) x (smallest
        boundary) bytes/s, out of the summed bandwidth of peers that fit at least one block.
        The compute bound, tau x (FLOPs of the model) <= summed FLOP/s, holds too. Averaging
        only lowers stage rates, so both stay upper bounds with it (loose ones).
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
        """Rate of a stage replicated by `members` (sorted) for every span (i, j); -inf where it
        cannot be. Cached per replica set; callers must not write to it."""
        key = members.tobytes()
        if key not in self._matrices:
            if len(self._matrices) >= MATRIX_CACHE_SIZE:
                self._matrices.pop(next(iter(self._matrices)))
            self._matrices[key] = self._span_rates(members)
        return self._matrices[key]

    def _span_rates(self, members: np.ndarray) -> np.ndarray:
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
        k = np.searchsorted(ratio, self._cell_threshold, side="right")
        network = (bandwidth_prefix[-1] - bandwidth_prefix[k]) / self._cell_traffic_or_1
        rate = flops_prefix[k] / self.cell_flops + network
        if self.averages and members.size >= 2:
            # `rates` with one replica count and link for every span, its scalars folded together
            count, model = members.size, self.model
            per_byte = 2.0 * (count - 1) / count / self.bandwidth[members].min()
            averaging = (model.averaging_overhead_s + self.cell_grad * per_byte) / model.tokens_per_step
            rate = rate / (1.0 + rate * averaging)
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
        silent = traffic == 0  # one stage for the whole model: nothing crosses the wire
        network = self.bandwidth[:, None] / np.where(silent, 1.0, traffic)[None, :]
        rate = np.minimum(compute, network)  # (P, S)
        if silent.any():
            rate[:, silent] = compute[:, silent]
        fits = self.memory[:, None] >= self.cell_memory[starts, stops][None, :]  # (P, S)
        return rate, fits

    def assign(
        self, bounds: tuple[int, ...], start: list[int] | None = None, *, local_search: bool = True
    ) -> list[int]:
        """Assign peers to the stages of `bounds`, keeping `start`'s placements where given.

        Peers of `start` that no longer fit their stage, or are trainers there, are placed anew.
        Peers that fit no stage stay trainers; with averaging, so do peers that would slow
        every stage they tried.
        """
        rate, fits = self.stage_arrays(bounds)
        num_peers, num_stages = rate.shape
        stage = np.full(num_peers, TRAINER)
        if start is not None:
            kept = np.asarray(start)
            ok = kept >= 0
            ok[ok] = fits[np.flatnonzero(ok), kept[ok]]
            stage[ok] = kept[ok]
        grad = self.stage_grad(bounds)
        self._cover(stage, rate, fits)
        self._fill(stage, rate, fits, grad)
        if self.averages:
            trimmed = self._trim(stage, rate, grad)
            if trimmed.size:
                self._fill(stage, rate, fits, grad, trimmed)
        if local_search:
            self._improve(stage, rate, fits, grad)
        return stage.tolist()

    def assign_exact(self, bounds: tuple[int, ...]) -> list[int]:
        """The best assignment for `bounds` by enumerating every peer's options (small swarms only).

        Among equally good assignments the first in enumeration order wins; then any peer left
        out that fits a stage (and, with averaging, slows none it would join) is added, as in `assign`.
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
        grad = self.stage_grad(bounds)
        if self.averages:
            counts = np.zeros(totals.shape, dtype=np.int64)
            low = np.full(totals.shape, np.inf)
            for p in range(num_peers):
                counts[rows, table[:, p]] += 1
                low[rows, table[:, p]] = np.minimum(low[rows, table[:, p]], self.bandwidth[p])
            totals = self.rates(totals, counts, low, np.append(grad, 0.0))
        best = int(np.argmax(totals[:, :num_stages].min(axis=1)))
        stage = table[best].copy()
        self._fill(stage, rate, fits, grad)
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

    def _fill(
        self,
        stage: np.ndarray,
        rate: np.ndarray,
        fits: np.ndarray,
        grad: np.ndarray,
        waiting: np.ndarray | None = None,
    ) -> None:
        """Place the remaining peers (or only the trainers among `waiting`), each on the slowest stage it fits.

        Peers that fit the fewest stages go first (they have no choice; the others can then
        top up the stages only they fit), faster peers first among equals. With averaging a
        peer joins only a stage it does not slow: the slowest such among the FILL_SCAN_STAGES
        slowest it fits; if there is none it stays a trainer.
        """
        free = (stage == TRAINER) & fits.any(axis=1)
        waiting = np.flatnonzero(free) if waiting is None else waiting[free[waiting]]
        if waiting.size == 0:
            return
        num_stages, averages = rate.shape[1], self.averages
        sums = rate_sums(stage, rate).tolist()
        totals = sums  # rates simply add: a stage's rate is its sum
        if averages:
            counts = np.bincount(stage[stage >= 0], minlength=num_stages).tolist()
            low = self.slowest_links(stage, num_stages).tolist()
            grad = grad.tolist()
            totals = [self._rate(sums[s], counts[s], low[s], grad[s]) for s in range(num_stages)]
            overhead, tokens = self.model.averaging_overhead_s, self.model.tokens_per_step
            bandwidth = self.bandwidth.tolist()
        # A peer fits the stages needing at most its memory, so the number of stages it fits
        # names the set. Peers with the same set share a heap of (stage total, stage); totals
        # only grow (a peer never joins a stage it would slow), so an entry is stale iff its
        # total is no longer the stage's: dropped lazily.
        keys = fits[waiting].sum(axis=1).tolist()
        heaps: dict[int, list[tuple[float, int]]] = {}
        holders: list[list[int]] = [[] for _ in totals]  # stage -> keys of the heaps with it
        for p, key in zip(waiting.tolist(), keys, strict=True):
            if key not in heaps:
                members = np.flatnonzero(fits[p]).tolist()
                heaps[key] = sorted((totals[s], s) for s in members)
                for s in members:
                    holders[s].append(key)
        order = np.lexsort((-self.flops[waiting], keys))  # fewest stages first, then fastest
        # With averaging, the fastest link among peers of each heap turned away so far: an earlier
        # (so no slower) peer with at least this one's link was refused, so this one would likely
        # be too (a stage's rate only rises with the replica's rate and link); it is not tried.
        refused = dict.fromkeys(heaps, -math.inf)
        pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
        chosen = []
        for p, key in zip(waiting[order].tolist(), [keys[i] for i in order.tolist()], strict=True):
            if averages:
                link = bandwidth[p]
                if link <= refused[key]:
                    continue
            heap, s, tried = heaps[key], None, []
            while heap:
                total, t = heap[0]
                if total != totals[t]:
                    pop(heap)
                    continue
                r = float(rate[p, t])
                after = sums[t] + r
                if averages and counts[t] >= 1:  # `_rate` inlined: with this peer, >= 2 replicas
                    n = counts[t] + 1
                    averaging = overhead + 2.0 * grad[t] * (n - 1) / n / min(low[t], link)
                    after = after / (1.0 + after * averaging / tokens)
                if after >= total:
                    s = t
                    break
                tried.append(pop(heap))
                if len(tried) >= FILL_SCAN_STAGES:
                    break
            if s is None:  # only with averaging
                for entry in tried:
                    push(heap, entry)
                refused[key] = max(refused[key], link)
                continue
            chosen.append((p, s))
            if averages:
                sums[s] += r
                counts[s] += 1
                low[s] = min(low[s], link)
            totals[s] = after
            replace(heap, (after, s))  # s is this heap's top: no stale entry left behind
            for entry in tried:
                push(heap, entry)
            for other in holders[s]:
                if other != key:
                    push(heaps[other], (after, s))
        for p, s in chosen:
            stage[p] = s

    def _trim(self, stage: np.ndarray, rate: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """With averaging: in each stage keep only the replicas whose links are at least as fast
        as the k-th fastest, for the k that gives the stage its highest rate (or only its fastest
        replica, if that is better still); the others become trainers, and are returned (sorted).

        A peer on a slow link drags the whole stage's averaging down, which the fill (one peer
        at a time, each where it does not slow a stage) cannot undo.
        """
        members = np.flatnonzero(stage >= 0)
        if members.size == 0:
            return members
        stages = stage[members]
        own = rate[members, stages]
        order = np.lexsort((members, -own, -self.bandwidth[members], stages))  # fastest links first
        members, stages, own = members[order], stages[order], own[order]
        first = np.flatnonzero(np.concatenate(([True], stages[1:] != stages[:-1])))
        sizes = np.diff(np.append(first, members.size))
        start = np.repeat(first, sizes)
        prefix = np.cumsum(own)
        prefix = prefix - prefix[start] + own[start]  # summed rate of each stage's k best-linked replicas
        count = np.arange(members.size) - start + 1
        value = self.rates(prefix, count, self.bandwidth[members], grad[stages])
        whole = value[first + sizes - 1]  # every replica kept
        best_value = np.maximum.reduceat(value, first)
        best_single = np.maximum.reduceat(own, first)
        cut = np.flatnonzero(np.maximum(best_value, best_single) > whole * (1 + _RELATIVE_GAIN))
        if cut.size == 0:
            return cut
        before = stage >= 0
        for g in cut.tolist():
            lo, hi = first[g], first[g] + sizes[g]
            if best_single[g] > best_value[g]:
                keep = lo + int(np.argmax(own[lo:hi]))
                stage[members[lo:hi]] = TRAINER
                stage[members[keep]] = stages[lo]
            else:
                k = lo + int(np.argmax(value[lo:hi]))
                stage[members[k + 1 : hi]] = TRAINER
        return np.flatnonzero(before & (stage == TRAINER))

    def _improve(self, stage: np.ndarray, rate: np.ndarray, fits: np.ndarray, grad: np.ndarray) -> None:
        """Single moves into, and swaps with, the slowest stage while they lift it; with
        averaging also a replica of the slowest stage returning to training, and trainers
        moving in (or swapping in for one of its replicas).

        A step is taken only if every changed stage ends above the old minimum, so the sorted
        vector of stage rates rises lexicographically and the search terminates.
        """
        num_peers, num_stages = rate.shape
        peers = np.arange(num_peers)
        bandwidth, averages = self.bandwidth, self.averages
        steps = 4 * num_peers
        if averages and num_peers > AVERAGING_STEP_LIMIT:
            steps = AVERAGING_STEP_LIMIT
        for _ in range(steps):
            assigned = stage >= 0
            own = np.where(assigned, stage, 0)
            sums = rate_sums(stage, rate)
            counts = np.bincount(stage[assigned], minlength=num_stages)
            own_rate = rate[peers, own]
            if averages:
                low, holder, second = self.links(stage, num_stages)
                totals = self.rates(sums, counts, low, grad)
                b = int(np.argmin(totals))
                without = np.where(holder[own] == peers, second[own], low[own])  # own stage's link, p gone
                source_after = np.where(
                    assigned, self.rates(sums[own] - own_rate, counts[own] - 1, without, grad[own]), np.inf
                )
                joined = self.rates(
                    sums[b] + rate[:, b], counts[b] + 1, np.minimum(low[b], bandwidth), grad[b]
                )
                movable = (~assigned | ((stage != b) & (counts[own] >= 2))) & fits[:, b]
            else:  # the same with rates that simply add (and no trainer fits a stage: the fill placed all)
                totals = sums
                b = int(np.argmin(totals))
                source_after = totals[own] - own_rate
                joined = totals[b] + rate[:, b]
                movable = assigned & (stage != b) & (counts[own] >= 2) & fits[:, b]
            floor = totals[b] * (1 + _RELATIVE_GAIN)
            gain = np.where(movable, np.minimum(source_after, joined), -np.inf)
            best_p, best_q = int(np.argmax(gain)), -1
            best = gain[best_p]
            if num_peers <= SWAP_PEER_LIMIT:
                for q in np.flatnonzero(stage == b).tolist():
                    if averages:
                        ok = (~assigned | ((stage != b) & fits[q, own])) & fits[:, b]
                        after_src = np.where(
                            assigned,
                            self.rates(
                                sums[own] - own_rate + rate[q, own],
                                counts[own],
                                np.minimum(without, bandwidth[q]),
                                grad[own],
                            ),
                            np.inf,
                        )
                        q_without = second[b] if holder[b] == q else low[b]
                        after_dst = self.rates(
                            sums[b] - rate[q, b] + rate[:, b],
                            counts[b],
                            np.minimum(q_without, bandwidth),
                            grad[b],
                        )
                    else:
                        ok = assigned & (stage != b) & fits[:, b] & fits[q, own]
                        after_src = source_after + rate[q, own]
                        after_dst = totals[b] - rate[q, b] + rate[:, b]
                    swap_gain = np.where(ok, np.minimum(after_src, after_dst), -np.inf)
                    p = int(np.argmax(swap_gain))
                    if swap_gain[p] > best:
                        best, best_p, best_q = swap_gain[p], p, q
            drop = -1
            if averages and counts[b] >= 2:
                members = np.flatnonzero(stage == b)
                left = np.where(holder[b] == members, second[b], low[b])
                after = self.rates(sums[b] - rate[members, b], counts[b] - 1, left, grad[b])
                k = int(np.argmax(after))
                if after[k] > best:
                    best, drop = after[k], int(members[k])
            if not best > floor:
                return
            if drop >= 0:
                stage[drop] = TRAINER
                continue
            if best_q >= 0:
                stage[best_q] = stage[best_p]
            stage[best_p] = b
