"""The simulated swarm: peers, trainers, links and churn as events; the real policies decide.

What is simulated (time, bytes, failures) and what is policy (decided by the objects real
peers use, imported, never copied):

- a stage peer's compute thread: the next task is `ReadinessQueue.pop` (or `StaticQueue.pop`
  with the static schedule's `expect`), its service times and readiness `ReadinessEstimator`;
- every hop's replica choice: the hop's `ReadinessRouter` (or `RoundRobinRouter`, or
  `StochasticRouter`), fed the readiness each reply carries, banning with its `Bans`;
- a trainer's in-flight window: `InFlightWindow.on_step`;
- the static routes: `schedule.static.assign` and `expected_orders`;
- a step's accounting: `StepLedger`, and at the commit `plan_stage_commit` over what each
  replica reports, whose `missing` microbatches (their gradients died with a peer) are replayed;
- the first layout: `plan_swarm`; a joining peer's stage: `serving_stage`; live re-planning:
  `best_move` and `Rebalancer`.

Simulated: compute seconds from FLOPs (`profiles`), links as serialised uplinks and downlinks
with per-region latency, codecs as bytes, preemptions (a hazard rate, or a trace), stalls,
and the time a caller takes to notice a lost peer (`Scenario.detect_s`). A failure reaches
the caller of the lost peer's hop, which sends the microbatch again from its own stage
(the real hop's retry), so the deepest live part of the route is kept.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections import defaultdict

from swarmtrain.plan.cost_model import PeerCapacity, PlanConfig, transformer_block_cost
from swarmtrain.plan.planner import Plan, plan_swarm
from swarmtrain.plan.rebalance import Rebalancer
from swarmtrain.schedule import (
    InFlightWindow,
    ReadinessEstimator,
    ReadinessQueue,
    ReadinessRouter,
    ReplicaReport,
    RoundRobinRouter,
    StaticQueue,
    StepLedger,
    StochasticRouter,
    Task,
    WindowConfig,
    plan_stage_commit,
)
from swarmtrain.schedule.static import assign, expected_orders
from swarmtrain.sim.churn import Churn
from swarmtrain.sim.engine import Engine
from swarmtrain.sim.profiles import profile, rtt_s
from swarmtrain.sim.scenario import CODEC_BYTES, PeerGroup, Scenario
from swarmtrain.sim.state import Microbatch, SimPeer, SimResult, SimTrainer

RETRY_S = 1.0
"""Seconds a hop waits before asking its router again when every replica is banned or none serves."""
STATIC_WAKE_S = 0.5
"""Seconds after which a static queue that holds work but would not run it is asked again."""


class SimSwarm(Churn):
    """One simulation run; see the module docstring."""

    def __init__(self, scenario: Scenario):
        self.s = scenario
        self.engine = Engine()
        self.rng = random.Random(scenario.seed)
        m = scenario.model
        self.codec_bytes = CODEC_BYTES[scenario.codec]
        self.costs = [
            transformer_block_cost(
                d_model=m.d_model, seq_len=m.seq_len, wire_bytes_per_element=self.codec_bytes
            )
            for _ in range(m.n_layer)
        ]
        tokens = scenario.microbatch_size * m.seq_len
        self.mb_tokens = tokens
        self.num_trainers = scenario.trainers or max(1, math.ceil(scenario.num_peers / 8))
        self.step_microbatches = scenario.microbatches_per_step * self.num_trainers
        stages = len(scenario.service_s) if scenario.service_s else scenario.stages
        self.config = PlanConfig(
            tokens_in_flight=tokens * scenario.max_in_flight,
            tokens_per_step=tokens * self.step_microbatches,
            min_stages=stages or 1,
            max_stages=stages,
        )
        self.activation_bytes = tokens * m.d_model * self.codec_bytes
        self.peers: dict[str, SimPeer] = {}
        self.replicas: dict[int, list[SimPeer]] = defaultdict(list)
        self.version = 0
        self._static_ids: tuple[int, dict] = (-1, {})
        """Bumped whenever a stage's serving replicas change (neighbour views are rebuilt)."""
        self.counters = defaultdict(int)
        self.layout: list[dict] = []
        self.rebalancer = Rebalancer()
        self.step = 0
        self.ledger: StepLedger | None = None
        self.step_started = 0.0
        self.step_timeouts = 0
        self.inflight: dict[str, Microbatch] = {}
        self._replays: set[str] = set()
        self.step_ends: list[float] = []
        """When each step's commit ended."""
        self.tokens_done = 0
        self.samples = defaultdict(list)
        self._bin_tokens = 0
        self._bin_busy = defaultdict(float)
        self._next_id = 0
        self.trainers = [self._trainer(i) for i in range(self.num_trainers)]

    # set-up

    def _router(self, salt: int) -> ReadinessRouter:
        if self.s.policy == "static":
            return RoundRobinRouter()
        if self.s.policy == "stochastic":
            return StochasticRouter(seed=self.s.seed * 1_000_003 + salt)
        return ReadinessRouter()

    def _trainer(self, i: int) -> SimTrainer:
        m = self.s.microbatches_per_step
        window = InFlightWindow(WindowConfig(initial=min(self.s.max_in_flight, m), max_size=m))
        return SimTrainer(id=f"trainer{i}", router=self._router(10**6 + i), window=window)

    def _new_peer(self, group: PeerGroup, region: str | None = None) -> SimPeer:
        p = profile(group.profile)
        pid = f"{group.profile}-{self._next_id:05d}"
        self._next_id += 1
        region = group.region or region or self.s.regions[self._next_id % len(self.s.regions)]
        flops = (group.flops_per_s or p.flops_per_s) / group.slowdown
        bandwidth = group.bandwidth_bytes_per_s or p.bandwidth_bytes_per_s
        capacity = PeerCapacity(
            peer_id=pid,
            flops_per_s=flops,
            memory_bytes=p.memory_bytes,
            bandwidth_bytes_per_s=bandwidth,
            is_spot=group.spot,
        )
        peer = SimPeer(pid, group, region, capacity, flops, bandwidth)
        self.peers[pid] = peer
        if group.spot and self.s.preemption_per_hour > 0:
            self.engine.after(
                self.rng.expovariate(self.s.preemption_per_hour / 3600), self._preempt, peer, peer.epoch
            )
        if self.s.stall_per_hour > 0:
            self.engine.after(
                self.rng.expovariate(self.s.stall_per_hour / 3600), self._stall, peer, peer.epoch
            )
        return peer

    def _start(self) -> Plan:
        for group in self.s.peers:
            for _ in range(group.count):
                self._new_peer(group)
        fixed = {p.id: p.group.stage for p in self.peers.values() if p.group.stage is not None}
        if fixed:  # the scenario lays the stages out itself (as `join --stage`): even blocks
            n = self.config.max_stages or max(fixed.values()) + 1
            blocks = len(self.costs)
            bounds = tuple(round(k * blocks / n) for k in range(n + 1))
            plan = Plan(stage_bounds=bounds, assignments=fixed, trainers=(), throughput_tokens_per_s=0.0,
                        stage_tokens_per_s=(0.0,) * n)  # fmt: skip
        else:
            plan = plan_swarm(self.costs, [p.capacity for p in self.peers.values()], self.config)
        self.bounds = plan.stage_bounds
        self._stage_flops: dict[int, float] = {}
        self.num_stages = plan.num_stages
        for pid, stage in sorted(plan.assignments.items()):
            self._serve(self.peers[pid], stage)
        self.layout.append(
            {"t": 0.0, "event": "plan", "stages": self.num_stages, "peers": len(plan.assignments)}
        )
        for ev in self.s.trace:
            self.engine.at(ev.t, self._trace, ev)
        if self.s.replan:
            self.engine.after(self.s.rebalance_s, self._rebalance)
        self.engine.after(self.s.sample_s, self._sample)
        self._begin_step()
        return plan

    def _serve(self, peer: SimPeer, stage: int) -> None:
        peer.stage, peer.serving, peer.draining_to = stage, True, None
        last = stage == self.num_stages - 1
        peer.estimator = ReadinessEstimator(fused_last=last, now=self.engine.now)
        peer.queue = (
            StaticQueue() if self.s.policy == "static" else ReadinessQueue(budget=self.s.max_in_flight)
        )
        peer.router = None if last else self._router(zlib.crc32(peer.id.encode()))
        peer.held, peer.fresh, peer.tasks, peer.neighbors = {}, set(), {}, {}
        self.replicas[stage].append(peer)
        self.version += 1
        if self.s.policy == "static" and self.ledger is not None:
            self._expect(stage)

    def _unserve(self, peer: SimPeer) -> None:
        if peer.stage is not None and peer in self.replicas[peer.stage]:
            self.replicas[peer.stage].remove(peer)
            self.version += 1
        peer.serving = False

    # links and compute

    def _transfer(self, src, dst, nbytes: float) -> float:
        """When `nbytes` sent now from src arrive at dst: after src's uplink and dst's downlink
        are free, at the slower one's rate, plus half the round trip. A peer's bandwidth is
        both directions together (as `PeerCapacity` and the planner count it): half each way."""
        now = self.engine.now
        start = max(now, src.up_free, dst.down_free)
        done = start + 2 * nbytes / min(src.bandwidth, dst.bandwidth)
        src.up_free = dst.down_free = done
        return done + rtt_s(src.region, dst.region) / 2 + self.s.hop_s

    def _compute_s(self, peer: SimPeer, kind: str) -> float:
        f = self.s.forward_share
        share = f if kind == "forward" else 1 - f if kind == "backward" else 1.0
        if self.s.service_s:
            seconds = self.s.service_s[peer.stage] * share * peer.group.slowdown
        else:
            flops = self._stage_flops.get(peer.stage)
            if flops is None:  # the layout's bounds are fixed for a run: once per stage
                start, stop = self.bounds[peer.stage], self.bounds[peer.stage + 1]
                flops = sum(c.flops_per_token for c in self.costs[start:stop]) * self.mb_tokens
                self._stage_flops[peer.stage] = flops
            seconds = flops * share / peer.flops_per_s
        if self.s.jitter:
            seconds *= math.exp(self.rng.gauss(0.0, self.s.jitter))
        if self.engine.now < peer.stall_until:
            seconds *= self.s.stall_factor
        return seconds

    # the microbatch's way

    def _candidates(self, sender, stage: int) -> list[str]:
        peers = self.replicas.get(stage, [])
        k = self.s.neighbors
        if not k or len(peers) <= k:
            return [p.id for p in peers]
        cached = sender.neighbors.get(stage)
        if cached is None or cached[0] != self.version:
            cached = (self.version, [p.id for p in self.rng.sample(peers, k)])
            sender.neighbors[stage] = cached
        return cached[1]

    def _send_forward(self, mb: Microbatch, stage: int, sender) -> None:
        if mb.epoch < 0 or (isinstance(sender, SimPeer) and not sender.alive):
            return
        router = sender.router
        now = self.engine.now
        prefer = mb.prefer[stage] if mb.prefer else None
        target_id = router.choose(
            self._candidates(sender, stage),
            now,
            nbytes=int(self.activation_bytes),
            order=mb.order,
            prefer=prefer,
        )
        if target_id is None:
            self.counters["waits_for_a_replica"] += 1
            self.engine.after(RETRY_S, self._send_forward, mb, stage, sender)
            return
        target = self.peers[target_id]
        router.sent(target_id, now)
        nbytes = self.activation_bytes if stage > 0 else self.mb_tokens * 8
        arrive = self._transfer(sender, target, nbytes)
        self.engine.at(arrive, self._arrive_forward, mb, mb.epoch, stage, target, target.epoch, sender)

    def _arrive_forward(self, mb, epoch, stage, peer: SimPeer, pepoch, sender) -> None:
        if mb.epoch != epoch:
            return
        if not peer.alive or peer.epoch != pepoch:
            self.engine.after(self.s.detect_s, self._hop_failed, mb, epoch, stage, peer, sender)
            return
        if not peer.serving or peer.stage != stage:  # it refuses at once (draining, or it moved)
            self.engine.after(
                rtt_s(peer.region, sender.region), self._hop_failed, mb, epoch, stage, peer, sender
            )
            return
        del mb.path[stage:]
        mb.path.append(peer)
        mb.route[stage] = peer.id
        kind = "loss" if stage == self.num_stages - 1 else "forward"
        self._push(peer, Task(kind=kind, mb_id=mb.id, step=mb.step, order=mb.order, seq=peer.seq), mb, epoch)

    def _push(self, peer: SimPeer, task: Task, mb, epoch) -> None:
        peer.seq += 1
        peer.tasks[(task.kind, task.mb_id)] = (mb, epoch)
        peer.queue.push(task)
        self._try_start(peer)

    def _try_start(self, peer: SimPeer) -> None:
        if peer.busy or not peer.alive:
            return
        now = self.engine.now
        while True:
            task = peer.queue.pop(len(peer.held), now)
            if task is None:
                if len(peer.queue) and self.s.policy == "static":
                    self.engine.after(STATIC_WAKE_S, self._try_start, peer)
                return
            mb, epoch = peer.tasks.pop((task.kind, task.mb_id), (None, None))
            if mb is not None and mb.epoch == epoch:
                break
            if epoch is not None and peer.held.get(task.mb_id) == epoch:
                del peer.held[task.mb_id]  # its microbatch went another way: nothing to run
        seconds = self._compute_s(peer, task.kind)
        peer.busy = True
        peer.estimator.started(task.kind, now)
        self.engine.after(seconds, self._finish, peer, peer.epoch, task, mb, epoch, seconds)

    def _finish(self, peer: SimPeer, pepoch, task: Task, mb: Microbatch, epoch, seconds) -> None:
        if peer.epoch != pepoch:
            return
        now = self.engine.now
        peer.busy = False
        peer.estimator.finished(seconds, now)
        peer.busy_s += seconds
        self._bin_busy[peer.stage] += seconds
        if mb.epoch == epoch:
            if task.kind == "forward":
                peer.held[mb.id] = epoch
                self._send_forward(mb, peer.stage + 1, peer)
            else:
                peer.held.pop(mb.id, None)
                if mb.id not in peer.fresh:
                    (peer.kept if mb.replay else peer.fresh).add(mb.id)
                self._reply(mb, epoch, peer)
        if peer.draining_to is not None and not peer.busy and not len(peer.queue) and not peer.held:
            self._move(peer)
        else:
            self._try_start(peer)

    def _reply(self, mb: Microbatch, epoch, peer: SimPeer) -> None:
        """The input gradient (or, from stage 0, the result) goes back to the hop's caller,
        with this peer's readiness."""
        stage = peer.stage
        caller = mb.trainer if stage == 0 else mb.path[stage - 1]
        del mb.path[stage:]  # this peer's part is done: losing it no longer touches the microbatch
        queued = peer.queue.kinds()
        readiness = peer.estimator.report(queued, self.engine.now)
        nbytes = self.activation_bytes if stage > 0 else 64
        arrive = self._transfer(peer, caller, nbytes)
        cepoch = caller.epoch if isinstance(caller, SimPeer) else 0
        self.engine.at(arrive, self._arrive_backward, mb, epoch, stage, caller, cepoch, peer.id, readiness)

    def _arrive_backward(self, mb, epoch, stage, caller, cepoch, sender_id, readiness) -> None:
        now = self.engine.now
        if isinstance(caller, SimPeer) and (
            not caller.alive or caller.epoch != cepoch or caller.held.get(mb.id) != epoch
        ):
            return  # the caller died, moved or let the microbatch go: its own caller deals with it
        caller.router.report(sender_id, backlog_s=readiness.backlog_s, service_s=readiness.service_s, now=now)
        caller.router.done(sender_id, now, ok=True)
        if mb.epoch != epoch:
            return
        if isinstance(caller, SimTrainer):
            self._complete(mb)
            return
        self._push(
            caller,
            Task(kind="backward", mb_id=mb.id, step=mb.step, order=mb.order, seq=caller.seq),
            mb,
            epoch,
        )

    def _hop_failed(self, mb: Microbatch, epoch, stage, peer: SimPeer, sender) -> None:
        sender.router.done(peer.id, self.engine.now, ok=False)
        self.step_timeouts += 1
        if mb.epoch != epoch or mb.epoch < 0:
            return
        if isinstance(sender, SimPeer) and (not sender.alive or mb.id not in sender.held):
            return
        self.counters["hop_retries"] += 1
        self.ledger.replay("peer lost")
        mb.replay = True
        if isinstance(sender, SimPeer):
            sender.held[mb.id] = mb.epoch  # its activations serve the retry
        self._send_forward(mb, stage, sender)

    # steps

    def _expect(self, stage: int) -> None:
        ranked = sorted(p.id for p in self.replicas[stage])
        for slot, pid in enumerate(ranked):
            peer = self.peers[pid]
            orders = expected_orders(slot, len(ranked), self.step_microbatches)
            peer.queue.expect(self.step, orders, self.num_stages - stage, fused=stage == self.num_stages - 1)

    def _begin_step(self) -> None:
        n = self.step_microbatches
        ids = [f"{self.step}:{i}" for i in range(n)]
        self.ledger = StepLedger(issued=tuple(ids))
        self.step_started = self.engine.now
        self.step_timeouts = 0
        self._replays = set()
        for p in self.peers.values():
            p.fresh, p.kept = set(), set()
        if self.s.policy == "static":
            for k in range(self.num_stages):
                self._expect(k)
        for i, t in enumerate(self.trainers):  # interleaved, as `train.shards.Shard.positions` splits a step
            t.queue = list(range(i, n, len(self.trainers)))
        self._kick()

    def _kick(self, trainer: SimTrainer | None = None) -> None:
        """Issue microbatches while windows allow: `trainer`'s, or every trainer's."""
        for t in self.trainers if trainer is None else (trainer,):
            while t.queue and t.in_flight < t.window.size:
                self._issue(t, t.queue.pop(0))

    def _issue(self, trainer: SimTrainer, order: int) -> None:
        mb_id = f"{self.step}:{order}"
        mb = Microbatch(id=mb_id, step=self.step, order=order, trainer=trainer, replay=mb_id in self._replays)
        if self.s.policy == "static":
            if self._static_ids[0] != self.version:
                self._static_ids = (self.version, {k: [p.id for p in ps] for k, ps in self.replicas.items()})
            mb.prefer = assign(order, self._static_ids[1], self.num_stages).prefer
        self.inflight[mb.id] = mb
        trainer.in_flight += 1
        self._send_forward(mb, 0, trainer)

    def _complete(self, mb: Microbatch) -> None:
        self.ledger.complete(mb.id, 0.0, tuple(mb.route[k] for k in sorted(mb.route)))
        mb.epoch = -1
        del self.inflight[mb.id]
        mb.trainer.in_flight -= 1
        self.tokens_done += self.mb_tokens
        self._bin_tokens += self.mb_tokens
        if len(self.ledger.losses) == self.step_microbatches:
            self._commit()
        else:
            self._kick(mb.trainer)

    def _commit(self) -> None:
        completed = self.ledger.completed
        missing, slowest = set(), 0.0
        for k in range(self.num_stages):
            live = self.replicas.get(k, [])
            reports = [
                ReplicaReport(peer=p.id, fresh=frozenset(p.fresh), held=frozenset(p.kept)) for p in live
            ]
            plan = plan_stage_commit(completed, reports)
            missing.update(plan.missing)
            if plan.conflicts:
                self.counters["commit_conflicts"] += len(plan.conflicts)
            if self.s.commit_s is not None:
                slowest = self.s.commit_s
            elif len(live) >= 2:
                grad = sum(c.grad_bytes for c in self.costs[self.bounds[k] : self.bounds[k + 1]])
                low = min(p.bandwidth for p in live)
                slowest = max(
                    slowest, self.config.averaging_overhead_s + 2 * grad * (len(live) - 1) / len(live) / low
                )
        if missing:  # their gradients died with a replica: run them again
            self.counters["replayed_for_commit"] += len(missing)
            self.ledger.replay("gradients lost", len(missing))
            for mb_id in sorted(missing):
                del self.ledger.losses[mb_id]
                order = int(mb_id.split(":")[1])
                trainer = self.trainers[order % len(self.trainers)]
                trainer.queue.insert(0, order)
                self._replays.add(mb_id)
            self._kick()
            return
        elapsed = self.engine.now + slowest - self.step_started
        for t in self.trainers:
            t.window.on_step(
                self.mb_tokens * self.s.microbatches_per_step / elapsed, timeouts=self.step_timeouts
            )
        self.step += 1
        self.step_ends.append(round(self.engine.now + slowest, 6))
        self.engine.after(slowest, self._begin_step)

    # the time series

    def _sample(self) -> None:
        now, dt = self.engine.now, self.s.sample_s
        self.samples["t"].append(round(now, 3))
        self.samples["tokens_per_s"].append(self._bin_tokens / dt)
        self._bin_tokens = 0
        util, queues, live = [], [], []
        for k in range(self.num_stages):
            ps = self.replicas.get(k, [])
            util.append(round(self._bin_busy[k] / (len(ps) * dt), 4) if ps else 0.0)
            queues.append(round(sum(len(p.queue) + p.busy for p in ps) / len(ps), 3) if ps else 0.0)
            live.append(len(ps))
        self._bin_busy.clear()
        self.samples["utilisation"].append(util)
        self.samples["queue_depth"].append(queues)
        self.samples["replicas"].append(live)
        self.samples["window"].append(sum(t.window.size for t in self.trainers))
        self.engine.after(dt, self._sample)

    def run(self) -> SimResult:
        started = time.perf_counter()
        plan = self._start()
        self.engine.run(self.s.duration_s)
        wall = time.perf_counter() - started
        counters = dict(sorted(self.counters.items()))
        counters["trainers"] = self.num_trainers
        counters["tokens_per_step"] = self.mb_tokens * self.step_microbatches
        return SimResult(
            scenario=self.s,
            tokens_per_s=self.tokens_done / self.s.duration_s,
            steps=self.step,
            events=self.engine.events,
            wall_s=wall,
            series=dict(self.samples),
            counters=counters,
            layout=self.layout,
            stages=self.num_stages,
            plan_tokens_per_s=plan.throughput_tokens_per_s,
            step_ends=self.step_ends,
        )


def simulate(scenario: Scenario) -> SimResult:
    """Run `scenario` to its `duration_s`; the same scenario (and seed) gives the same result."""
    return SimSwarm(scenario).run()
