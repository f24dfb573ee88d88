"""Stage checkpoints on disk, the restore rules and the rollback plan, in process."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from swarmtrain.errors import ConfigError
from swarmtrain.peers.checkpoints import StageCheckpointer, checkpoint_sources, run_progressed
from swarmtrain.train import checkpoint as ckpt
from swarmtrain.train.data import stdlib_text
from swarmtrain.train.rollback import plan_rollback
from swarmtrain.wire.records import PeerRecord, RunManifest
from tests.test_stage_runner import ADAMW, batches, commit, make_runners, run_microbatch

RUN = "durable"
A, C, D = "Q" * 40 + "a", "Q" * 40 + "c", "Q" * 40 + "d"


@pytest.fixture(scope="module")
def text() -> bytes:
    return stdlib_text(max_bytes=2**20)


def trained_runners(text, steps: int = 2):
    runners = make_runners((0, 2, 4), ADAMW)
    it = iter(batches(text))
    for step in range(steps):
        for n in range(2):
            x, y = next(it)
            run_microbatch(runners, f"{step}.{n}", x, y, 0.5)
        commit(runners, step)
    return runners


def write(root, runner, stage: int = 1):
    return ckpt.write_stage_checkpoint(
        root,
        run_id=RUN,
        stage=stage,
        step=runner.step,
        state=runner.export_state(),
        param_names=list(runner.named_params),
        meta={"param_digest": runner.param_digest()},
    )


def test_a_checkpoint_is_readable_without_swarmtrain_and_restores_bit_for_bit(tmp_path, text):
    runner = trained_runners(text)[1]
    where, written = write(tmp_path, runner)
    assert where == tmp_path / RUN / "stage-1" / "step-00000002"
    assert written == sum(f.stat().st_size for f in where.iterdir()) > 0
    params = load_file(str(where / "params.safetensors"))  # plain safetensors and JSON
    assert set(params) == set(runner.named_params) and any(k.startswith("block.2.") for k in params)
    optim = load_file(str(where / "optimizer.safetensors"))
    assert any(k.endswith(".exp_avg_sq") for k in optim)
    meta = json.loads((where / "meta.json").read_text())
    assert (meta["format"], meta["run_id"], meta["stage"], meta["step"]) == (ckpt.FORMAT, RUN, 1, 2)

    fresh = make_runners((0, 2, 4), ADAMW)[1]
    back = ckpt.read_stage_checkpoint(tmp_path, RUN, 1, 2)
    fresh.import_state(ckpt.checkpoint_state(back, list(fresh.named_params)), back.step)
    assert fresh.param_digest() == runner.param_digest() == meta["param_digest"]
    for p, q in zip(fresh.params, runner.params, strict=True):
        for name, value in runner.optimizer.state[q].items():
            assert torch.equal(fresh.optimizer.state[p][name], value), name


def test_writes_are_atomic_and_old_checkpoints_pruned(tmp_path, text):
    runner = trained_runners(text, steps=1)[0]
    stale = tmp_path / RUN / "stage-0" / ".step-00000009.tmp-123"  # a writer killed mid-write
    stale.mkdir(parents=True)
    (stale / "params.safetensors").write_bytes(b"half")
    for step in (1, 2, 3):
        runner.step = step
        write(tmp_path, runner, stage=0)
    assert ckpt.stage_checkpoint_steps(tmp_path, RUN, 0) == [1, 2, 3]  # the half-written one is not one
    assert write(tmp_path, runner, stage=0)[1] == 0  # a step already held is left as it is
    assert ckpt.prune_stage_checkpoints(tmp_path, RUN, 0, keep=2) == [2, 3]
    assert sorted(os.listdir(tmp_path / RUN / "stage-0")) == [stale.name, "step-00000002", "step-00000003"]


def test_a_checkpoint_of_another_split_is_refused_by_name(tmp_path, text):
    runner = trained_runners(text, steps=1)[1]
    write(tmp_path, runner)
    other = make_runners((0, 1, 4), ADAMW)[1]  # stage 1 holds other blocks here
    back = ckpt.read_stage_checkpoint(tmp_path, RUN, 1, 1)
    with pytest.raises(ConfigError, match="does not hold this stage's parameters"):
        ckpt.checkpoint_state(back, list(other.named_params))
    with pytest.raises(ConfigError, match="is not a readable stage checkpoint"):
        ckpt.read_stage_checkpoint(tmp_path, RUN, 1, 7)


def manifest(every: int = 2) -> RunManifest:
    return RunManifest(
        run_id=RUN, model="tiny-gpt", num_blocks=4, stage_bounds=(0, 2, 4), checkpoint_every=every
    )


def test_the_checkpointer_writes_on_its_cadence_and_serves_what_it_holds(tmp_path, text):
    from swarmtrain.schedule import ReadinessQueue
    from swarmtrain.schedule.runtime import ComputeScheduler

    runner = trained_runners(text, steps=2)[1]
    scheduler = ComputeScheduler(ReadinessQueue(4), holding=lambda: 0, fused_last=False)
    saver = StageCheckpointer(tmp_path, manifest(every=2), keep=1)
    try:
        assert saver.due(2) and not saver.due(3) and not saver.due(0)
        assert asyncio.run(saver.save(runner, scheduler, 1)) == ckpt.step_dir(tmp_path, RUN, 1, 2)
        assert saver.held(1) == (2,) and saver.held(0) == ()
        assert saver.stats.written == 1 and saver.stats.last_bytes > 0 and saver.stats.longest_pause_s > 0
        state = saver.state_at(1, 2, list(runner.named_params))
        for name, p in runner.named_params.items():
            assert torch.equal(state[f"param.{name}"], p), name
        assert saver.state_at(1, 4, list(runner.named_params)) is None
    finally:
        scheduler.close()


def record(peer: str, stage: int, step: int, checkpoints=(), role="stage") -> PeerRecord:
    return PeerRecord(peer_id=peer, role=role, stage=stage, step=step, checkpoints=checkpoints)


def test_a_stage_nobody_serves_is_lost_once_the_run_is_past_its_start():
    assert not run_progressed([record(A, 0, 0)], None, stage=1)  # a new run: the seed is right
    assert run_progressed([record(A, 0, 0)], 0, stage=1)  # a trainer committed step 0
    assert run_progressed([record(A, 0, 4)], None, stage=1)  # another stage is past step 0
    assert not run_progressed([record(A, 1, 4)], None, stage=1)  # (a record of the stage itself)


def test_the_newest_checkpoint_comes_first_and_this_peers_own_before_anothers():
    records = [
        record(A, 1, 4, (2, 4)),
        record(C, 0, 4, (2, 4)),  # another stage's checkpoints are no use
        record(D, -1, 0, (2, 6), role="coordinator"),  # an archivist holds every stage
    ]
    assert checkpoint_sources(records, 1, local=(4,), me=C) == [(6, D), (4, C), (4, A), (2, A), (2, D)]


def test_the_rollback_plan():
    records = [record(A, 0, 7, (3, 6)), record(C, 1, 6, (6,))]
    # stage 1 came back from its checkpoint of step 6 while stage 0 is at 7: back to 6, on as 8
    plan = plan_rollback({0: [7], 1: [6]}, records, run_step=7, num_stages=2)
    assert (plan.checkpoint, plan.step, plan.lost_stages, plan.lost_steps) == (6, 8, (1,), 1)
    assert plan.sources == {0: (A,), 1: (C,)}
    assert "stage(s) 1 lost every replica" in plan.describe()
    assert plan_rollback({0: [7], 1: [7, 6]}, records, run_step=7, num_stages=2) is None  # a replica is at 7
    assert plan_rollback({0: [7], 1: []}, records, run_step=7, num_stages=2) is None  # nobody to go back to
    # nobody holds stage 0's checkpoint of step 5: no rollback (the trainer waits, and says why)
    assert plan_rollback({0: [7], 1: [5]}, records, run_step=7, num_stages=2) is None


def test_restoring_only_the_lost_stage_is_a_choice_that_needs_no_other_checkpoint():
    records = [record(A, 0, 7, ()), record(C, 1, 6, (6,))]
    assert plan_rollback({0: [7], 1: [6]}, records, run_step=7, num_stages=2) is None  # stage 0 holds no 6
    plan = plan_rollback({0: [7], 1: [6]}, records, run_step=7, num_stages=2, stage_only=True)
    assert (plan.checkpoint, plan.step, plan.stage_only) == (6, 8, True)
    assert [plan.checkpoint_for(k) for k in (0, 1)] == [7, 6]  # stage 0 keeps its state: a relabel
    assert "came back alone" in plan.describe() and "kept their state" in plan.describe()
