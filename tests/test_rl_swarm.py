"""GRPO through a real swarm: rollout peers sample from the policy version the stages serve, the
trainer recomputes every reward, bans a peer that lies about them, checks behaviour log-probs
through the pipeline and bans a peer that lies about those, and goes on when a rollout peer is
killed."""

import math
import random
import signal
from pathlib import Path

import pytest
import torch

from swarmtrain.model import build_model
from swarmtrain.rl.feed import RolloutFeed
from swarmtrain.rl.local import LocalConfig, warmup
from swarmtrain.rl.registry import build_task
from swarmtrain.train.archive import save_model
from swarmtrain.wire.metrics import TrainerPoint
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, PeerRecord
from swarmtrain.wire.rl_config import RLConfig
from tests.conftest import wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 16}
G = 8


def warm_model(where) -> None:
    """A policy that answers in the right format and sometimes right: GRPO needs some reward."""
    torch.manual_seed(0)
    model = build_model("tiny-gpt", MODEL, device="cpu")
    cfg = LocalConfig(model=MODEL, warmup_steps=60, warmup_batch_size=64, warmup_lr=3e-3)
    warmup(model, build_task("add"), cfg, random.Random(0))
    save_model(model, where, builder="tiny-gpt", config=MODEL)


def test_grpo_trains_through_the_swarm_on_rollout_peers_and_bans_liars(local_swarm, tmp_path):
    warm_model(tmp_path / "warm")
    swarm = local_swarm(
        model_config=MODEL,
        num_stages=2,
        loss="grpo",
        batch=BatchConfig(microbatch_size=16, microbatches_per_step=4, max_in_flight=4),
        optimizer=OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.0),
        coordinator_args=(
            "--task", "add", "--samples-per-prompt", str(G), "--max-staleness", "2",
            "--init-from", str(tmp_path / "warm"), "--checkpoint-every", "0", "--verify-fraction", "1",
        ),
    )  # fmt: skip
    # the peer that survives keeps its policy copies in 8-bit (bitsandbytes, on the CPU here)
    honest = [
        swarm.spawn_rollout(wait=False),
        swarm.spawn_rollout(extra_args=("--quantize", "8bit"), wait=False),
    ]
    liar = swarm.spawn_rollout(extra_args=("--inject-fault", "lie"), wait=False)
    logprob_liar = swarm.spawn_rollout(extra_args=("--inject-fault", "lie-logprobs"), wait=False)
    ids = {name: swarm.wait_ready(name) for name in [*honest, liar, logprob_liar]}

    with swarm.trainer() as trainer:
        feed = RolloutFeed(trainer)
        results = list(trainer.train(feed, steps=4))
        wait_until(lambda: ids[liar] in feed.banned, timeout_s=60, what="the lying rollout peer to be banned")
        wait_until(
            lambda: ids[logprob_liar] in feed.banned,
            timeout_s=60,
            what="the rollout peer lying about log-probs to be banned",
        )
        swarm.signal(honest[0], signal.SIGKILL)
        results += trainer.train(feed, steps=3)
        reports = [feed.report(r.step) for r in results]

        def published() -> TrainerPoint | None:  # the trainer's point of its last step, from the DHT
            points = map(TrainerPoint.from_dict, trainer.node.trainer_points("demo"))
            return next((p for p in points if p.trainer == trainer.node.peer_id and p.step == 6), None)

        def trainer_record() -> PeerRecord:
            return next(r for r in trainer.node.peers("demo") if r.peer_id == trainer.node.peer_id)

        wait_until(lambda: published() is not None, timeout_s=30, what="the point of step 6 in the DHT")
        wait_until(
            lambda: trainer_record().banned, timeout_s=30, what="the trainer's record to list its bans"
        )
        rl = published().rl  # what the dashboard and `swarmtrain status` show of the step
        assert rl.samples == 64 and math.isfinite(rl.reward) and rl.accuracy == rl.reward  # binary rewards
        assert rl.samples_per_s > 0 and rl.banned == 2 and rl.rejected >= G
        assert set(trainer_record().banned) == {ids[liar], ids[logprob_liar]}

        def survivor():
            return next((r for r in trainer.node.peers("demo") if r.peer_id == ids[honest[1]]), None)

        # the surviving honest peer follows the run's policy versions as the stages apply steps
        wait_until(lambda: survivor().step == 7, timeout_s=30, what="the rollout peer to take version 7")
        assert survivor().served > 0
        assert survivor().quantize == "8bit"

    assert [r.step for r in results] == list(range(7))
    assert all(math.isfinite(r.loss) for r in results)
    assert any(r.grad_norm and r.grad_norm > 0 for r in results), [r.grad_norm for r in results]
    assert all(r.completed == 4 and r.dropped == 0 for r in results)
    assert "claimed reward 1.0" in feed.banned[ids[liar]]
    assert feed.counts.rejected >= G  # the liar's whole reply went, none of it trained
    assert set(feed.banned) == {ids[liar], ids[logprob_liar]}  # the honest ones passed every check
    assert "behaviour log-probs of version" in feed.banned[ids[logprob_liar]]
    assert feed.counts.verify_failed >= 1 and feed.counts.verified >= 1
    assert feed.counts.max_logprob_gap >= 1.0  # the liar's; an honest check is far under the 0.1 tolerance
    for report in reports:
        assert 0 <= report["policy_lag"] <= 2, reports  # nothing staler than --max-staleness trained
        assert 0 <= report["reward"] <= 1


def live_processes_of_group(pgid: int) -> list[int]:
    """Processes of group `pgid` that have not exited (zombies do not count: this container's
    init may be slow to reap an orphan)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after '(comm)': state, ppid, pgrp
        except OSError:  # it exited while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def test_a_rollout_peer_stopped_by_sigterm_exits_cleanly_with_its_dht_process_and_daemon(local_swarm):
    swarm = local_swarm(
        model_config=MODEL,
        num_stages=1,
        rl=RLConfig(task="add", samples_per_prompt=G),
        rollout_peers=1,
        batch=BatchConfig(microbatch_size=16, microbatches_per_step=4),
    )
    name = next(n for n in swarm.procs if n.startswith("rollout"))
    proc = swarm.procs[name]
    assert len(live_processes_of_group(proc.pid)) >= 3  # the peer, its DHT process, its p2p daemon
    swarm.signal(name, signal.SIGTERM)  # to the peer alone, as `kill PID` would
    assert proc.wait(timeout=30) == 0, swarm.log_tail(name)
    wait_until(
        lambda: not live_processes_of_group(proc.pid),
        timeout_s=30,
        what="the rollout peer's DHT process and p2p daemon to exit with it",
    )


def test_grpo_trains_a_hugging_face_policy_through_the_swarm(local_swarm, tmp_path):
    """Part of the run's machinery is model-specific (cached decoding, the loss over its
    logits): the same RL run on a small random GPT-2 folder, warmed up until it is right
    sometimes. Its loss is finite, its gradient non-zero, its versions follow the steps, and
    the weights move."""
    import transformers

    from tests.hf_models import CONFIGS, HF, T

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS["gpt2"]()).save_pretrained(folder)
    config = {"path": str(folder), "seq_len": T}
    task = build_task("add", {"digits": 1})
    model = build_model(HF, config, device="cpu")
    cfg = LocalConfig(model={}, warmup_steps=150, warmup_batch_size=64, warmup_lr=3e-3, warmup_target=0.3)
    warmup(model, task, cfg, random.Random(0))
    save_model(model, tmp_path / "warm", builder=HF, config=config)

    swarm = local_swarm(
        model=HF,
        model_config=config,
        num_stages=2,
        loss="grpo",
        batch=BatchConfig(microbatch_size=8, microbatches_per_step=2, max_in_flight=2),
        optimizer=OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.0),
        coordinator_args=(
            "--task", "add", "--task-options", '{"digits": 1}', "--samples-per-prompt", "4",
            "--init-from", str(tmp_path / "warm"), "--checkpoint-every", "0",
        ),
    )  # fmt: skip
    rollout = swarm.spawn_rollout()
    with swarm.trainer() as trainer:
        before = trainer.fetch_states()
        feed = RolloutFeed(trainer)
        results = list(trainer.train(feed, steps=4))
        after = trainer.fetch_states()
        wait_until(
            lambda: any(
                r.peer_id == swarm.wait_ready(rollout) and r.step == 4 for r in trainer.node.peers("demo")
            ),
            timeout_s=30,
            what="the rollout peer to take version 4",
        )
    assert [r.step for r in results] == [0, 1, 2, 3]
    assert all(math.isfinite(r.loss) for r in results)
    assert any(r.grad_norm for r in results), [r.grad_norm for r in results]
    assert any(feed.report(r.step)["reward"] > 0 for r in results)
    moved = [k for k in before[1] if not torch.equal(before[1][k], after[1][k])]
    assert moved, "no parameter of the last stage changed"


def test_auto_peers_take_the_planners_roles_and_refill_a_stage_that_lost_its_last_replica(local_swarm):
    """`join --role auto` through a real swarm. The first auto peer samples (the stage is held
    and nothing samples); a small machine (two policy copies fit in --max-memory, a stage does
    not) samples too. The first one trains 100x slower than it samples, so holding a second
    replica of the stage would add ~1%: it stays a rollout peer while the stage peer lives.
    When that peer dies the planner's next checks move it to the empty stage, under the same
    peer id, and the run trains with the small machine sampling."""
    swarm = local_swarm(
        model_config=MODEL,
        num_stages=1,
        loss="grpo",
        batch=BatchConfig(microbatch_size=16, microbatches_per_step=2, max_in_flight=2),
        optimizer=OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.0),
        coordinator_args=("--task", "add", "--samples-per-prompt", str(G), "--checkpoint-every", "0"),
    )
    check = ("--rebalance-every", "1")
    flexible = swarm.spawn_role("auto", extra_args=("--slowdown", "100", *check))
    small = swarm.spawn_role("auto", extra_args=("--max-memory", "1.5MB", *check))
    ids = {name: swarm.wait_ready(name) for name in (flexible, small)}

    with swarm.trainer() as trainer:

        def record(name):
            return next((r for r in trainer.node.peers("demo") if r.peer_id == ids[name]), None)

        for name in (flexible, small):
            assert record(name).role == "rollout"
            assert record(name).capacity["role_auto"] is True
            assert record(name).capacity["decode_tokens_per_s"] > 0
        stage_peer = next(r for r in trainer.node.peers("demo") if r.role == "stage")
        assert "role_auto" not in stage_peer.capacity  # started as a stage peer: never moved
        stage_name = next(name for name in swarm.procs if name.startswith("stage"))
        swarm.signal(stage_name, signal.SIGKILL)
        wait_until(
            lambda: (
                record(flexible) is not None
                and record(flexible).role == "stage"
                and record(flexible).state == "serving"
            ),
            timeout_s=90,
            what="the auto rollout peer to hold the stage that lost its last replica",
        )
        assert record(small).role == "rollout"  # it fits no stage
        feed = RolloutFeed(trainer)
        results = list(trainer.train(feed, steps=2))
        assert feed.counts.samples >= 2 * 16 * 2
    assert [r.step for r in results] == [0, 1]
    assert all(math.isfinite(r.loss) and r.completed == 2 for r in results)
