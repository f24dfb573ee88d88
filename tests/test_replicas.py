"""Several peers per stage: gradients averaged with hivemind, identical replicas after every
step, joins that download state mid-run, and leaves (SIGTERM, kill -9) that training survives."""

import signal
from collections import Counter

import pytest
import torch

from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import (
    TINY_GPT,
    assert_losses_match_reference,
    assert_replicas_verified,
    reference_losses,
    wait_until,
)

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

SEED = 11
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=4, max_in_flight=4)
STILL = ("--rebalance-every", "0")  # peers stay on their stage: the layout is the test's
MOST_STEPS = 20
"""Most steps a test trains while it waits for the swarm to use a new replica, which keeps
every run under 30 steps: the parameters are compared with one process's at atol 1e-4, and
summing the same gradients in another order keeps them that close for under 30 steps of this
run only (Adam turns the rounding noise of gradients that are zero in exact arithmetic, the
attention key biases', into steps of their own; after ~36 steps the two runs part)."""


def batches():
    return TokenBatches(stdlib_text(2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=4, seed=SEED)


def replica_names(swarm, stage: int) -> list[str]:
    return [n for n, p in swarm.procs.items() if n.startswith(f"stage{stage}-") and p.poll() is None]


def states_of(swarm, trainer, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    return {name: trainer.fetch_state(stage, swarm.wait_ready(name)) for name in replica_names(swarm, stage)}


def assert_replicas_equal(states: dict[str, dict[str, torch.Tensor]]) -> None:
    (first, ref), *others = states.items()
    for name, state in others:
        assert state.keys() == ref.keys()
        for key in ref:
            assert torch.equal(state[key], ref[key]), f"{name} differs from {first} in {key}"


def worked(results, stage: int) -> set[str]:
    """Peers of `stage` that completed at least one microbatch in any of `results`."""
    return {peer for r in results for peer, count in r.work[stage].items() if count > 0}


def assert_every_microbatch_counted(results, num_stages: int) -> None:
    """Every step completed all its microbatches and dropped none; each stage's work per replica
    adds up to the completed microbatches; the replays by cause add up to the replays."""
    for r in results:
        assert r.completed == BATCH.microbatches_per_step and r.dropped == 0, r
        assert sorted(r.work) == list(range(num_stages)), r
        for k, per_peer in r.work.items():
            assert sum(per_peer.values()) == r.completed, f"step {r.step}, stage {k}: {per_peer}"
        assert sum(r.replay_causes.values()) == r.replays, r


def assert_matches_reference(results, steps: int):
    """The swarm's step losses equal single-process training's; returns the reference run."""
    reference = reference_losses(
        seed=SEED,
        optimizer=OPTIMIZER,
        batches=batches(),
        steps=steps,
        microbatches_per_step=BATCH.microbatches_per_step,
    )
    assert_losses_match_reference(results, reference)
    return reference


def test_replicated_stage_matches_single_process_and_replicas_stay_equal(local_swarm):
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={k: STILL for k in range(2)},
    )
    # a second replica of stage 1, from the start (downloads the seed state)
    swarm.spawn_stage(1, extra_args=STILL)
    data = batches()
    with swarm.trainer(verify_replicas=True) as trainer:
        replicas = {swarm.wait_ready(name) for name in replica_names(swarm, 1)}
        results = list(trainer.train(data, steps=3))
        while worked(results, 1) != replicas and len(results) < MOST_STEPS:
            results += trainer.train(data, steps=1)  # until stage 0 has seen and used both
        stage1 = states_of(swarm, trainer, 1)
        stage0 = trainer.fetch_state(0, swarm.wait_ready(replica_names(swarm, 0)[0]))

        def exchange_s() -> dict[int, list[float]]:
            out: dict[int, list[float]] = {}
            for r in trainer.node.peers(trainer.manifest.run_id):
                if r.role == "stage":
                    out.setdefault(r.stage, []).append(r.exchange_s)
            return out

        # the replicas measured what their exchange costs a step (the planner's averaging
        # overhead); stage 0's one peer never exchanged
        wait_until(lambda: min(exchange_s()[1]) > 0, timeout_s=30, what="stage 1's exchange seconds")
        assert exchange_s()[0] == [0.0] and max(exchange_s()[1]) < 30
    assert len(replicas) == 2 and len(stage1) == 2
    assert_replicas_equal(stage1)
    # Every step that compared both replicas' digests found them equal, and the last did.
    assert results[-1].replicas_compared[1] == 2, [r.replicas_compared for r in results]
    assert all(r.replicas_equal is True for r in results if r.replicas_compared[1] == 2)
    assert_every_microbatch_counted(results, 2)
    # Both replicas took microbatches, and the averaged step equals one process's step.
    assert worked(results, 1) == replicas, [r.work[1] for r in results]
    reference = assert_matches_reference(results, len(results))
    merged = stage0 | next(iter(stage1.values()))
    for key, value in reference.state.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-4)


def test_join_mid_run_downloads_state_and_leaves_do_not_stop_training(local_swarm):
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={k: STILL for k in range(2)},
    )
    data = batches()
    with swarm.trainer(verify_replicas=True) as trainer:
        first = list(trainer.train(data, steps=3))

        # Join mid-run: the new replica serves the trained parameters, not a fresh init.
        joiner = swarm.spawn_stage(1, extra_args=STILL)
        assert_replicas_equal(states_of(swarm, trainer, 1))
        more = list(trainer.train(data, steps=3))
        states = states_of(swarm, trainer, 1)
        assert joiner in states and len(states) == 2
        assert_replicas_equal(states)

        # SIGTERM: the peer drains, deregisters and exits 0 within a few seconds.
        leaver = replica_names(swarm, 1)[0]
        swarm.signal(leaver, signal.SIGTERM)
        assert swarm.procs[leaver].wait(timeout=15) == 0
        after_leave = list(trainer.train(data, steps=2))

        # kill -9 of a whole peer (its DHT process and daemon too) as its first forward
        # starts: a replica of stage 0 that joins now, which the trainer tries at once (a
        # replica it has sent nothing gets the next microbatch). That microbatch is replayed,
        # and the steps complete on the replica left.
        victim = swarm.spawn_stage(0, extra_args=(*STILL, "--inject-fault", "kill:forward:1"))
        after_kill, reaped_at = [], None
        for result in trainer.train(data, steps=MOST_STEPS):  # until the fault hits, and 2 steps more
            after_kill.append(result)
            if reaped_at is None and swarm.procs[victim].poll() is not None:
                reaped_at = len(after_kill) - 1
            if reaped_at is not None and len(after_kill) == reaped_at + 3:
                break
        assert reaped_at is not None, f"{victim} was still up after {len(after_kill)} steps"
        assert len(after_kill) == reaped_at + 3, [r.step for r in after_kill]
        assert swarm.procs[victim].wait(timeout=30) == -signal.SIGKILL
        survivors = {k: states_of(swarm, trainer, k) for k in range(2)}
        assert victim not in survivors[0] and len(survivors[0]) == 1
        assert list(survivors[1]) == [joiner]

    results = first + more + after_leave + after_kill
    assert [r.step for r in results] == list(range(len(results)))
    assert sum(r.loss for r in results[-3:]) / 3 < results[0].loss - 0.5
    assert_every_microbatch_counted(results, 2)
    # Where a stage had two replicas their digests were compared and equal; where none had,
    # the verdict says nothing was compared (it is never a vacuous True).
    assert_replicas_verified(results)
    assert not all(r.replicas_equal for r in results)  # the steps with one replica each compared nothing
    # The kill cost replays, each with its cause, and no data: every microbatch still counts
    # exactly once, so the losses equal one process's. The fault fires in a step between the
    # victim's start and the step after which it is seen dead, not always the last of these:
    # the process is reaped a few steps after it is killed (its main thread waits as a zombie
    # for the others), so the replays are looked for over that span.
    until_reaped = after_kill[: reaped_at + 1]
    replays = sum(r.replays for r in until_reaped)
    causes = sum((Counter(r.replay_causes) for r in until_reaped), Counter())
    assert replays > 0, [(r.step, r.replays) for r in after_kill]
    assert causes and sum(causes.values()) == replays, causes
    reference = assert_matches_reference(results, len(results))
    # The survivors hold one process's parameters. Not bit for bit: the gradients of a step's
    # microbatches are summed in another order (split between replicas, replayed after the
    # kill) than one process sums them, so the file's parameter tolerance applies.
    merged = next(iter(survivors[0].values())) | survivors[1][joiner]
    for key, value in reference.state.items():
        torch.testing.assert_close(
            merged[key], value, rtol=0, atol=3e-4
        )  # the step count varies with the reap


def test_unequal_stages_with_slow_replicas_match_single_process(local_swarm):
    """Heterogeneity on one machine: an unequal split (1 block, then 3), a 2x slower peer and
    a 4x slower replica train to the same losses and parameters as one process."""
    swarm = local_swarm(
        model_config=TINY_GPT,
        stage_bounds=(0, 1, 4),
        stage_args={1: ("--slowdown", "2")},
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
    )
    swarm.spawn_stage(0, extra_args=("--slowdown", "4"))
    steps = 3
    with swarm.trainer() as trainer:
        results = list(trainer.train(batches(), steps=steps))
        stage0 = states_of(swarm, trainer, 0)
        stage1 = trainer.fetch_state(1, swarm.wait_ready(replica_names(swarm, 1)[0]))
    assert_replicas_equal(stage0)
    assert_every_microbatch_counted(results, 2)
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in stage1 if k.startswith("block")} == {
        "block.1",
        "block.2",
        "block.3",
    }
    reference = assert_matches_reference(results, steps)
    merged = next(iter(stage0.values())) | stage1
    for key, value in reference.state.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-4)
