"""Several trainers, one run, in one process: disjoint shards counted into the same steps, one
committer per step, and the death of any trainer (the committing one included, at every point
of a step) costing no exactness. Every case checks each position of every step counted exactly
once in every stage or dropped with a cause, and replicas bit-identical; the cases without a
death check parity with single-process training on the run's data order."""

import asyncio
import itertools
import math

import pytest
import torch

from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.inprocess import TRAINER, InProcessConfig, InProcessSwarm
from swarmtrain.train.inprocess_team import InProcessTeam
from swarmtrain.train.reference import stage_state_dict
from swarmtrain.train.shards import Shard
from swarmtrain.train.step_account import LEFT, NOT_FED
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses

B, T, M = 2, TINY_GPT["seq_len"], 4
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
SECOND = f"{TRAINER}-1"
PARAM_ATOL = 1e-4


def manifest(*, stages=(0, 2, 4), microbatches=M, schedule="readiness") -> RunManifest:
    return RunManifest(
        run_id="team",
        model="tiny-gpt",
        model_config=TINY_GPT,
        num_blocks=TINY_GPT["n_layer"],
        stage_bounds=stages,
        optimizer=OPTIMIZER,
        batch=BatchConfig(microbatch_size=B, microbatches_per_step=microbatches, max_in_flight=4),
        schedule=schedule,
    )


def data(steps: int, microbatches: int = M) -> list:
    batches = TokenBatches(stdlib_text(2**18), seq_len=T, microbatch_size=B, seed=0)
    return list(itertools.islice(batches, steps * microbatches))


def run(config: InProcessConfig, steps: int, *, before=None, shards=None, see_others=True):
    """Train `steps` steps with every trainer of `config`; `before(team)` sets faults up."""

    async def scenario():
        async with InProcessSwarm(config) as swarm:
            team = InProcessTeam(swarm, shards=shards, see_others=see_others)
            if before is not None:
                before(team)
            results = await team.train(data(steps, config.manifest.batch.microbatches_per_step), steps)
            return swarm, team, results

    return asyncio.run(scenario())


def assert_accounted(results, per_step: int):
    """Every position of every step counted or dropped with a cause, in every trainer's view."""
    for rs in results.values():
        for r in rs:
            assert r.completed + r.dropped == per_step, r
            assert sum(r.dropped_causes.values()) == r.dropped, r


def assert_replicas_identical(swarm: InProcessSwarm, steps: int):
    m = swarm.manifest
    for k in range(m.num_stages):
        live = swarm.live(k)
        states = [stage_state_dict(swarm.replicas[n].runner.module) for n in live]
        assert all(swarm.replicas[n].runner.step == steps for n in live), [
            swarm.replicas[n].runner.step for n in live
        ]
        for state in states[1:]:
            for key, value in state.items():
                assert torch.equal(value, states[0][key]), f"stage {k}: {key}"


def assert_parity(swarm: InProcessSwarm, results: list, steps: int):
    m = swarm.manifest
    reference = reference_losses(
        seed=m.seed,
        optimizer=m.optimizer,
        batches=iter(data(steps, m.batch.microbatches_per_step)),
        steps=steps,
        microbatches_per_step=m.batch.microbatches_per_step,
    )
    assert_losses_match_reference(results, reference)
    for k in range(m.num_stages):
        for name in swarm.live(k):
            state = stage_state_dict(swarm.replicas[name].runner.module)
            for key, value in state.items():
                torch.testing.assert_close(value, reference.state[key], rtol=0, atol=PARAM_ATOL)


def test_two_trainers_on_disjoint_shards_train_like_one_process():
    config = InProcessConfig(manifest=manifest(), replicas=(2, 1), trainers=2)
    swarm, team, results = run(config, 3)
    assert [r.step for r in results[TRAINER]] == [r.step for r in results[SECOND]] == [0, 1, 2]
    for mine, theirs in zip(results[TRAINER], results[SECOND]):  # one step, seen by both
        assert mine.loss == theirs.loss and mine.completed == theirs.completed == M
        assert mine.replicas_equal is True and theirs.replicas_equal is True
    assert_parity(swarm, results[TRAINER], 3)
    assert_replicas_identical(swarm, 3)
    stage0 = swarm.replicas[swarm.live(0)[0]].started + swarm.replicas[swarm.live(0)[1]].started
    assert {t.mb_id.split(":")[0] for t in stage0} == {TRAINER, SECOND}


def test_trainers_that_do_not_see_each_other_are_settled_by_the_claims():
    # Each takes itself for the committer; the replicas' claims leave every step to one of
    # them (the lower id wins a claim), the other reports to it, and parity holds.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 2), trainers=2)
    swarm, team, results = run(config, 3, see_others=False)
    assert [r.step for r in results[SECOND]] == [0, 1, 2]
    assert all(r.completed == M for r in results[TRAINER] + results[SECOND])
    assert_parity(swarm, results[TRAINER], 3)
    assert_replicas_identical(swarm, 3)


def nth(n: int, match):
    """A match that holds for the `n`-th request `match` holds for (1-based), and only for it."""
    seen = [0]

    def nth_match(sender, receiver, frame) -> bool:
        if match(sender, receiver, frame):
            seen[0] += 1
            return seen[0] == n
        return False

    return nth_match


def phase(name: str, *, step: int, stage: int | None = None):
    return lambda s, r, f: (
        f.kind == "step" and f.meta.get("phase") == name and f.step == step and stage in (None, f.stage)
    )


def forward(*, step: int):
    return lambda s, r, f: f.kind == "forward" and f.step == step


def only_second_after(results, step: int):
    """After `step`, the second trainer trains alone: the first's positions are not fed."""
    for r in results[SECOND][step + 1 :]:
        assert r.completed == M // 2 and r.dropped_causes == {NOT_FED: M // 2}, r


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(forward(step=1), id="mid-flow"),
        pytest.param(phase("prepare", step=1), id="at-prepare"),
        pytest.param(phase("exchange", step=1), id="mid-exchange"),
    ],
)
def test_the_committer_dies_and_the_other_trainer_commits_its_step(where):
    config = InProcessConfig(manifest=manifest(), replicas=(2, 2), trainers=2)
    swarm, team, results = run(config, 3, before=lambda team: team.kill_when(TRAINER, nth(2, where)))
    assert TRAINER in team.dead and len(results[TRAINER]) == 1
    assert [r.step for r in results[SECOND]] == [0, 1, 2]
    assert_accounted(results, M)
    step1 = results[SECOND][1]
    mine = M // 2  # the second trainer's own microbatches all count
    assert step1.completed >= mine and step1.completed - step1.adopted == mine
    assert set(step1.dropped_causes) <= {LEFT, NOT_FED}, step1.dropped_causes
    assert all(r.replicas_equal is True for r in results[SECOND]), [r.replicas_equal for r in results[SECOND]]
    only_second_after(results, 1)
    assert_replicas_identical(swarm, 3)


def test_a_committer_that_dies_mid_apply_leaves_the_step_to_be_applied_everywhere_with_its_scale(caplog):
    # It applied step 1 on stage 0 and died before stage 1: the other trainer finds the step
    # applied there, applies it on stage 1 with the same scale, and nothing is lost: two steps
    # of every microbatch, as in one process.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 2), trainers=2)
    swarm, team, results = run(
        config, 2, before=lambda team: team.kill_when(TRAINER, phase("apply", step=1, stage=1))
    )
    assert TRAINER in team.dead
    assert [r.step for r in results[SECOND]] == [0, 1]
    assert results[SECOND][1].completed == M and results[SECOND][1].dropped == 0
    assert_replicas_identical(swarm, 2)
    assert "was applied on some replicas only" in caplog.text
    m = swarm.manifest
    reference = reference_losses(
        seed=m.seed, optimizer=m.optimizer, batches=iter(data(2)), steps=2, microbatches_per_step=M
    )
    for k in range(m.num_stages):
        for name in swarm.live(k):
            for key, value in stage_state_dict(swarm.replicas[name].runner.module).items():
                torch.testing.assert_close(value, reference.state[key], rtol=0, atol=PARAM_ATOL)


def test_a_feeder_that_dies_after_its_microbatches_completed_still_counts_them():
    # The second trainer dies as it reports step 1: its microbatches are in every stage, so
    # they count (adopted, no loss known) and the step is the whole step, as in one process.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 1), trainers=2)
    swarm, team, results = run(
        config,
        2,
        before=lambda team: team.kill_when(SECOND, lambda s, r, f: f.kind == "report" and f.step == 1),
    )
    assert SECOND in team.dead
    step1 = results[TRAINER][1]
    assert step1.completed == M and step1.adopted == M // 2 and step1.dropped == 0
    assert math.isfinite(step1.loss)
    m = swarm.manifest
    reference = reference_losses(
        seed=m.seed, optimizer=m.optimizer, batches=iter(data(2)), steps=2, microbatches_per_step=M
    )
    for name in swarm.live(0) + swarm.live(1):
        for key, value in stage_state_dict(swarm.replicas[name].runner.module).items():
            torch.testing.assert_close(value, reference.state[key], rtol=0, atol=PARAM_ATOL)


def test_a_feeder_that_dies_mid_flow_leaves_its_unfinished_microbatches_dropped_with_a_cause():
    config = InProcessConfig(manifest=manifest(), replicas=(2, 1), trainers=2)
    swarm, team, results = run(config, 3, before=lambda team: team.kill_when(SECOND, nth(2, forward(step=1))))
    assert SECOND in team.dead
    assert [r.step for r in results[TRAINER]] == [0, 1, 2]
    assert_accounted(results, M)
    step1 = results[TRAINER][1]
    assert step1.completed - step1.adopted == M // 2 and step1.dropped >= 1
    assert set(step1.dropped_causes) <= {LEFT, NOT_FED}
    for r in results[TRAINER][2:]:
        assert r.completed == M // 2 and r.dropped_causes == {NOT_FED: M // 2}
    assert_replicas_identical(swarm, 3)


def test_a_replica_lost_with_both_trainers_work_is_repaired_by_each_trainer():
    # s1r0 dies as the first commit starts: the microbatches it counted are replayed, each by
    # the trainer that fed it (the committer asks the other to, in its outcome). The static
    # schedule routes positions 0 and 3 (one of each trainer) to s1r0 of three replicas.
    config = InProcessConfig(manifest=manifest(schedule="static"), replicas=(1, 3), trainers=2)

    def before(team):
        team.swarm.network.on_delivery(phase("prepare", step=0), lambda: team.swarm.kill("s1r0"))

    swarm, team, results = run(config, 2, before=before)
    assert "s1r0" in swarm.dead
    lost = swarm.replicas["s1r0"].tasks["loss"]
    replayed = {
        name: rs[0].replay_causes.get("lost with a replica (repaired at commit)", 0)
        for name, rs in results.items()
    }
    assert replayed == {TRAINER: 1, SECOND: 1} and lost == 2, (replayed, lost)
    assert_parity(swarm, results[TRAINER], 2)


def test_a_trainer_of_the_run_that_never_runs_leaves_its_shard_unfed_and_the_step_goes_on():
    config = InProcessConfig(manifest=manifest(), replicas=(1, 1), trainers=2)
    swarm, team, results = run(config, 2, before=lambda team: team.kill(SECOND))
    assert results[SECOND] == []
    for r in results[TRAINER]:
        assert r.completed == M // 2 and r.dropped_causes == {NOT_FED: M // 2}


def test_overlapping_shards_are_refused_in_one_clear_line():
    config = InProcessConfig(manifest=manifest(), replicas=(1, 1), trainers=2)
    with pytest.raises(
        Exception, match=r"overlaps shard 0/2 of trainer .*give every trainer of the run its own --shard"
    ):
        run(config, 1, shards={TRAINER: Shard(0, 2), SECOND: Shard(0, 2)})
