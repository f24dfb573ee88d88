"""A run's learning-rate schedule, global gradient clipping and step count, in an in-process
swarm: every replica of every stage steps at the schedule's rate, the whole model's gradient
is clipped across stages as one process would clip it, and the run stops at its last step."""

import asyncio
import dataclasses
import logging

import pytest
import torch

from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.train.optim import lr_at
from swarmtrain.train.reference import stage_state_dict
from swarmtrain.train.run_length import RunFinishedError
from swarmtrain.wire.records import OptimizerConfig
from tests.conftest import reference_losses
from tests.test_protocol import PARAM_ATOL, assert_parity, batches, manifest

STEPS = 4
CLIPPED = OptimizerConfig(
    name="sgd", lr=0.5, momentum=0.9, warmup_steps=1, schedule="cosine", min_lr=0.05, max_grad_norm=2.0
)
"""SGD, which unlike Adam does not undo a gradient's scale: clipping shows in the parameters.
The gradient norm of tiny-gpt on this data starts near 2.8 and falls under 2 within a few
steps: the bound clips some steps and leaves others."""


def run(config: InProcessConfig, steps: int, *, then=None):
    """`swarm.train(steps)`; `then(swarm, data)` runs after it on the same swarm."""

    async def scenario():
        data = iter(batches())
        async with InProcessSwarm(config) as swarm:
            results = await swarm.train(data, steps)
            if then is not None:
                await then(swarm, data)
            return swarm, results

    return asyncio.run(scenario())


def test_schedule_and_clipping_across_three_stages_match_single_process_training():
    m = dataclasses.replace(manifest(stages=(0, 1, 3, 4)), optimizer=CLIPPED, max_steps=STEPS)
    swarm, results = run(InProcessConfig(manifest=m, replicas=(1, 2, 1)), STEPS)
    reference = assert_parity(swarm, results)  # losses and every replica's parameters
    assert all(r.replicas_equal is True and r.replicas_compared[1] == 2 for r in results)
    assert [r.lr for r in results] == reference.lrs == [lr_at(CLIPPED, s, STEPS) for s in range(STEPS)]
    assert reference.lrs[0] == 0.5 and reference.lrs[-1] == 0.05  # warmup's last step, the cosine's end
    norms = [r.grad_norm for r in results]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(reference.grad_norms), rtol=1e-4, atol=0)
    assert any(n > CLIPPED.max_grad_norm for n in norms), norms  # clipping engaged...
    assert any(n < CLIPPED.max_grad_norm for n in norms), norms  # ...and let other steps be
    unclipped = reference_losses(
        seed=m.seed,
        optimizer=dataclasses.replace(CLIPPED, max_grad_norm=0.0),
        batches=iter(batches()),
        steps=STEPS,
        microbatches_per_step=m.batch.microbatches_per_step,
        max_steps=STEPS,
    )
    losses = torch.tensor([r.loss for r in results])
    assert not torch.allclose(losses, torch.tensor(unclipped.losses), rtol=1e-3, atol=0)  # it mattered
    for name, replica in swarm.replicas.items():  # the last step ran at the cosine's floor
        assert [g["lr"] for g in replica.runner.optimizer.param_groups] == [0.05], name


def test_a_dropped_microbatch_is_rescaled_before_the_clip_measures_the_gradient():
    m = dataclasses.replace(manifest(), optimizer=CLIPPED, max_steps=STEPS)
    config = InProcessConfig(manifest=m, replicas=(1, 1), max_dropped_fraction=0.5)

    async def scenario():
        data = iter(batches())
        async with InProcessSwarm(config) as swarm:
            mbs = [loss_inputs_of(next(data)) for _ in range(m.batch.microbatches_per_step)]
            x, inputs = mbs[-1]
            mbs[-1] = (x, {"targets": torch.full_like(inputs["targets"], -100)})  # all ignored: a NaN loss
            return swarm, await swarm.step(mbs)

    swarm, result = asyncio.run(scenario())
    assert result.dropped == 1 and result.completed == 3
    reference = reference_losses(  # the step's three other microbatches
        seed=m.seed,
        optimizer=CLIPPED,
        batches=(b for i, b in enumerate(batches()) if i != 3),
        steps=1,
        microbatches_per_step=3,
        max_steps=STEPS,
    )
    assert result.grad_norm == pytest.approx(reference.grad_norms[0], rel=1e-4)
    assert result.grad_norm > CLIPPED.max_grad_norm
    for name, replica in swarm.replicas.items():
        for key, value in stage_state_dict(replica.runner.module).items():
            torch.testing.assert_close(
                value, reference.state[key], rtol=0, atol=PARAM_ATOL, msg=f"{name}: {key}"
            )


def test_the_run_stops_at_its_last_step_and_says_so(caplog):
    m = dataclasses.replace(manifest(), max_steps=3)
    refused = {}

    async def then(swarm, data):
        mbs = [loss_inputs_of(next(data)) for _ in range(m.batch.microbatches_per_step)]
        with pytest.raises(RunFinishedError) as refused["step"]:
            await swarm.step(mbs)
        with pytest.raises(RunFinishedError) as refused["train"]:
            await swarm.train(data, 1)

    with caplog.at_level(logging.INFO, logger="swarmtrain.train.inprocess"):
        swarm, results = run(InProcessConfig(manifest=m, replicas=(1, 2)), 10, then=then)
    assert [r.step for r in results] == [0, 1, 2]
    assert "run 'protocol' reached its last step (3); stopping" in caplog.messages
    assert all(r.runner.step == 3 for r in swarm.replicas.values())  # nothing ran past it
    for how in ("step", "train"):
        assert "run 'protocol' is finished: it ran all its 3 steps" in str(refused[how].value)


def test_a_trainer_asked_for_fewer_steps_than_are_left_runs_those():
    m = dataclasses.replace(manifest(), max_steps=3)

    async def then(swarm, data):
        assert len(await swarm.train(data, 5)) == 2  # the rest of the run

    _, results = run(InProcessConfig(manifest=m, replicas=(1, 1)), 1, then=then)
    assert [r.step for r in results] == [0]
