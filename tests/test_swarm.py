"""Real swarms on 127.0.0.1: a coordinator and stage peers as separate processes, a trainer
in this process, real hivemind DHTs and P2P streams."""

import pytest
import torch

from swarmtrain.errors import SwarmError
from swarmtrain.peers.trainer import RunFinishedError, StepFailedError
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.reference import train_reference
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, assert_replicas_verified, wait_until

pytestmark = pytest.mark.swarm

SEED = 7
STEPS = 4
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=3, max_in_flight=3)

# Stated tolerance of the parity test. The swarm sums a step's microbatch gradients in the
# order they complete, the reference in index order, so float rounding differs slightly;
# AdamW then turns rounding-level differences into parameter differences of about lr * 1e-4.
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4


def batches():
    return TokenBatches(
        stdlib_text(2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=BATCH.microbatch_size, seed=SEED
    )


@pytest.fixture(scope="module")
def reference():
    return train_reference(
        model="tiny-gpt",
        model_config=TINY_GPT,
        seed=SEED,
        optimizer=OPTIMIZER,
        batches=batches(),
        steps=STEPS,
        microbatches_per_step=BATCH.microbatches_per_step,
    )


@pytest.mark.parametrize("num_stages", [2, 4])
def test_loss_and_parameter_parity_with_single_process(local_swarm, reference, num_stages):
    swarm = local_swarm(
        model_config=TINY_GPT, num_stages=num_stages, seed=SEED, optimizer=OPTIMIZER, batch=BATCH
    )
    with swarm.trainer() as trainer:
        results = list(trainer.train(batches(), steps=STEPS))
        states = trainer.fetch_states()

    assert [r.step for r in results] == list(range(STEPS))
    losses = [r.loss for r in results]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=LOSS_RTOL, atol=0)
    assert losses[-1] < losses[0]  # it trained, not just matched

    merged = {}
    for state in states:
        assert not set(state) & set(merged), "two stages hold the same parameter"
        merged.update(state)
    assert set(merged) == set(reference.state)
    for key, value in reference.state.items():
        torch.testing.assert_close(
            merged[key], value, rtol=0, atol=PARAM_ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )


def test_bad_microbatch_fails_the_step_with_a_clear_message(local_swarm):
    swarm = local_swarm(model_config=TINY_GPT, num_stages=2, seed=SEED, optimizer=OPTIMIZER, batch=BATCH)
    wrong_length = TokenBatches(
        stdlib_text(2**20), seq_len=TINY_GPT["seq_len"] + 1, microbatch_size=BATCH.microbatch_size, seed=SEED
    )
    with (
        swarm.trainer() as trainer,
        pytest.raises(StepFailedError, match=r"stage 0 rejected .*shape \(4, 17\).*expects \('B', 16\)"),
    ):
        next(trainer.train(wrong_length, steps=1))
    # The stage peer kept serving; it banned the peer that sent the bad frames, not others.
    with swarm.trainer(1) as trainer:
        result = next(trainer.train(batches(), steps=1))
        assert result.step == 0 and result.loss > 0


def test_the_manifest_loss_decides_the_named_inputs_every_stage_checks(local_swarm):
    """`--loss weighted_cross_entropy` reaches every stage peer through the manifest: stage 0
    refuses microbatches that carry targets alone, naming the input they lack."""
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        loss="weighted_cross_entropy",
    )
    with swarm.trainer() as trainer:
        assert trainer.manifest.loss == "weighted_cross_entropy"
        with pytest.raises(
            StepFailedError,
            match=r"stage 0 rejected .*missing loss input 'weights': loss 'weighted_cross_entropy' takes 'targets', 'weights'",
        ):
            next(trainer.train(batches(), steps=1))


def test_trainer_for_unknown_run_says_which_runs_exist(local_swarm):
    swarm = local_swarm(run_id="alpha", model_config=TINY_GPT, num_stages=2)
    from swarmtrain.peers.trainer import Trainer, TrainerConfig
    from swarmtrain.swarm import NodeConfig

    with pytest.raises(SwarmError, match=r"no run 'beta'.*alpha"):
        Trainer(TrainerConfig(node=NodeConfig(initial_peers=(swarm.address,)), run_id="beta"))


def test_static_schedule_with_a_replicated_stage_matches_single_process(local_swarm, reference):
    """The baseline mode (round-robin replicas, fixed 1F1B order) trains the same model."""
    swarm = local_swarm(
        model_config=TINY_GPT, num_stages=2, seed=SEED, optimizer=OPTIMIZER, batch=BATCH, schedule="static"
    )
    second = swarm.spawn_stage(1, extra_args=("--rebalance-every", "0"))
    with swarm.trainer(verify_replicas=True) as trainer:
        wait_until(
            lambda: sum(r.stage == 1 and r.state == "serving" for r in trainer.node.peers("demo")) == 2,
            timeout_s=60,
            what="both replicas of stage 1 in the trainer's view",
        )
        results = list(trainer.train(batches(), steps=STEPS))
    torch.testing.assert_close(
        torch.tensor([r.loss for r in results]), torch.tensor(reference.losses), rtol=LOSS_RTOL, atol=0
    )
    assert_replicas_verified(results)
    # round-robin: both replicas of stage 1 work (a replica that missed a step while its record
    # spread catches up by taking the other's state, and gets its turns again)
    assert any(swarm.wait_ready(second) in r.work[1] and len(r.work[1]) == 2 for r in results)


def test_the_run_ends_at_its_last_step_and_its_stage_peers_leave(local_swarm):
    """With a step count (--steps 2) and a schedule with clipping: the trainer stops at the last
    step, the stage peers that applied it exit cleanly, and a trainer started later is refused."""
    scheduled = OptimizerConfig(lr=1e-2, warmup_steps=1, schedule="cosine", min_lr=1e-3, max_grad_norm=1.0)
    swarm = local_swarm(
        model_config=TINY_GPT, num_stages=2, seed=SEED, optimizer=scheduled, batch=BATCH, max_steps=2
    )
    stage_peers = [name for name in swarm.procs if name.startswith("stage")]
    with swarm.trainer() as trainer:
        results = list(trainer.train(batches(), steps=5))
        assert trainer.finished
    reference = train_reference(
        model="tiny-gpt",
        model_config=TINY_GPT,
        seed=SEED,
        optimizer=scheduled,
        batches=batches(),
        steps=2,
        microbatches_per_step=BATCH.microbatches_per_step,
        max_steps=2,
    )
    assert [(r.step, r.lr) for r in results] == [(0, 1e-2), (1, 1e-3)] and reference.lrs == [1e-2, 1e-3]
    torch.testing.assert_close(
        torch.tensor([[r.loss, r.grad_norm] for r in results]),
        torch.tensor([reference.losses, reference.grad_norms]).T,
        rtol=LOSS_RTOL,
        atol=0,
    )
    assert results[0].grad_norm > scheduled.max_grad_norm  # the first step was clipped
    wait_until(
        lambda: all(swarm.procs[name].poll() is not None for name in stage_peers),
        timeout_s=30,
        what="the stage peers to leave the finished run",
    )
    for name in stage_peers:
        assert swarm.procs[name].returncode == 0, swarm.log_tail(name)
        assert "run 'demo' finished at step 2" in swarm.log_tail(name)
    with swarm.trainer(1) as late, pytest.raises(RunFinishedError, match="run 'demo' is finished"):
        next(late.train(batches(), steps=1))
