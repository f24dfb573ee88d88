"""Failures as states, on real swarms: peers killed (kill -9) or stopped (SIGTERM) in the
middle of a forward or a backward pass, a replica that stalls and recovers, and a chaos run
where peers die and rejoin all along. Training goes on, every microbatch is accounted for,
each counts exactly once (the losses equal single-process training's), and every stage's
replicas hold identical parameters after every step."""

import random
import signal
import threading
import time

import pytest

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

SEED = 3
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=6, max_in_flight=6)
STILL = ("--rebalance-every", "0")
RECOVERY_S = 10.0
"""How long a recovered replica may take to get its share back (5 steps in a row): routers
probe a replica they have passed over for 16 microbatches or sent nothing for 3 s, an idle
peer announces its best service time after 2 s, and the DHT records it every 2 s."""  # peers stay on their stage: the layout is the test's


def batches(microbatch_size: int = 4):
    return TokenBatches(
        stdlib_text(2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=microbatch_size, seed=SEED
    )


def wait_for_serving(trainer, replicas: dict[int, int]) -> None:
    """Wait until the trainer's view of the DHT shows `replicas[k]` serving peers of each stage k."""

    def counts() -> dict[int, int]:
        records = trainer.node.peers(trainer.manifest.run_id)
        return {k: sum(r.stage == k and r.state == "serving" for r in records) for k in replicas}

    wait_until(lambda: counts() == replicas, timeout_s=60, what=f"{replicas} serving replicas per stage")


def assert_every_microbatch_counted(results, per_step: int) -> None:
    for r in results:
        assert r.completed == per_step and r.dropped == 0, r
    assert_replicas_verified(results, some_compared=False)


def assert_parity(results, steps: int) -> None:
    reference = reference_losses(
        seed=SEED,
        optimizer=OPTIMIZER,
        batches=batches(),
        steps=steps,
        microbatches_per_step=BATCH.microbatches_per_step,
    )
    assert_losses_match_reference(results, reference)


@pytest.mark.parametrize("action", ["kill", "term"])
def test_peers_lost_mid_forward_and_mid_backward_lose_nothing(local_swarm, action):
    """Stage 0's second replica goes in the middle of its 4th forward, stage 1's in the middle
    of its 3rd backward (stage 2 is the last: its work is 'loss' tasks). kill: the whole
    process group dies at once; term: the peer drains its work and leaves politely."""
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=3,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={k: STILL for k in range(3)},
    )
    fwd = swarm.spawn_stage(0, extra_args=(*STILL, "--inject-fault", f"{action}:forward:4"))
    bwd = swarm.spawn_stage(1, extra_args=(*STILL, "--inject-fault", f"{action}:backward:3"))
    gone = lambda: all(swarm.procs[name].poll() is not None for name in (fwd, bwd))  # noqa: E731
    results, after = [], 0
    with swarm.trainer(verify_replicas=True) as trainer:
        wait_for_serving(trainer, {0: 2, 1: 2, 2: 1})
        for result in trainer.train(batches(), steps=120):  # until both faults hit, and 2 steps more
            results.append(result)
            after += gone()
            if after == 3:
                break
    logs = "\n".join(f"--- {name}:\n{swarm.log_tail(name)}" for name in (fwd, bwd))
    assert after == 3, f"the faulty peers were still up after {len(results)} steps\n{logs}"
    for name in (fwd, bwd):
        code = swarm.procs[name].wait(timeout=30)
        assert code == (0 if action == "term" else -signal.SIGKILL), f"{name} exited with {code}"
    steps = len(results)
    assert [r.step for r in results] == list(range(steps))
    assert_every_microbatch_counted(results, BATCH.microbatches_per_step)
    assert_parity(results, steps)
    if action == "kill":
        assert sum(r.replays for r in results) > 0  # the killed peers' work was replayed


def test_a_stalled_replica_gets_less_work_and_gets_it_back(local_swarm, tmp_path):
    batch = BatchConfig(microbatch_size=4, microbatches_per_step=8, max_in_flight=8)
    swarm = local_swarm(
        model_config=TINY_GPT | {"n_layer": 6},
        stage_bounds=(0, 1, 6),
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=batch,
        stage_args={0: STILL, 1: STILL},
    )
    stall = tmp_path / "stall"
    slow = swarm.spawn_stage(1, extra_args=(*STILL, "--slowdown-file", str(stall)))
    slow_id = swarm.wait_ready(slow)
    shares: list[tuple[str, float]] = []

    def mean(name: str, skip: int) -> float:
        values = [s for p, s in shares if p == name][skip:]
        return sum(values) / len(values)

    phase, since, recovered_at, back_after = "warm-up", 0, 0.0, None
    with swarm.trainer() as trainer:
        for result in trainer.train(batches(), steps=200):
            work = result.work[1]
            share = work.get(slow_id, 0) / sum(work.values())
            shares.append((phase, share))
            since += 1
            if phase == "warm-up" and share > 0:  # stage 0 has seen the new replica: measure from here
                phase, since = "normal", 0
            elif phase == "normal" and since == 8:
                stall.write_text("4")  # the replica now computes 4x slower
                phase, since = "stalled", 0
            elif phase == "stalled" and since == 10:
                stall.unlink()
                phase, since, recovered_at = "recovered", 0, time.monotonic()
            elif phase == "recovered" and since >= 5:
                recent = [s for _, s in shares[-5:]]
                if sum(recent) / 5 > max(0.25, 1.5 * mean("stalled", 3)):  # it has its share back
                    back_after = time.monotonic() - recovered_at
                    break
                if time.monotonic() - recovered_at > 3 * RECOVERY_S:
                    break
    assert phase == "recovered", f"the run ended in phase {phase}: {shares}"
    normal, stalled = mean("normal", 2), mean("stalled", 3)
    assert normal > 0.3, shares  # equal replicas share the work
    assert stalled < 0.6 * normal, shares  # within a few steps the slow one gets less
    assert back_after is not None, f"no 5 steps in a row gave the recovered replica its share: {shares}"
    assert back_after <= RECOVERY_S, f"it took {back_after:.1f} s to get its share back: {shares}"


def test_chaos_peers_die_and_rejoin_all_along_and_training_reaches_its_target(local_swarm):
    """Six stage peers (three stages, two replicas each): every few seconds a replica is
    killed (kill -9 of its whole process group) and a new one starts in its place."""
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=3,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={k: STILL for k in range(3)},
    )
    live = {k: [f"stage{k}-{k + 1}"] for k in range(3)}
    for k in range(3):
        live[k].append(swarm.spawn_stage(k, extra_args=STILL))
    rng = random.Random(SEED)
    stop, kills, joining = threading.Event(), [], []

    def chaos() -> None:
        """Every 2 s: kill a replica of a stage that has two serving, start a new one in its place."""
        while not stop.wait(2.0):
            for k, name in list(joining):
                if (swarm.log_dir / f"{name}.ready").exists():
                    joining.remove((k, name))
                    live[k].append(name)
            stages = [k for k in range(3) if len(live[k]) >= 2]
            if not stages:
                continue
            k = rng.choice(stages)
            victim = live[k].pop(rng.randrange(len(live[k])))
            swarm.signal(victim, signal.SIGKILL)
            kills.append(victim)
            joining.append((k, swarm.spawn_stage(k, extra_args=STILL, wait=False)))

    thread = threading.Thread(target=chaos, daemon=True)
    results = []
    with swarm.trainer(verify_replicas=True) as trainer:
        thread.start()
        try:
            for result in trainer.train(batches(), steps=400):
                results.append(result)
                recent = [r.loss for r in results[-3:]]
                if len(kills) >= 4 and sum(recent) / 3 < results[0].loss - 0.6:
                    break
        finally:
            stop.set()
            thread.join(timeout=60)
    assert len(kills) >= 4, f"only {len(kills)} peers were killed in {len(results)} steps"
    assert sum(r.loss for r in results[-3:]) / 3 < results[0].loss - 0.6  # the target loss
    assert [r.step for r in results] == list(range(len(results)))
    assert_every_microbatch_counted(results, BATCH.microbatches_per_step)
    assert sum(r.replays for r in results) > 0
    wait_until(
        lambda: all(swarm.procs[v].poll() is not None for v in kills), timeout_s=10, what="victims gone"
    )
