"""A layout change at a step boundary, in one process: the stages of a new layout take their
blocks' parameters and optimizer state, by swarm name, from the stages of the old one, and
training goes on from the same step with the same per-step losses and final parameters as an
uninterrupted run (the state-transfer half of moving a live swarm to a new layout)."""

import asyncio
import itertools

import pytest
import torch

from swarmtrain.errors import BadFrameError
from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from tests.test_protocol import assert_parity, batches, manifest

OLD, NEW = (0, 2, 4), (0, 1, 4)
BEFORE, AFTER = 3, 3


def test_a_new_layout_takes_its_blocks_by_name_and_training_keeps_parity():
    async def scenario():
        data = iter(batches())

        def step_data(m):
            return [loss_inputs_of(b) for b in itertools.islice(data, m.batch.microbatches_per_step)]

        old_manifest = manifest(stages=OLD)
        async with InProcessSwarm(InProcessConfig(manifest=old_manifest, replicas=(1, 1))) as old:
            results = [await old.step(step_data(old_manifest)) for _ in range(BEFORE)]
            merged = {}
            for replica in old.replicas.values():
                merged |= replica.runner.export_named_state()
        assert any(k.startswith("opt.block.1.") for k in merged)  # AdamW's moments travel with their block
        new_manifest = manifest(stages=NEW)
        async with InProcessSwarm(InProcessConfig(manifest=new_manifest, replicas=(1, 2))) as new:
            for replica in new.replicas.values():  # each takes exactly its own blocks
                replica.runner.import_named_state(merged, step=BEFORE)
            new.trainer_step = BEFORE
            results += [await new.step(step_data(new_manifest)) for _ in range(AFTER)]
            return new, results

    swarm, results = asyncio.run(scenario())
    assert [r.step for r in results] == list(range(BEFORE + AFTER))
    assert_parity(swarm, results)  # losses of all six steps, and the final parameters


def test_a_state_that_lacks_a_block_is_refused_by_name():
    async def scenario():
        async with InProcessSwarm(InProcessConfig(manifest=manifest(stages=OLD), replicas=(1, 1))) as old:
            stage0 = old.replicas["s0r0"].runner.export_named_state()
        async with InProcessSwarm(InProcessConfig(manifest=manifest(stages=NEW), replicas=(1, 1))) as new:
            runner = new.replicas["s1r0"].runner  # blocks 1-3: block 1 from old stage 0, 2-3 from stage 1
            before = runner.export_named_state()
            with pytest.raises(BadFrameError, match=r"lack \d+ of this stage's parameters, e.g. 'block\.2\."):
                runner.import_named_state(stage0, step=1)
            after = runner.export_named_state()
            assert all(torch.equal(before[k], after[k]) for k in before) and runner.step == 0  # untouched

    asyncio.run(scenario())


def test_named_state_names_the_same_block_in_any_span():
    async def scenario():
        async with InProcessSwarm(InProcessConfig(manifest=manifest(stages=OLD), replicas=(1, 1))) as swarm:
            return [set(r.runner.export_named_state()) for r in swarm.replicas.values()]

    stage0, stage1 = asyncio.run(scenario())
    assert stage0 and all(k.startswith(("param.embed.", "param.block.0.", "param.block.1.")) for k in stage0)
    assert stage1 and all(k.startswith(("param.block.2.", "param.block.3.", "param.head.")) for k in stage1)
