"""Pure policy of the protocol: the commit decision over every stage's replica reports, and the
static schedule's slots (built, read and routed by one rule)."""

from swarmtrain.schedule import CommitAction, ReplicaReport, RoundRobinRouter, decide_commit
from swarmtrain.schedule.static import assign, expected_orders, round_robin
from swarmtrain.wire.messages import NO_PREFERENCE

ISSUED = ("t:0:0", "t:0:1", "t:0:2", "t:0:3")
DONE = set(ISSUED)


def report(peer, fresh=(), held=()):
    return ReplicaReport(peer=peer, fresh=frozenset(fresh), held=frozenset(held))


def test_every_microbatch_once_per_stage_means_exchange():
    reports = {
        0: [report("a", ISSUED[:2]), report("b", ISSUED[2:])],
        1: [report("c", ISSUED[:3], held=[ISSUED[3]])],
    }
    d = decide_commit(ISSUED, DONE, reports)
    assert d.action == CommitAction.EXCHANGE and not d.repairs
    assert d.plans[1].take == {"c": (ISSUED[3],)}


def test_a_stage_without_live_replicas_means_wait():
    d = decide_commit(ISSUED, DONE, {0: [report("a", ISSUED)], 1: [], 2: []})
    assert d.action == CommitAction.WAIT and d.stages == (1, 2)


def test_inexact_buffers_mean_abort_of_that_stage_only():
    twice = {0: [report("a", ISSUED)], 1: [report("c", ISSUED), report("d", ISSUED[:1])]}
    d = decide_commit(ISSUED, DONE, twice)
    assert d.action == CommitAction.ABORT and d.stages == (1,)
    uncompleted = {0: [report("a", ISSUED)], 1: [report("c", ISSUED)]}
    d = decide_commit(ISSUED, DONE - {ISSUED[0]}, uncompleted)
    assert d.action == CommitAction.ABORT and d.stages == (0, 1)


def test_lost_microbatches_are_repaired_from_the_replicas_that_still_hold_them():
    # Stage 1's replica that held microbatches 0 and 1 died; stage 0 still has them (in a's
    # buffer and b's held copies), stage 2 in e's buffer.
    reports = {
        0: [report("a", ISSUED[:1] + ISSUED[2:]), report("b", held=ISSUED[1:2])],
        1: [report("d", ISSUED[2:])],
        2: [report("e", ISSUED)],
    }
    d = decide_commit(ISSUED, DONE, reports)
    assert d.action == CommitAction.REPAIR
    assert [r.mb for r in d.repairs] == list(ISSUED[:2])  # in issue order
    first, second = d.repairs
    assert first.prefer == ("a", None, "e") and first.needed_by == (1,)
    assert second.prefer == ("b", None, "e") and second.needed_by == (1,)


def test_static_slots_are_built_read_and_routed_by_one_rule():
    replicas = {0: ["p2", "p1"], 1: ["q1"], 2: []}
    for n in range(6):
        a = assign(n, replicas, 3)
        assert a.prefer[0] == ["p1", "p2"][n % 2] and a.prefer[1] == "q1" and a.prefer[2] == NO_PREFERENCE
        assert a.slots == (n % 2, 0, 0) and a.slot_counts == (2, 1, 1)
        # the replica the slot names expects this microbatch...
        assert n in expected_orders(a.slots[0], a.slot_counts[0], 6)
        # ...and a router without the route picks the same one
        assert RoundRobinRouter().choose(replicas[0], 0.0, order=n) == a.prefer[0]
    assert expected_orders(1, 2, 6) == [1, 3, 5] and round_robin(5, 2) == 1
