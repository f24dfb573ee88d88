"""The protocol in one process: stage serving, replays, the commit and the trainer's step over
an in-memory network, with deterministic faults. Every case asserts that each microbatch
counted exactly once in every stage, and parity with single-process training: the same
per-step losses and, at the end, the same parameters on every replica."""

import asyncio
import itertools

import pytest
import torch

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.train.data import TokenBatches, loss_inputs_of, stdlib_text
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.train.reference import stage_state_dict
from swarmtrain.transport.memory import frame_is
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses

B, T = 4, TINY_GPT["seq_len"]
M = 4
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
TEXT = stdlib_text(2**20)
PARAM_ATOL = 1e-4
"""Gradients are summed in another order than in one process (per replica, then across
replicas): parameters agree to rounding, which AdamW amplifies a little."""


def manifest(*, stages=(0, 2, 4), schedule="readiness", microbatches=M) -> RunManifest:
    return RunManifest(
        run_id="protocol",
        model="tiny-gpt",
        model_config=TINY_GPT,
        num_blocks=TINY_GPT["n_layer"],
        stage_bounds=stages,
        optimizer=OPTIMIZER,
        batch=BatchConfig(microbatch_size=B, microbatches_per_step=microbatches, max_in_flight=4),
        schedule=schedule,
    )


def batches():
    return TokenBatches(TEXT, seq_len=T, microbatch_size=B, seed=0)


def train(config: InProcessConfig, steps: int, *, before=None, between=None):
    """Run `steps` steps; `before(swarm)` sets faults up, `between(swarm, result)` runs after each step."""

    async def scenario():
        data = iter(batches())
        async with InProcessSwarm(config) as swarm:
            if before is not None:
                before(swarm)
            results = []
            for _ in range(steps):
                mbs = [loss_inputs_of(next(data)) for _ in range(config.manifest.batch.microbatches_per_step)]
                results.append(await swarm.step(mbs))
                if between is not None:
                    await between(swarm, results[-1])
            return swarm, results

    return asyncio.run(scenario())


def assert_parity(swarm: InProcessSwarm, results):
    """Losses step by step, and every live replica's parameters, equal single-process training's;
    every microbatch counted once in every stage. Returns the reference's result."""
    m = swarm.manifest
    reference = reference_losses(
        seed=m.seed,
        optimizer=m.optimizer,
        batches=iter(batches()),
        steps=len(results),
        microbatches_per_step=m.batch.microbatches_per_step,
        max_steps=m.max_steps,
    )
    assert_losses_match_reference(results, reference)
    for result in results:
        assert result.completed + result.dropped == m.batch.microbatches_per_step
        for k in range(m.num_stages):
            assert sum(result.work[k].values()) == result.completed, f"stage {k} of step {result.step}"
    for name in (n for k in range(m.num_stages) for n in swarm.live(k)):
        replica = swarm.replicas[name]
        assert replica.runner.step == len(results)
        state = stage_state_dict(replica.runner.module)
        for key, value in state.items():
            torch.testing.assert_close(
                value, reference.state[key], rtol=0, atol=PARAM_ATOL, msg=f"{name}: {key}"
            )
    return reference


def test_replicated_stages_train_in_parity_and_stay_bit_identical():
    config = InProcessConfig(manifest=manifest(), replicas=(2, 2))
    swarm, results = train(config, 3)
    assert_parity(swarm, results)
    assert all(r.replays == 0 for r in results)
    for r in results:  # the verdict compares real digests: two replicas in each stage
        assert r.replicas_equal is True and r.replicas_compared == {0: 2, 1: 2}
    for k in (0, 1):  # both replicas of each stage took work
        took = {p for r in results for p, n in r.work[k].items() if n > 0}
        assert took == set(swarm.live(k))


def test_the_equality_verdict_is_none_when_no_stage_has_two_replicas():
    swarm, results = train(InProcessConfig(manifest=manifest(), replicas=(1, 1)), 1)
    assert_parity(swarm, results)
    assert results[0].replicas_equal is None and results[0].replicas_compared == {0: 1, 1: 1}


def test_a_lost_reply_to_the_trainer_is_replayed_and_answered_from_the_kept_gradient():
    config = InProcessConfig(manifest=manifest(), replicas=(1, 1), microbatch_timeout_s=1.5)
    lost = {}

    def before(swarm):
        lost["fault"] = swarm.network.lose_reply(frame_is("forward", stage=0, mb_id=None))

    swarm, results = train(config, 2, before=before)
    assert_parity(swarm, results)
    assert lost["fault"].hits == 1
    assert results[0].replay_causes == {"timeout": 1}
    assert results[0].timeouts == 1
    # The replay reached stage 0 again, which answered it from its kept input gradient: the
    # last stage ran its loss task once per microbatch, not once more for the replay.
    assert swarm.replicas["s0r0"].service.forward.cache.hits == 1
    assert swarm.replicas["s1r0"].tasks["loss"] == 2 * M


def test_a_replica_killed_mid_backward_is_replayed_from_the_kept_input_gradient_downstream():
    # Stage 0 has two replicas; s0r0 dies as its first backward starts: stage 1 already
    # computed that microbatch's loss and gradient. The trainer replays it to s0r1, whose
    # output is bit-identical, so stage 1 answers from its cache instead of recomputing.
    config = InProcessConfig(manifest=manifest(), replicas=(2, 1), window=1)

    def before(swarm):
        swarm.kill_on_task("s0r0", "backward", 1)

    swarm, results = train(config, 3, before=before)
    assert "s0r0" in swarm.dead
    assert_parity(swarm, results)
    assert results[0].replay_causes == {"peer unreachable": 1}
    assert swarm.replicas["s1r0"].service.forward.cache.hits >= 1
    # Stage 1 ran each microbatch's loss once: the replay did not recompute the pipeline.
    assert swarm.replicas["s1r0"].tasks["loss"] == 3 * M


def test_without_the_kept_gradient_the_mid_backward_replay_recomputes():
    # The same fault with the cache disabled: the loss task runs again for the replay. This is
    # what the case above would show if the kept-gradient answer were removed.
    config = InProcessConfig(manifest=manifest(), replicas=(2, 1), window=1)

    def before(swarm):
        swarm.kill_on_task("s0r0", "backward", 1)
        swarm.replicas["s1r0"].service.forward.cache.get = lambda mb, x: None

    swarm, results = train(config, 1, before=before)
    assert_parity(swarm, results)
    assert swarm.replicas["s1r0"].tasks["loss"] > M


def test_a_replica_killed_as_its_stage_starts_a_commit_loses_its_work_and_the_commit_repairs_it():
    # s1r0 dies as the trainer's first commit starts: the gradients of the microbatches it
    # served in step 0 are gone with it. The commit finds them missing in stage 1 and replays
    # them there; stage 0, which still has them, computes them again as replays and keeps
    # those copies apart, so it adds nothing twice.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 2))

    def before(swarm):
        swarm.network.on_delivery(frame_is("step", phase="prepare"), lambda: swarm.kill("s1r0"))

    swarm, results = train(config, 2, before=before)
    assert "s1r0" in swarm.dead
    lost = swarm.replicas["s1r0"].tasks["loss"]  # the router sends s1r0 the first microbatch
    assert lost >= 1
    assert_parity(swarm, results)
    assert results[0].replay_causes == {"lost with a replica (repaired at commit)": lost}
    assert results[0].work[1] == {"s1r1": M}


def test_a_replica_killed_mid_work_is_replayed_by_the_stage_before_it():
    # s1r0 dies as it starts its second loss task: stage 0 replays that microbatch to s1r1
    # itself, and whatever s1r0 had finished in that step the commit repairs. s1r1 is slow,
    # so the router gives s1r0 most of the work and a second loss task surely comes (with two
    # even replicas a busy machine can leave s1r0 one task in both steps).
    config = InProcessConfig(manifest=manifest(), replicas=(1, 2), slowdowns={"s1r1": 6.0})

    swarm, results = train(config, 2, before=lambda swarm: swarm.kill_on_task("s1r0", "loss", 2))
    assert "s1r0" in swarm.dead
    assert_parity(swarm, results)
    fatal = swarm.replicas["s1r0"].started[-1]
    causes = results[fatal.step].replay_causes
    assert causes["hop failure (replayed by a stage)"] >= 1
    assert set(causes) <= {"hop failure (replayed by a stage)", "lost with a replica (repaired at commit)"}


def test_a_duplicated_forward_counts_once():
    config = InProcessConfig(manifest=manifest(), replicas=(1, 1))
    dup = {}

    def before(swarm):
        dup["fault"] = swarm.network.duplicate(frame_is("forward", stage=1), times=2)

    swarm, results = train(config, 2, before=before)
    assert dup["fault"].hits == 2
    assert_parity(swarm, results)


def test_a_duplicated_apply_steps_once():
    config = InProcessConfig(manifest=manifest(), replicas=(2, 1))
    dup = {}

    def before(swarm):
        dup["fault"] = swarm.network.duplicate(frame_is("step", phase="apply"), times=3)

    swarm, results = train(config, 2, before=before)
    assert dup["fault"].hits == 3
    assert_parity(swarm, results)


def test_a_forward_delivered_after_its_step_is_refused_and_counts_nothing():
    # One step-0 forward to stage 1 arrives again, reordered after step 0 was applied: stage 1
    # refuses it (another step), and training goes on in parity.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 1))
    seen, refusals = [], []

    def before(swarm):
        deliver = swarm.network.deliver

        async def recording(sender, receiver, name, request, data):
            if request.kind == "forward" and request.stage == 1:
                seen.append(request)
            return await deliver(sender, receiver, name, request, data)

        swarm.network.deliver = recording

    async def between(swarm, result):
        if result.step == 0:
            late = swarm.replicas["s0r0"].service.ctx.transport
            try:
                await late.call("s1r0", swarm.replicas["s1r0"].service.ctx.handler, seen[0], timeout_s=5)
            except RemoteError as e:
                refusals.append(e)

    swarm, results = train(config, 2, before=before, between=between)
    assert [e.cause for e in refusals] == [Cause.WRONG_STEP]
    assert_parity(swarm, results)


def test_a_slow_replica_gets_less_work_and_parity_holds():
    config = InProcessConfig(manifest=manifest(microbatches=8), replicas=(1, 2), slowdowns={"s1r1": 6.0})
    swarm, results = train(config, 4)
    assert_parity(swarm, results)
    took = {p: sum(r.work[1].get(p, 0) for r in results) for p in ("s1r0", "s1r1")}
    assert took["s1r0"] > took["s1r1"], took


def test_the_static_schedule_routes_by_its_slots_in_parity():
    config = InProcessConfig(manifest=manifest(schedule="static"), replicas=(2, 2))
    swarm, results = train(config, 2)
    assert_parity(swarm, results)
    for r in results:  # microbatch n goes to replica n mod 2 of every stage: an even split
        for k in (0, 1):
            assert sorted(r.work[k].values()) == [M // 2, M // 2]


@pytest.mark.parametrize("stages,replicas", [((0, 1, 2, 4), (1, 2, 1)), ((0, 4), (2,))])
def test_other_layouts_train_in_parity(stages, replicas):
    config = InProcessConfig(manifest=manifest(stages=stages), replicas=replicas)
    swarm, results = train(config, 2)
    assert_parity(swarm, results)


def test_a_loss_over_extra_named_inputs_runs_through_the_pipeline_in_parity():
    # The manifest names a loss that takes per-token weights beside the targets: the weights
    # ride with every microbatch to the last stage, which computes the loss from both.
    from swarmtrain.train.reference import train_reference

    m = manifest()
    m = RunManifest(**{**m.to_dict(), "loss": "weighted_cross_entropy"})
    gen = torch.Generator().manual_seed(1)
    weighted = [
        (x, {"targets": y, "weights": torch.rand(y.shape, generator=gen)})
        for x, y in itertools.islice(batches(), 2 * M)
    ]

    async def scenario():
        async with InProcessSwarm(InProcessConfig(manifest=m, replicas=(1, 2))) as swarm:
            return [await swarm.step(weighted[s * M : (s + 1) * M]) for s in range(2)]

    results = asyncio.run(scenario())
    reference = train_reference(
        model="tiny-gpt",
        model_config=TINY_GPT,
        seed=m.seed,
        optimizer=m.optimizer,
        batches=iter(weighted),
        steps=2,
        microbatches_per_step=M,
        loss="weighted_cross_entropy",
    )
    assert_losses_match_reference(results, reference)
    unweighted = reference_losses(
        seed=m.seed, optimizer=m.optimizer, batches=iter(batches()), steps=1, microbatches_per_step=M
    )
    assert abs(results[0].loss - unweighted.losses[0]) > 1e-3  # the weights did change the loss


def test_malformed_protocol_fields_are_refused_as_bad_frames_and_strike_the_sender():
    from swarmtrain.wire.frames import Frame

    bad = [
        {"phase": "apply", "grad_scale": "1"},
        {"phase": "exchange", "fresh": "a b", "take": [], "group": ["s1r0"]},
        {"phase": "launch"},
    ]

    async def scenario():
        async with InProcessSwarm(InProcessConfig(manifest=manifest(), replicas=(1, 1))) as swarm:
            target = swarm.replicas["s1r0"].service.ctx

            async def call(meta):
                frame = Frame(kind="step", run_id="protocol", stage=1, step=0, meta=meta)
                try:
                    await swarm.trainer.call("s1r0", target.handler, frame, timeout_s=5)
                except RemoteError as e:
                    return e

            # an integer grad_scale is a number like any other: only the phase's state refuses it
            early = await call({"phase": "apply", "grad_scale": 1})
            errors = [await call(meta) for meta in bad]
            x, loss_inputs = loss_inputs_of(next(iter(batches())))
            x = swarm.replicas["s0r0"].runner.module.embed(x).detach()  # stage 1's input: (B, T, C)
            static = {"loss_scale": 0.5, "budget_s": 5.0, "slots": [0], "slot_counts": [1], "microbatches": 4}
            frame = Frame(
                kind="forward",
                run_id="protocol",
                mb_id="trainer:0.0:0",
                stage=1,
                step=0,
                tensors={"x": x, **loss_inputs},
                meta=static,
            )
            try:
                await swarm.network.transports["s0r0"].call("s1r0", target.handler, frame, timeout_s=5)
            except RemoteError as e:
                errors.append(e)
            late = await call({"phase": "prepare"})
            return early, errors, late

    early, errors, late = asyncio.run(scenario())
    assert "step 0 was not exchanged on this replica" in str(early) and early.cause == Cause.OWN_FAILURE
    assert [e.cause for e in errors] == [Cause.BAD_FRAME] * 4 and not any(e.retryable for e in errors)
    assert "'grad_scale' must be a number" in str(errors[0]) and "'fresh' must be a list" in str(errors[1])
    assert "unknown commit phase 'launch'" in str(errors[2])
    assert "forward meta slots name 1 stages, the run has 2" in str(errors[3])
    assert late.cause == Cause.BANNED  # three bad frames: the sender is banned
