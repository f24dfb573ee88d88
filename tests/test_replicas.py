"""Several peers per stage: gradients averaged with hivemind, identical replicas after every
step, joins that download state mid-run, and leaves (SIGTERM, kill -9) that training survives."""

import signal

import pytest
import torch

from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

SEED = 11
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=4, max_in_flight=4)


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
    swarm = local_swarm(model_config=TINY_GPT, num_stages=2, seed=SEED, optimizer=OPTIMIZER, batch=BATCH)
    swarm.spawn_stage(1)  # a second replica of stage 1, from the start (downloads the seed state)
    steps = 3
    with swarm.trainer() as trainer:
        results = list(trainer.train(batches(), steps=steps))
        stage1 = states_of(swarm, trainer, 1)
        stage0 = trainer.fetch_state(0, swarm.wait_ready(replica_names(swarm, 0)[0]))
    assert len(stage1) == 2
    assert_replicas_equal(stage1)
    # Both replicas took microbatches, and the averaged step equals one process's step.
    reference = assert_matches_reference(results, steps)
    merged = stage0 | next(iter(stage1.values()))
    for key, value in reference.state.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-4)


def test_join_mid_run_downloads_state_and_leaves_do_not_stop_training(local_swarm):
    swarm = local_swarm(model_config=TINY_GPT, num_stages=2, seed=SEED, optimizer=OPTIMIZER, batch=BATCH)
    data = batches()
    with swarm.trainer() as trainer:
        first = list(trainer.train(data, steps=3))

        # Join mid-run: the new replica serves the trained parameters, not a fresh init.
        joiner = swarm.spawn_stage(1)
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

        # kill -9 of a whole peer (its DHT process and daemon too): the TTL retires it and
        # the step completes on the remaining replicas.
        swarm.spawn_stage(1)
        victim = replica_names(swarm, 1)[0]
        swarm.signal(victim, signal.SIGKILL)
        after_kill = list(trainer.train(data, steps=3))
        survivors = states_of(swarm, trainer, 1)
        assert victim not in survivors and len(survivors) == 1

    results = first + more + after_leave + after_kill
    assert [r.step for r in results] == list(range(11))
    assert sum(r.loss for r in results[-3:]) / 3 < results[0].loss - 0.5


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
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in stage1 if k.startswith("block")} == {
        "block.1",
        "block.2",
        "block.3",
    }
    reference = assert_matches_reference(results, steps)
    merged = next(iter(stage0.values())) | stage1
    for key, value in reference.state.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-4)
