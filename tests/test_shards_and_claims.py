"""Pure rules of a run with several trainers: disjoint shards and where a trainer's data stands,
the claim on a step's commit, orphans of a trainer that left, and a step's account."""

import pytest

from swarmtrain.errors import ConfigError
from swarmtrain.schedule import ReplicaReport
from swarmtrain.schedule.accounting import orphans
from swarmtrain.train.claims import StepClaim
from swarmtrain.train.shards import WHOLE, Shard, ShardFeed, default_shard
from swarmtrain.train.step_account import LEFT, NOT_COUNTED, NOT_FED, Share, account


def test_shards_split_the_run_order_into_disjoint_interleaved_shares():
    shards = [Shard(i, 3) for i in range(3)]
    assert [s.positions(6) for s in shards] == [(0, 3), (1, 4), (2, 5)]
    run_order = list(range(30))  # 5 steps of 6
    fed = [ShardFeed.from_run_order(run_order, s, 6) for s in shards]
    for step in range(5):
        together = sorted(x for f in fed for x in f.take(step))
        assert together == run_order[6 * step : 6 * step + 6]  # exactly one trainer's step, no repeats
    assert all(f.take(5) is None for f in fed)  # the data ran out
    assert WHOLE.positions(4) == (0, 1, 2, 3)


def test_a_feed_skips_the_shares_of_the_steps_the_run_did_without_it():
    feed = ShardFeed.from_run_order(range(100), Shard(1, 2), 4)
    assert feed.take(0) == [1, 3]
    assert feed.take(3) == [13, 15]  # steps 1 and 2 were done without this trainer: never fed
    with pytest.raises(ConfigError, match="step 2's data was fed or skipped"):
        feed.take(2)
    own = ShardFeed(iter("abcdefgh"), share=2, first_step=5)  # a trainer's own stream from step 5
    assert own.take(5) == ["a", "b"] and own.take(7) == ["e", "f"]
    own.relabel(9)  # a rollback: what it took last goes into step 9
    assert own.take(10) == ["g", "h"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1", "is not I/N"),
        ("a/b", "is not I/N"),
        ("2/2", "I must be in 0..1"),
        ("0/0", "--shard 0/0: N must be >= 1"),
    ],
)
def test_bad_shards_are_one_clear_line(text, match):
    with pytest.raises(ConfigError, match=match):
        Shard.parse(text)


def test_a_shard_count_must_divide_the_step():
    with pytest.raises(ConfigError, match=r"shard 0/3 cannot feed an even share of a step of 4.*--shard I/2"):
        Shard(0, 3).positions(4)
    assert Shard.parse(" 1/2").overlaps(Shard(0, 4), 4) is False
    assert Shard(1, 2).overlaps(Shard(3, 4), 4) is True


def test_the_default_shard_is_the_trainers_place_in_the_manifest():
    assert default_shard(("B", "A", "C"), "A") == Shard(1, 3)
    assert default_shard((), "anyone") == WHOLE
    with pytest.raises(ConfigError, match="not one the run authorizes"):
        default_shard(("B",), "A")


def test_one_trainer_holds_a_steps_claim():
    claim = StepClaim()
    assert claim.take(4, "m") and claim.holder_of(4) == "m" and claim.holder_of(5) == ""
    assert not claim.take(4, "z")  # a higher id waits its turn
    assert not claim.allows(4, "z") and claim.allows(4, "m")
    assert claim.take(4, "b")  # a lower id is the rightful committer
    assert claim.take(4, "z", replaces=("b",))  # b was found gone: z takes over...
    assert not claim.take(4, "b")  # ...and b, back, cannot take it again by its lower id
    assert claim.take(5, "b")  # a new step, a new claim
    assert StepClaim().allows(3, "q")  # nobody holds it: the phase claims it


def report(peer, fresh=(), held=()):
    return ReplicaReport(peer=peer, fresh=frozenset(fresh), held=frozenset(held))


def test_an_orphan_counts_when_every_stage_holds_it():
    reports = {
        0: [report("a", fresh={"x:1.0:0", "x:1.0:1", "y:1.0:2"})],
        1: [report("b", fresh={"x:1.0:0", "y:1.0:2"}), report("c", held={"x:1.0:1"})],
        2: [report("d", fresh={"x:1.0:0", "y:1.0:2"})],
    }
    complete, partial = orphans(reports, lambda mb: mb.startswith("x:"))
    assert complete == {"x:1.0:0"} and partial == {"x:1.0:1"}


def test_a_steps_account_names_a_cause_for_every_position_it_did_not_count():
    mine = Share(
        trainer="a", issued=("a:3.0:0", "a:3.0:2"), losses={"a:3.0:0": 2.0}, dropped={"a:3.0:2": "refused"}
    )
    left = Share(trainer="b", issued=("b:3.0:1", "b:3.0:3"), losses={"b:3.0:1": 4.0, "b:3.0:3": 6.0})
    committed = account(
        step=3,
        total=6,
        counted=frozenset({"a:3.0:0", "b:3.0:1"}),
        shares=[mine, left],
        gone=frozenset({"b"}),
        adopted=frozenset({"b:3.0:1"}),
        stranded=frozenset({"c:3.0:4"}),
    )
    assert committed.loss == 3.0 and committed.adopted == 1
    assert committed.dropped_causes == {"refused": 1, LEFT: 2, NOT_FED: 1}
    assert len(committed.counted) + committed.dropped == 6
    late = account(
        step=3,
        total=2,
        counted=frozenset({"a:3.0:0"}),
        shares=[Share(trainer="a", issued=("a:3.0:0", "a:3.0:1"))],
    )
    assert late.dropped_causes == {NOT_COUNTED: 1}
