"""Durability on real swarms: a stage that loses its last replica comes back from the newest
checkpoint and the whole run goes back with it (its losses then continue as single-process
training from that checkpoint would), or, with no checkpoint anywhere, waits in a visible
'lost' state instead of silently starting again from the seed."""

import itertools
import signal
import threading
from types import SimpleNamespace

import pytest

from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

SEED = 5
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=4, max_in_flight=4)
STILL = ("--rebalance-every", "0")


def microbatches() -> list:
    batches = TokenBatches(stdlib_text(2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=4, seed=SEED)
    return list(itertools.islice(iter(batches), 40))


def two_stage_swarm(local_swarm, *coordinator_args: str):
    return local_swarm(
        model_config=TINY_GPT,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={0: STILL, 1: STILL},
        coordinator_args=coordinator_args,
    )


def records_of(trainer) -> list:
    return trainer.node.peers(trainer.manifest.run_id)


def kill_stage(swarm, trainer, stage: int) -> None:
    """kill -9 the stage's only replica (its DHT process and daemon too); wait until its record is gone."""
    name = next(n for n in swarm.procs if n.startswith(f"stage{stage}-"))
    dead = swarm.wait_ready(name)
    swarm.signal(name, signal.SIGKILL)
    wait_until(
        lambda: dead not in {r.peer_id for r in records_of(trainer)},
        timeout_s=30,
        what=f"the record of stage {stage}'s killed replica to expire",
    )


def test_a_stage_lost_mid_step_comes_back_from_its_checkpoint_and_the_run_goes_back_with_it(local_swarm):
    """Stage 1's only replica is killed (kill -9, its disk kept: a spot machine that comes back)
    in the middle of step 4's loss computations; a new peer takes the stage from the checkpoint
    of step 3 while the trainer is still in step 4."""
    m = BATCH.microbatches_per_step
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={0: STILL, 1: (*STILL, "--inject-fault", f"kill:loss:{4 * m + 2}")},
        coordinator_args=("--checkpoint-every", "3"),
    )
    victim = next(n for n in swarm.procs if n.startswith("stage1-"))

    def replace_the_victim() -> None:
        swarm.procs[victim].wait(timeout=300)
        swarm.spawn_stage(1, extra_args=STILL, wait=False)

    replacer = threading.Thread(target=replace_the_victim, daemon=True)
    replacer.start()
    data = microbatches()
    with swarm.trainer(microbatch_timeout_s=20) as trainer:
        results = list(trainer.train(iter(data), steps=7))
    replacer.join(timeout=10)
    assert swarm.procs[victim].returncode == -signal.SIGKILL
    assert [r.step for r in results] == [0, 1, 2, 3, 5, 6, 7]  # step numbers never go back
    rolled = [r.rolled_back for r in results]
    assert rolled[:4] == [""] * 4 and rolled[5:] == [""] * 2, rolled
    assert "stage(s) 1 lost every replica" in rolled[4] and "checkpoint of step 3" in rolled[4]
    assert "losing 1 step(s)" in rolled[4]  # step 3's update
    assert all(r.completed == m and r.dropped == 0 for r in results)
    # single-process training: 3 steps (the checkpoint), then the data fed from step 4 on
    # (step 4's microbatches, whose step was cut short, count once, in step 5)
    full = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=iter(data), steps=4, microbatches_per_step=m
    )
    resumed = data[: 3 * m] + data[4 * m : 7 * m]
    reference = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=iter(resumed), steps=6, microbatches_per_step=m
    )
    assert_losses_match_reference(results[:4], full)
    assert_losses_match_reference(results[4:], SimpleNamespace(losses=reference.losses[3:]))


def test_a_lost_stage_with_no_checkpoint_waits_visibly_instead_of_starting_from_the_seed(local_swarm):
    swarm = two_stage_swarm(local_swarm, "--checkpoint-every", "0")
    with swarm.trainer() as trainer:
        list(trainer.train(iter(microbatches()), steps=2))
        kill_stage(swarm, trainer, 1)
        name = swarm.spawn_stage(1, extra_args=STILL, wait=False)
        wait_until(
            lambda: any(r.stage == 1 and r.state == "lost" for r in records_of(trainer)),
            timeout_s=60,
            what="the new stage-1 peer to announce the stage lost",
        )
        assert not any(r.stage == 1 and r.state == "serving" for r in records_of(trainer))
    wait_until(lambda: "lost its last replica" in swarm.log_tail(name, 40), timeout_s=10, what="the warning")
    assert "--allow-reinit" in swarm.log_tail(name, 40)


def step_loss(model, microbatches) -> float:
    """The loss a step over `microbatches` reports: the mean of their losses, before the update."""
    import torch

    from swarmtrain.train.data import loss_inputs_of

    with torch.no_grad():
        losses = [float(model(*loss_inputs_of(mb))) for mb in microbatches]
    return sum(losses) / len(losses)


def export(swarm, out, *flags: str) -> str:
    """`swarmtrain export` as a user runs it, with the run's second trainer key."""
    import subprocess

    from swarmtrain.peers.launcher import cli_command

    args = ["export", "--initial-peers", swarm.address, "--out", str(out), *flags]
    args += ["--identity", str(swarm.trainer_identity(1))]
    done = subprocess.run(cli_command(*args), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_export_reload_resume_and_init_from(local_swarm, tmp_path):
    import pytest as _pytest

    from swarmtrain.peers.export import load_exported

    data = microbatches()
    m = BATCH.microbatches_per_step
    first = two_stage_swarm(local_swarm)
    with first.trainer() as trainer:
        it = iter(data)
        before = list(trainer.train(it, steps=3))
        assert "exported step 3" in export(first, tmp_path / "model")
        export(first, tmp_path / "run", "--resumable")
        on = list(trainer.train(it, steps=1))  # step 3
    first.close()
    model = load_exported(tmp_path / "model")  # one process, no swarm: the swarm's loss
    assert step_loss(model, data[3 * m : 4 * m]) == _pytest.approx(on[0].loss, rel=1e-5)

    resumed = two_stage_swarm(local_swarm, "--resume", str(tmp_path / "run"))
    with resumed.trainer() as trainer:
        after = list(trainer.train(iter(data[3 * m :]), steps=3))
    resumed.close()
    assert [r.step for r in after] == [3, 4, 5]
    reference = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=iter(data), steps=6, microbatches_per_step=m
    )
    assert_losses_match_reference(before + after, reference)  # as if it had never stopped

    started = two_stage_swarm(local_swarm, "--init-from", str(tmp_path / "model"))
    with started.trainer() as trainer:
        (fresh,) = trainer.train(iter(data[3 * m :]), steps=1)
    assert fresh.step == 0 and fresh.loss == _pytest.approx(on[0].loss, rel=1e-5)


def test_an_archivist_keeps_a_stage_whose_replicas_and_their_disks_are_gone(local_swarm, tmp_path):
    import os
    import shutil
    from pathlib import Path

    archive = tmp_path / "archive"
    swarm = two_stage_swarm(local_swarm, "--checkpoint-every", "2", "--checkpoint-dir", str(archive))
    data = microbatches()
    m = BATCH.microbatches_per_step
    with swarm.trainer() as trainer:
        it = iter(data)
        before = list(trainer.train(it, steps=3))  # every stage checkpoints after step 1
        wait_until(
            lambda: any(r.role == "coordinator" and 2 in r.checkpoints for r in records_of(trainer)),
            timeout_s=60,
            what="the archivist to gather step 2 and announce it",
        )
        run = next(archive.glob(f"{swarm.config.run_id}/*/step-00000002"))  # RUN/INSTANCE/step-N
        assert {p.name for p in run.iterdir()} == {
            "model.safetensors",
            "optimizer.safetensors",
            "swarmtrain.json",
        }
        kill_stage(swarm, trainer, 1)
        (lost_disk,) = Path(os.environ["SWARMTRAIN_HOME"], "checkpoints").glob(
            f"{swarm.config.run_id}/*/stage-1"
        )
        shutil.rmtree(lost_disk)  # the spot machine is gone with its disk
        archivist = next(r.peer_id for r in records_of(trainer) if r.role == "coordinator")
        joiner = swarm.spawn_stage(1, extra_args=STILL)
        after = list(trainer.train(it, steps=2))
    assert f"restored from the checkpoint of step 2 (held by {archivist})" in swarm.log_tail(joiner, 40)
    assert "checkpoint of step 2" in after[0].rolled_back and "losing 1 step(s)" in after[0].rolled_back
    resumed = data[: 2 * m] + data[3 * m : 5 * m]
    reference = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=iter(resumed), steps=4, microbatches_per_step=m
    )
    assert_losses_match_reference(before[:2], SimpleNamespace(losses=reference.losses[:2]))
    assert_losses_match_reference(after, SimpleNamespace(losses=reference.losses[2:]))
