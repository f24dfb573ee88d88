"""Who is in the simulated swarm: preemptions, stalls, traces, joins and live re-planning.

`Churn` is the part of `SimSwarm` (swarmtrain.sim.swarm) that changes membership; a joining
peer's stage is the real join rule's (`serving_stage`), a move the real re-planner's
(`best_move` through `Rebalancer`).
"""

from __future__ import annotations

from swarmtrain.plan.cost_model import PeerCapacity
from swarmtrain.plan.join import serving_stage
from swarmtrain.plan.planner import Plan
from swarmtrain.plan.rebalance import best_move
from swarmtrain.sim.scenario import PeerGroup
from swarmtrain.sim.state import SimPeer


class Churn:
    """Membership changes of a `SimSwarm` (a mixin: it uses the swarm's engine, peers and replicas)."""

    def _lose(self, peer: SimPeer, why: str) -> None:
        """`peer` is gone (preempted, or left): its callers learn after detect_s."""
        peer.alive = False
        peer.epoch += 1
        peer.busy = False
        self._unserve(peer)
        self.layout.append(
            {"t": round(self.engine.now, 3), "event": why, "peer": peer.id, "stage": peer.stage}
        )
        self.counters[why] += 1
        for mb in list(self.inflight.values()):
            if peer not in mb.path:
                continue
            j = mb.path.index(peer)
            for later in mb.path[j:]:
                later.held.pop(mb.id, None)
            caller = mb.trainer if j == 0 else mb.path[j - 1]
            del mb.path[j:]
            mb.epoch += 1
            self.engine.after(self.s.detect_s, self._hop_failed, mb, mb.epoch, j, peer, caller)

    def _preempt(self, peer: SimPeer, epoch: int) -> None:
        if not peer.alive or peer.epoch != epoch:
            return
        self._lose(peer, "preempted")
        back = self.rng.expovariate(1 / self.s.downtime_s)
        self.engine.after(back, self._join, peer.group, peer.region)

    def _stall(self, peer: SimPeer, epoch: int) -> None:
        if not peer.alive or peer.epoch != epoch:
            return
        peer.stall_until = self.engine.now + self.s.stall_s
        self.counters["stalls"] += 1
        self.engine.after(self.rng.expovariate(self.s.stall_per_hour / 3600), self._stall, peer, epoch)

    def _trace(self, ev) -> None:
        if ev.action == "join":
            for _ in range(ev.count):
                self._join(PeerGroup(profile=ev.profile, count=1, spot=True))
            return
        live = [p for p in self.peers.values() if p.alive and p.group.profile == ev.profile]
        for peer in live[: ev.count]:
            self._lose(peer, "left")

    def _current_plan(self) -> Plan:
        assignments = {p.id: p.stage for ps in self.replicas.values() for p in ps}
        return Plan(
            stage_bounds=self.bounds,
            assignments=assignments,
            trainers=(),
            throughput_tokens_per_s=0.0,
            stage_tokens_per_s=(0.0,) * self.num_stages,
        )

    def _serving_capacities(self) -> list[PeerCapacity]:
        return [p.capacity for ps in self.replicas.values() for p in ps]

    def _join(self, group: PeerGroup, region: str | None = None) -> None:
        peer = self._new_peer(group, region)
        try:
            stage = serving_stage(
                self._current_plan(), self.costs, self._serving_capacities(), self.config, peer.capacity
            )
        except Exception as e:  # fits no stage: it stays out, as a real peer would be refused
            self.layout.append(
                {"t": round(self.engine.now, 3), "event": "refused", "peer": peer.id, "why": str(e)}
            )
            peer.alive = False
            return
        self.counters["joined"] += 1
        self.layout.append({"t": round(self.engine.now, 3), "event": "join", "peer": peer.id, "stage": stage})
        self.engine.after(self.s.move_s, self._arrive, peer, peer.epoch, stage)

    def _arrive(self, peer: SimPeer, epoch: int, stage: int) -> None:
        if peer.alive and peer.epoch == epoch:
            self._serve(peer, stage)
            self._kick()

    def _rebalance(self) -> None:
        serving = [p for ps in self.replicas.values() for p in ps]
        checks = (
            serving
            if len(serving) <= self.s.rebalance_checks
            else self.rng.sample(serving, self.s.rebalance_checks)
        )
        plan, caps = self._current_plan(), self._serving_capacities()
        for peer in sorted(checks, key=lambda p: p.id):
            if peer.stage is None or not peer.serving:
                continue
            move = self.rebalancer.observe(peer.id, best_move(plan, self.costs, caps, self.config, peer.id))
            if move is not None and len(self.replicas[peer.stage]) >= 2:
                self._unserve(peer)
                peer.draining_to = move.to_stage
                self.layout.append(
                    {
                        "t": round(self.engine.now, 3),
                        "event": "move",
                        "peer": peer.id,
                        "from": move.from_stage,
                        "to": move.to_stage,
                    }
                )
                self.counters["moves"] += 1
                if not peer.busy and not len(peer.queue) and not peer.held:
                    self._move(peer)
                break  # one move per check: the next check sees the new layout
        self.engine.after(self.s.rebalance_s, self._rebalance)

    def _move(self, peer: SimPeer) -> None:
        to = peer.draining_to
        peer.draining_to = None
        peer.epoch += 1
        self.engine.after(self.s.move_s, self._arrive, peer, peer.epoch, to)
