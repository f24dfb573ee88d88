"""The readiness policies, pure: ready queues, the readiness estimate, routing and bans, the
in-flight window, the commit accounting, and the compute runtime that drives a queue."""

import asyncio
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.errors import ConfigError
from swarmtrain.schedule import (
    BanConfig,
    Bans,
    InFlightWindow,
    ReadinessConfig,
    ReadinessEstimator,
    ReadinessQueue,
    ReadinessRouter,
    ReplicaReport,
    RoundRobinRouter,
    RouterConfig,
    StaticQueue,
    StepLedger,
    Task,
    WindowConfig,
    in_flight_budget,
    one_f_one_b,
    plan_stage_commit,
)
from swarmtrain.schedule.routing import ReplicaView
from swarmtrain.schedule.runtime import ComputeScheduler


def task(kind, order, step=0, seq=0):
    return Task(kind=kind, mb_id=f"t:{step}:{order}", step=step, order=order, seq=seq)


# ready queues


def test_readiness_queue_runs_backward_first_then_forward_in_hint_order():
    q = ReadinessQueue(budget=8)
    for i, t in enumerate([task("forward", 3), task("forward", 1), task("backward", 2), task("forward", 2)]):
        q.push(Task(**{**t.__dict__, "seq": i}))
    assert [(t.kind, t.order) for t in iter(lambda: q.pop(holding=0), None)] == [
        ("backward", 2),
        ("forward", 1),
        ("forward", 2),
        ("forward", 3),
    ]


def test_readiness_queue_holds_forwards_at_the_budget_but_not_backwards_or_loss_tasks():
    q = ReadinessQueue(budget=2)
    q.push(task("forward", 0))
    assert q.pop(holding=2) is None  # full: the forward waits
    q.push(task("loss", 5))
    assert q.pop(holding=2).kind == "loss"  # holds nothing afterwards: may run
    q.push(task("backward", 9))
    assert q.pop(holding=2).kind == "backward"
    assert q.pop(holding=1).order == 0


def test_in_flight_budget_from_free_memory():
    assert in_flight_budget(10 * 2**20, 2**20) == 8  # 20% kept spare
    assert in_flight_budget(2**10, 2**20) == 1  # always one
    assert in_flight_budget(2**40, 2**20, cap=16) == 16


def test_one_f_one_b_order():
    assert one_f_one_b([0, 1, 2, 3], warmup=2) == [
        ("forward", 0),
        ("forward", 1),
        ("backward", 0),
        ("forward", 2),
        ("backward", 1),
        ("forward", 3),
        ("backward", 2),
        ("backward", 3),
    ]
    assert one_f_one_b([1, 3], warmup=4, fused=True) == [("loss", 1), ("loss", 3)]


@given(st.lists(st.integers(0, 50), unique=True, min_size=1, max_size=12), st.integers(1, 6))
def test_one_f_one_b_runs_each_microbatch_forward_then_backward(orders, warmup):
    seq = one_f_one_b(orders, warmup)
    assert sorted(seq) == sorted([("forward", n) for n in orders] + [("backward", n) for n in orders])
    for n in orders:
        assert seq.index(("forward", n)) < seq.index(("backward", n))
    # never more forwards outstanding than the warmup allows
    outstanding = 0
    for kind, _ in seq:
        outstanding += 1 if kind == "forward" else -1
        assert outstanding <= max(warmup, 1)


def test_static_queue_waits_for_the_fixed_order_then_gives_up_after_the_grace():
    q = StaticQueue(grace_s=1.0)
    q.expect(0, [0, 1], warmup=1, fused=False)  # F0 B0 F1 B1
    q.push(task("forward", 1, seq=1))
    assert q.pop(holding=0, now=0.0) is None  # F0 first, even though F1 is ready
    q.push(task("forward", 0, seq=2))
    assert q.pop(0, now=0.1).order == 0
    assert q.pop(0, now=0.2) is None  # B0 is next
    assert q.pop(0, now=1.3).order == 1  # B0 never came: the order is abandoned


# the readiness estimate


def test_service_times_are_moving_averages_per_kind():
    est = ReadinessEstimator(fused_last=False, now=0.0, config=ReadinessConfig(service_alpha=0.5))
    assert est.service_s == 0 and est.report([], now=0.0).service_s == 0  # nothing measured yet
    est.started("forward", now=0.0)
    est.finished(2.0, now=2.0)
    assert est.service_of("forward") == 2.0  # the first run sets the average
    est.started("forward", now=2.0)
    est.finished(1.0, now=3.0)
    assert est.service_of("forward") == 1.0  # the second replaces it: the first run was cold
    est.started("forward", now=3.0)
    est.finished(3.0, now=6.0)
    assert est.service_of("forward") == 2.0  # then they average: 1 + 0.5 x (3 - 1)
    est.started("backward", now=6.0)
    est.finished(1.0, now=7.0)
    assert est.service_s == 3.0  # forward + backward
    assert est.busy_s == 7.0 and est.tasks_run == 4


def test_backlog_counts_queued_tasks_and_what_remains_of_the_running_one():
    est = ReadinessEstimator(fused_last=False, now=0.0)
    for kind, seconds in [("forward", 1.0), ("backward", 2.0)]:
        est.started(kind, now=0.0)
        est.finished(seconds, now=0.0)
    est.started("backward", now=10.0)
    queued = ["forward", "forward", "backward"]
    ready = est.report(queued, now=10.5)
    assert ready.queue_depth == 4  # three queued, one running
    assert ready.backlog_s == 1 + 1 + 2 + (2 - 0.5)
    assert est.backlog_s([], now=13.0) == 0  # a task running past its average adds nothing
    est.finished(3.0, now=13.0)
    assert est.report([], now=13.0).queue_depth == 0 and est.backlog_s([], now=13.0) == 0


def test_an_idle_peer_reports_its_best_service_time_only_after_the_idle_period():
    est = ReadinessEstimator(fused_last=False, now=0.0, config=ReadinessConfig(idle_optimism_s=2.0))
    est.started("forward", now=0.0)
    est.finished(1.0, now=1.0)
    assert est.report([], now=10.0).service_s == 1.0  # no best yet: backward never measured
    est.started("backward", now=10.0)
    est.finished(1.0, now=11.0)  # best: 2 s
    for kind, t in [("forward", 11.0), ("backward", 14.0)]:  # the device throttles
        est.started(kind, now=t)
        est.finished(3.0, now=t + 3.0)
    assert est.service_s == 6.0  # each kind's second run replaces its first: 3 + 3
    assert est.report([], now=17.0).service_s == 6.0  # just finished
    assert est.report([], now=19.0).service_s == 6.0  # idle for exactly the period: not yet
    assert est.report([], now=19.5).service_s == 2.0  # idle for longer: its best
    assert est.report(["forward"], now=19.5).service_s == 6.0  # work waiting: not idle
    est.started("forward", now=20.0)
    assert est.report([], now=30.0).service_s == 6.0  # a task running: not idle


def test_the_last_stage_times_its_fused_loss_tasks():
    est = ReadinessEstimator(fused_last=True, now=0.0, config=ReadinessConfig(idle_optimism_s=0.0))
    est.started("loss", now=0.0)
    est.finished(3.0, now=3.0)
    est.started("loss", now=3.0)
    est.finished(5.0, now=8.0)
    assert est.service_s == 5.0 and est.service_of("forward") == 0  # the second replaced the first
    assert est.report([], now=9.0).service_s == 3.0  # idle: the best loss time
    assert est.report(["loss"], now=9.0).backlog_s == 5.0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"service_alpha": 0}, "service_alpha must be in \\(0, 1\\], got 0"),
        ({"service_alpha": 1.5}, "service_alpha must be in \\(0, 1\\], got 1.5"),
        ({"idle_optimism_s": -1}, "idle_optimism_s must be a finite number >= 0, got -1"),
    ],
)
def test_readiness_config_says_what_is_wrong(fields, message):
    with pytest.raises(ConfigError, match=message):
        ReadinessConfig(**fields)


# routing and bans


def test_bans_back_off_exponentially_up_to_a_cap_and_clear_on_success():
    bans = Bans(BanConfig(base_s=1, factor=2, max_s=5))
    assert bans.fail("a", now=0) == 1
    assert bans.fail("a", now=0.5) == pytest.approx(0.5)  # already banned: not lengthened
    assert bans.fail("a", now=2) == 2
    assert bans.fail("a", now=10) == 4
    assert bans.fail("a", now=20) == 5
    assert bans.is_banned("a", 24.9) and not bans.is_banned("a", 25.1)
    bans.succeed("a")
    assert bans.fail("a", now=30) == 1


def test_router_prefers_the_replica_expected_to_finish_first():
    r = ReadinessRouter()
    r.report("fast", backlog_s=0.2, service_s=0.1, now=0)
    r.report("slow", backlog_s=0.0, service_s=0.4, now=0)
    assert r.expected_s("fast", 0) == pytest.approx(0.3)
    assert r.expected_s("slow", 0) == pytest.approx(0.4)
    assert r.choose(["fast", "slow"], now=0) == "fast"
    assert r.expected_s("fast", 0.15) == pytest.approx(0.15)  # its backlog drains as time passes
    r.report("fast", backlog_s=0.5, service_s=0.1, now=0.2)
    assert r.choose(["fast", "slow"], now=0.2) == "slow"


def test_router_spreads_work_in_proportion_to_speed():
    r = ReadinessRouter()
    r.report("a", backlog_s=0, service_s=0.1, now=0)
    r.report("b", backlog_s=0, service_s=0.4, now=0)
    picks = []
    for _ in range(10):
        peer = r.choose(["a", "b"], now=0)
        r.sent(peer, now=0)
        picks.append(peer)
    assert picks.count("a") == 8 and picks.count("b") == 2  # 4x faster, about 4x the work


def test_router_skips_banned_replicas_and_answers_none_when_all_are():
    r = ReadinessRouter()
    r.report("a", backlog_s=0, service_s=0.1, now=0)
    r.report("b", backlog_s=0, service_s=0.5, now=0)
    r.sent("a", 0)
    assert r.done("a", 0, ok=False) == 1.0
    assert r.choose(["a", "b"], now=0.5) == "b"
    r.sent("b", 0.5)
    r.done("b", 0.5, ok=False)
    assert r.choose(["a", "b"], now=0.6) is None
    assert r.bans.next_unban(["a", "b"], 0.6) == pytest.approx(0.4)
    assert r.choose(["a", "b"], now=1.1) == "a"


def test_router_probes_a_replica_it_has_not_used_for_a_while():
    r = ReadinessRouter()
    r.report("a", backlog_s=0, service_s=0.1, now=0)
    r.report("b", backlog_s=0, service_s=1.0, now=0)  # it was slow
    r.sent("b", now=0)
    r.done("b", now=0, ok=True)
    for t in (0.5, 1.0, 2.0):
        peer = r.choose(["a", "b"], now=t)
        assert peer == "a"
        r.sent(peer, t)
        r.done(peer, t, ok=True)
    assert r.choose(["a", "b"], now=3.5) == "b"  # nothing sent to b for over 3 s: probe it


def test_router_probes_a_replica_passed_over_for_probe_every_microbatches():
    """A fast swarm routes many microbatches a second: one slow measurement (a cold first task,
    a hiccup of the machine) must not keep a replica idle for seconds."""
    r = ReadinessRouter(RouterConfig(probe_every=4))
    r.report("a", backlog_s=0, service_s=0.01, now=0)
    r.report("b", backlog_s=0, service_s=1.0, now=0)  # one slow measurement
    r.sent("b", now=0)
    r.done("b", now=0, ok=True)
    picks = []
    for i in range(10):
        now = i * 0.01  # far less than stale_after_s
        peer = r.choose(["a", "b"], now=now)
        r.sent(peer, now)
        r.done(peer, now, ok=True)
        picks.append(peer)
    assert picks[:5] == ["a"] * 4 + ["b"]  # probed after probe_every microbatches elsewhere
    r.report("b", backlog_s=0, service_s=0.012, now=0.1)  # the probe found it fast: a cold start
    picks = []
    for i in range(10):
        now = 0.2 + i * 0.01
        peer = r.choose(["a", "b"], now=now)
        r.sent(peer, now)
        r.done(peer, now, ok=True)
        picks.append(peer)
    assert "b" in picks[:3], picks  # as good as a again: it gets work
    r.sent("b", 1.0)  # b still busy with a microbatch: not probed again until it answers
    assert all(r.choose(["a", "b"], now=1.0 + i * 0.01) == "a" for i in range(8))


def test_a_replica_that_stays_much_slower_is_probed_ever_more_rarely():
    """Each microbatch on a replica 100x slower holds up its step: while probes keep finding it
    that slow, they come after 4, 8, 16, ... microbatches elsewhere (at most 16x apart)."""
    r = ReadinessRouter(RouterConfig(probe_every=4))
    r.report("a", backlog_s=0, service_s=0.01, now=0)
    r.report("b", backlog_s=0, service_s=1.0, now=0)
    picks = []
    for i in range(200):
        now = i * 0.001  # far less than stale_after_s
        peer = r.choose(["a", "b"], now=now)
        r.sent(peer, now)
        r.done(peer, now, ok=True)
        picks.append(peer)
    probes = [i for i, p in enumerate(picks) if p == "b"]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]
    assert probes[0] == 1  # never sent to: probed at once (time-based)
    assert gaps == [4, 8, 16, 32, 64, 64], probes
    # a replica 3x slower (within probe_max_slowdown) is probed every probe_every microbatches
    r.report("b", backlog_s=0, service_s=0.03, now=1.0)
    picks = []
    for i in range(20):
        now = 1.0 + i * 0.001
        peer = r.choose(["a", "b"], now=now)
        r.sent(peer, now)
        r.done(peer, now, ok=True)
        picks.append(peer)
    assert picks.count("b") >= 3, picks


@pytest.mark.parametrize(
    "fields", [{"probe_every": 0}, {"probe_every": 2.5}, {"stale_after_s": 0}, {"probe_max_slowdown": 0.5}]
)
def test_router_config_says_what_is_wrong(fields):
    with pytest.raises(ValueError, match="need stale_after_s > 0, an integer probe_every >= 1"):
        RouterConfig(**fields)


def test_router_keeps_a_preferred_replica_while_it_is_allowed():
    r = ReadinessRouter()
    r.report("a", backlog_s=0, service_s=0.1, now=0)
    r.report("b", backlog_s=9, service_s=1.0, now=0)
    assert r.choose(["a", "b"], now=0, prefer="b") == "b"
    r.sent("b", 0)
    r.done("b", 0, ok=False)
    assert r.choose(["a", "b"], now=0, prefer="b") == "a"


def test_round_robin_router_is_static():
    r = RoundRobinRouter()
    assert [r.choose(["c", "a", "b"], now=0, order=n) for n in range(4)] == ["a", "b", "c", "a"]
    r.sent("b", 0)
    r.done("b", 0, ok=False)
    assert r.choose(["c", "a", "b"], now=0, order=1) == "c"


# the in-flight window


def test_window_grows_while_throughput_grows_and_halves_on_timeouts():
    w = InFlightWindow(WindowConfig(initial=2, max_size=8, probe_every=100))
    assert w.on_step(100) == 3  # first step: try one more
    assert w.on_step(150) == 4  # it paid: again
    assert w.on_step(200) == 5
    assert w.on_step(201) == 4  # no gain: undo and hold
    assert w.on_step(200) == 4
    assert w.on_step(210, timeouts=1) == 2


def test_window_probes_upward_again_after_a_steady_spell():
    w = InFlightWindow(WindowConfig(initial=2, max_size=8, probe_every=3))
    w.on_step(100)  # -> 3
    w.on_step(100)  # no gain -> 2
    sizes = [w.on_step(100) for _ in range(3)]
    assert sizes == [2, 2, 3]


# accounting


def test_commit_plan_counts_each_microbatch_once():
    completed = {"m0", "m1", "m2", "m3"}
    plan = plan_stage_commit(
        completed,
        [
            ReplicaReport(peer="A", fresh=frozenset({"m0", "m1"}), held=frozenset({"m2"})),
            ReplicaReport(peer="B", fresh=frozenset({"m2"}), held=frozenset({"m1", "m3"})),
        ],
    )
    assert plan.ready
    assert plan.take == {"A": (), "B": ("m3",)}  # m2 is in B's buffer, m1 in A's: held copies dropped


def test_commit_plan_finds_missing_and_conflicting_microbatches():
    plan = plan_stage_commit(
        {"m0", "m1"},
        [
            ReplicaReport(peer="A", fresh=frozenset({"m0", "x9"}), held=frozenset()),
            ReplicaReport(peer="B", fresh=frozenset({"m0"}), held=frozenset()),
        ],
    )
    assert plan.missing == ("m1",)
    assert plan.conflicts == ("m0", "x9")  # in two buffers; in a buffer without completing
    assert not plan.ready


def test_ledger_accounts_for_every_microbatch():
    ledger = StepLedger(issued=("a", "b", "c"))
    ledger.complete("a", 2.0, ("p0", "p1"))
    ledger.replay("timeout")
    ledger.drop("b", "non-finite loss")
    assert ledger.unaccounted() == ["c"]
    ledger.complete("c", 1.0, ("p0", "p2"))
    assert ledger.unaccounted() == [] and ledger.routed_to(1) == {"p1", "p2"}


# the runtime


TICK_S = 0.001


async def until(condition, timeout_s: float = 5.0) -> None:
    """Poll `condition` on the event loop until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting on the scheduler"
        await asyncio.sleep(TICK_S)


def test_scheduler_runs_tasks_in_policy_order_and_reports_readiness():
    gate = threading.Event()
    order = []

    async def main():
        sched = ComputeScheduler(ReadinessQueue(budget=8), holding=lambda: 0, fused_last=False)
        started = threading.Event()

        def blocked() -> None:
            started.set()
            gate.wait()

        blocker = asyncio.ensure_future(sched.run(task("forward", 0), blocked))
        # it runs, blocked on the gate (queued but not yet started, a busy machine could let
        # the backward below overtake it: the thread would then never block with all queued)
        await until(started.is_set)
        assert sched.readiness()["queue_depth"] == 1
        jobs = [
            asyncio.ensure_future(sched.run(task(kind, n), order.append, (kind, n)))
            for kind, n in [("forward", 2), ("forward", 1), ("backward", 5)]
        ]
        await until(lambda: sched.readiness()["queue_depth"] == 4)  # all three queued behind it
        gate.set()
        await asyncio.gather(blocker, *jobs)
        assert await sched.call(lambda: "admin") == "admin"
        with pytest.raises(ZeroDivisionError):
            await sched.run(task("backward", 7), lambda: 1 / 0)
        ready = sched.readiness()
        sched.close()
        return ready, sched.busy_s

    ready, busy = asyncio.run(main())
    assert order == [("backward", 5), ("forward", 1), ("forward", 2)]
    assert ready["queue_depth"] == 0 and ready["service_s"] > 0 and busy > 0


def test_an_idle_scheduler_reports_the_best_service_time_it_has_shown():
    factor = {"now": 1.0}
    idle_s = 3600.0

    async def main():
        sched = ComputeScheduler(
            ReadinessQueue(budget=8),
            holding=lambda: 0,
            fused_last=True,
            slowdown=lambda: factor["now"],
            readiness=ReadinessConfig(idle_optimism_s=idle_s),
        )
        await sched.run(task("loss", 0), time.sleep, 0.01)
        best = sched.service_s
        factor["now"] = 4.0  # the device throttles: its average rises
        await sched.run(task("loss", 1), time.sleep, 0.01)
        busy_report = sched.readiness()["service_s"]
        idle_report = sched.readiness(now=time.monotonic() + idle_s + 1)["service_s"]
        sched.close()
        return best, busy_report, idle_report

    best, busy_report, idle_report = asyncio.run(main())
    assert busy_report > 1.5 * best  # recently active: its real, slower average
    assert idle_report == pytest.approx(best, abs=1e-6)  # idle for a while: its best, inviting work


def _reference_choose(router, candidates, now, *, nbytes=0, prefer=None):
    """ReadinessRouter.choose as its rules read, one helper per rule (the router inlines them)."""
    from swarmtrain.schedule.routing import _expected

    allowed = sorted(p for p in set(candidates) if not router.bans.is_banned(p, now))
    if not allowed:
        return None
    if prefer in allowed:
        return prefer
    views = [router.view(p) for p in allowed]
    known = sorted(v.service_s for v in views if v.service_s is not None)
    default = known[len(known) // 2] if known else 0.0
    best = min(zip(allowed, views), key=lambda pv: (_expected(pv[1], now, nbytes, default), pv[0]))[0]
    stale = router.config.stale_after_s
    idle = [
        p
        for p, v in zip(allowed, views)
        if not router.outstanding.get(p) and (now - v.last_sent > stale or router._due_for_probe(p, best))
    ]
    chosen = best
    if idle and best not in idle:
        chosen = min(idle, key=lambda p: (router.view(p).last_sent, p))
    if chosen != best and now - router.view(chosen).last_sent <= stale:
        router.view(chosen).slow_probes += 1
    for v in views:
        v.passed_over += 1
    router.view(chosen).passed_over = 0
    return chosen


_view = st.fixed_dictionaries(
    {
        "backlog_s": st.floats(0, 5),
        "service_s": st.one_of(st.none(), st.floats(0.01, 4)),
        "reported_at": st.one_of(st.just(float("-inf")), st.floats(0, 20)),
        "sent_since_report": st.integers(0, 4),
        "last_sent": st.one_of(st.just(float("-inf")), st.floats(0, 20)),
        "passed_over": st.integers(0, 80),
        "slow_probes": st.integers(0, 6),
        "bandwidth_bytes_per_s": st.one_of(st.none(), st.floats(1e5, 1e9)),
        "outstanding": st.integers(0, 2),
        "banned_until": st.one_of(st.none(), st.floats(0, 30)),
    }
)


@given(
    views=st.dictionaries(st.sampled_from("abcdefghij"), _view, min_size=1, max_size=10),
    extra=st.lists(st.sampled_from("abcdefghijklm"), max_size=4),
    now=st.floats(0, 25),
    nbytes=st.sampled_from([0, 10**6]),
    prefer=st.one_of(st.none(), st.sampled_from("abk")),
)
def test_the_router_choice_is_its_rules_written_out(views, extra, now, nbytes, prefer):
    # The router inlines `_expected` and `_due_for_probe` for speed: on any state it must pick
    # the same replica and leave the same probe counters as the rules applied one by one.
    import copy

    router = ReadinessRouter()
    for peer, fields in views.items():
        fields = dict(fields)
        outstanding, until = fields.pop("outstanding"), fields.pop("banned_until")
        router.views[peer] = ReplicaView(**fields)
        if outstanding:
            router.outstanding[peer] = outstanding
        if until is not None:
            router.bans._until[peer] = until
    candidates = list(views) + extra + list(views)[:1]  # unknown and repeated peers too
    twin = copy.deepcopy(router)
    assert router.choose(candidates, now, nbytes=nbytes, prefer=prefer) == _reference_choose(
        twin, candidates, now, nbytes=nbytes, prefer=prefer
    )
    assert router.views == twin.views
