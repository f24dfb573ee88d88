"""Several trainers of one run as real processes (`swarmtrain train`, each its shard by its place
among the run's authorized trainers): together they train exactly as one process does on the
run's data order; a kill -9 of the committing trainer mid-step leaves the other going on with
every microbatch accounted for and the replicas bit-identical; a trainer that restarts goes on
with its shard where the run is, feeding no data twice."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.step_account import LEFT, NOT_FED
from swarmtrain.trust.identity import Identity
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses

pytestmark = pytest.mark.swarm

SEED = 3
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=2, microbatches_per_step=4, max_in_flight=4)
M = BATCH.microbatches_per_step
PROCESS_TIMEOUT_S = 120


def run_order():
    """The run's data order, as `swarmtrain train` draws it (stdlib text, the run seed)."""
    return TokenBatches(stdlib_text(16 * 2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=2, seed=SEED)


def two_trainer_swarm(local_swarm, *, replicas: int = 1):
    swarm = local_swarm(model_config=TINY_GPT, num_stages=2, seed=SEED, optimizer=OPTIMIZER, batch=BATCH)
    for _ in range(replicas - 1):  # serving before the trainers start: every step compares replicas
        swarm.spawn_stage(1, extra_args=("--rebalance-every", "0"))
    return swarm


def start_trainer(swarm, n: int, steps: int, *extra: str, name: str | None = None) -> str:
    name = name or f"trainer-{n}"
    args = ["train", "--initial-peers", swarm.address, "--run-id", "demo", "--steps", str(steps)]
    args += ["--jsonl", "--verify-replicas", "--threads", "1", "--timeout", "20", *extra]
    args += ["--identity", str(swarm.trainer_identity(n))]
    swarm.spawn(name, args)
    return name


def finish(swarm, name: str) -> list[dict]:
    """Wait for trainer process `name` to exit with 0; its per-step records."""
    proc = swarm.procs[name]
    try:
        proc.wait(PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish:\n{swarm.log_tail(name, 30)}")
    assert proc.returncode == 0, swarm.log_tail(name, 30)
    return records(swarm, name)


def records(swarm, name: str) -> list[dict]:
    text = (swarm.log_dir / f"{name}.log").read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def committer_first(swarm) -> tuple[int, int]:
    """(the authorized trainer that commits while both live: the lower peer id, the other)."""
    ids = [Identity.load(swarm.trainer_identity(n)).peer_id for n in (0, 1)]
    return (0, 1) if ids[0] < ids[1] else (1, 0)


def test_two_trainers_on_disjoint_shards_train_like_one_process(local_swarm):
    steps = 3
    swarm = two_trainer_swarm(local_swarm)
    names = [start_trainer(swarm, n, steps, "--min-trainers", "2") for n in (0, 1)]
    results = [finish(swarm, name) for name in names]
    assert [[r["step"] for r in rs] for rs in results] == [list(range(steps))] * 2
    for mine, theirs in zip(*results):  # each step seen alike by both trainers
        assert mine["loss"] == theirs["loss"] and mine["completed"] == theirs["completed"] == M
    assert "feeding shard 0/2" in swarm.log_tail(names[0], 50)
    assert "feeding shard 1/2" in swarm.log_tail(names[1], 50)
    reference = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=run_order(), steps=steps, microbatches_per_step=M
    )
    assert_losses_match_reference([_Loss(r["loss"]) for r in results[0]], reference)


class _Loss:
    def __init__(self, loss: float):
        self.loss = loss


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param("kill:forward:4", id="mid-flow"),  # its second microbatch of step 1
        pytest.param("kill:exchange:4", id="mid-commit"),  # the first exchange of step 1 (3 replicas a step)
    ],
)
def test_a_kill_9_of_the_committing_trainer_mid_step_leaves_the_other_training(local_swarm, fault):
    # The committer dies (kill -9 of its processes) mid-step. The other trainer takes the
    # commit over within seconds; step 1 counts each microbatch once or drops it with a cause,
    # the dead trainer's shard is not fed after it, and the replicas stay bit-identical.
    steps = 4
    swarm = two_trainer_swarm(local_swarm, replicas=2)
    first, other = committer_first(swarm)
    dies = start_trainer(swarm, first, steps, "--min-trainers", "2", "--inject-fault", fault)
    lives = start_trainer(swarm, other, steps, "--min-trainers", "2")
    results = finish(swarm, lives)
    swarm.procs[dies].wait(PROCESS_TIMEOUT_S)
    assert swarm.procs[dies].returncode == -signal.SIGKILL
    assert [r["step"] for r in results] == list(range(steps))
    for r in results:
        assert r["completed"] + r["dropped"] == M, r
        assert sum(r["dropped_causes"].values()) == r["dropped"], r
        assert set(r["dropped_causes"]) <= {LEFT, NOT_FED}, r
    assert results[0]["completed"] == M and results[0]["dropped"] == 0
    step1 = results[1]
    assert step1["completed"] - step1["adopted"] == M // 2  # its own all count
    if fault.startswith("kill:exchange"):  # the dead committer's share was in every stage: it counts
        assert step1["completed"] == M and step1["adopted"] == M // 2, step1
    assert step1["seconds"] < 30, step1
    for r in results[2:]:  # the dead trainer's shard is not fed any more
        assert r["completed"] == M // 2 and r["dropped_causes"] == {NOT_FED: M // 2}
    assert any(r["replicas_equal"] for r in results)
    assert all(r["replicas_equal"] in (True, None) for r in results), [r["replicas_equal"] for r in results]


def test_restarted_trainers_go_on_with_their_shards_where_the_run_is(local_swarm):
    # Both trainers train a step and leave; started again, they find the run at step 1 and
    # feed their shards of steps 1 and 2: the three steps are one process's three steps on the
    # run's data order (fed again from the start, step 1 would train on step 0's data).
    swarm = two_trainer_swarm(local_swarm)
    names = [start_trainer(swarm, n, 1, "--min-trainers", "2") for n in (0, 1)]
    first = [finish(swarm, name) for name in names]
    names = [start_trainer(swarm, n, 2, "--min-trainers", "2", name=f"again-{n}") for n in (0, 1)]
    again = [finish(swarm, name) for name in names]
    assert [r["step"] for r in first[0] + again[0]] == [0, 1, 2]
    assert [r["step"] for r in first[1] + again[1]] == [0, 1, 2]
    assert all(r["completed"] == M for r in first[0] + again[0])
    reference = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=run_order(), steps=3, microbatches_per_step=M
    )
    assert_losses_match_reference([_Loss(r["loss"]) for r in first[0] + again[0]], reference)
