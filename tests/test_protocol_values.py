"""Absurd values and blame in the protocol, in one process: activations and exchange gradients
of 1e30 are refused and their sender struck, a stage's own compute failure is its own and is
replayed elsewhere, a commit that would overflow the optimizer is refused before any stage
applies. Where training goes on, it does so in parity with single-process training."""

import asyncio

import pytest
import torch

import swarmtrain.train.commit as commit_module
from swarmtrain.errors import Cause, RemoteError
from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.train.step import StepFailedError
from swarmtrain.wire.frames import Frame
from tests.conftest import TINY_GPT
from tests.test_protocol import assert_parity, batches, manifest, train

STRAIN = 1e30


def record_strikes(swarm: InProcessSwarm) -> list[tuple[str, str]]:
    """(striking replica, struck peer) for every strike from now on."""
    strikes = []
    for name, transport in swarm.network.transports.items():
        original = transport.strike

        def strike(peer, reason, name=name, original=original):
            strikes.append((name, peer))
            original(peer, reason)

        transport.strike = strike
    return strikes


def record_errors(swarm: InProcessSwarm) -> list[tuple[str, str, Cause, bool]]:
    """(caller, callee, cause, retryable) of every error reply from now on."""
    errors = []
    deliver = swarm.network.deliver

    async def recording(sender, receiver, name, request, data):
        reply = await deliver(sender, receiver, name, request, data)
        if reply.kind == "error":
            errors.append((sender, receiver, reply.error_cause(), bool(reply.meta.get("retryable", True))))
        return reply

    swarm.network.deliver = recording
    return errors


def test_an_upstream_replica_sending_absurd_activations_is_struck_and_the_microbatch_replayed():
    # s0r0's first output is 1e30 everywhere (finite): stage 1 refuses it as a bad frame and
    # strikes s0r0; s0r0 answers the trainer with its own failure, and the trainer replays
    # the microbatch on s0r1. Nothing of the bad output is counted: parity holds.
    config = InProcessConfig(manifest=manifest(), replicas=(2, 1))
    seen = {}

    def before(swarm):
        runner = swarm.replicas["s0r0"].runner
        forward = runner.forward

        def absurd_once(mb, x):
            out = forward(mb, x)
            if "absurd" not in seen:
                seen["absurd"] = mb
                return torch.full_like(out, STRAIN)
            return out

        runner.forward = absurd_once
        seen["strikes"] = record_strikes(swarm)
        seen["errors"] = record_errors(swarm)

    swarm, results = train(config, 3, before=before)
    assert_parity(swarm, results)
    assert seen["strikes"] == [("s1r0", "s0r0")]
    assert ("s0r0", "s1r0", Cause.BAD_FRAME, False) in seen["errors"]
    assert ("trainer", "s0r0", Cause.OWN_FAILURE, True) in seen["errors"]
    assert results[0].replay_causes == {"downstream failure": 1}


def test_a_self_announced_member_sending_absurd_activations_is_refused_and_struck_and_training_goes_on():
    # In an open swarm anyone may announce itself as a replica of stage 0 and so pass the
    # membership rule: the bounds still refuse what it sends.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 1))
    refusals = []

    async def between(swarm, result):
        if result.step != 0:
            return
        strikes = record_strikes(swarm)
        outsider = swarm.network.transport("outsider")
        swarm.members["outsider"] = 0
        x, loss_inputs = loss_inputs_of(next(iter(batches())))
        frame = Frame(
            kind="forward",
            run_id="protocol",
            mb_id="trainer:1.0:0",
            stage=1,
            step=1,
            tensors={"x": torch.full((*x.shape, TINY_GPT["d_model"]), STRAIN), **loss_inputs},
            meta={"loss_scale": 0.25, "budget_s": 5.0},
        )
        with pytest.raises(RemoteError) as info:
            await outsider.call("s1r0", swarm.replicas["s1r0"].service.ctx.handler, frame, timeout_s=5)
        refusals.append((info.value, list(strikes)))

    swarm, results = train(config, 3, between=between)
    assert_parity(swarm, results)
    (error, strikes), *_ = refusals
    assert error.cause == Cause.BAD_FRAME and not error.retryable
    assert "input activations of stage 1 out of bounds" in str(error)
    assert strikes == [("s1r0", "outsider")]
    assert swarm.replicas["s1r0"].runner.num_pending == 0


def test_exchange_gradients_of_1e30_are_refused_the_sender_struck_and_the_commit_planned_again(monkeypatch):
    # s1r1 sends s1r0 a gradient sum of 1e30 once (keeping its own sum honest): s1r0 refuses
    # it, strikes s1r1 and fails its exchange at once; the trainer plans the commit again and
    # the next exchange is clean. Nothing absurd reaches an optimizer: parity, bit-identical
    # replicas, and parameters that keep changing.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 2))
    seen = {"sent": 0}
    compress = commit_module.compress_for_exchange

    def before(swarm):
        own = swarm.replicas["s1r1"].runner.params[0].grad

        def absurd_once(grads, codec, feedback):
            sent, local = compress(grads, codec, feedback)
            if grads[0] is own and seen["sent"] == 0:
                seen["sent"] += 1
                sent = {k: torch.full_like(v, STRAIN) for k, v in sent.items()}
            return sent, local

        monkeypatch.setattr(commit_module, "compress_for_exchange", absurd_once)
        seen["strikes"] = record_strikes(swarm)
        seen["errors"] = record_errors(swarm)

    digests = []

    async def between(swarm, result):
        digests.append(swarm.replicas["s1r0"].runner.param_digest())

    swarm, results = train(config, 3, before=before, between=between)
    assert seen["sent"] == 1
    assert_parity(swarm, results)
    assert all(r.replicas_equal for r in results)
    assert len(set(digests)) == 3  # every step changed the parameters
    assert seen["strikes"] == [("s1r0", "s1r1")]
    assert ("s1r1", "s1r0", Cause.BAD_FRAME, False) in seen["errors"]
    assert ("trainer", "s1r0", Cause.REFUSED, True) in seen["errors"]  # its exchange failed at once


def test_a_failure_of_a_stage_own_compute_is_its_own_and_is_replayed_on_another_replica():
    # s1r0 runs out of memory on its first microbatch: it answers OWN_FAILURE (retryable), the
    # caller s0r0 is not struck and replays the microbatch on s1r1.
    config = InProcessConfig(manifest=manifest(), replicas=(1, 2))
    seen = {"failed": 0}

    def before(swarm):
        runner = swarm.replicas["s1r0"].runner
        compute = runner.forward_loss_backward

        def out_of_memory_once(*args, **kw):
            if seen["failed"] == 0:
                seen["failed"] += 1
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return compute(*args, **kw)

        runner.forward_loss_backward = out_of_memory_once
        seen["strikes"] = record_strikes(swarm)
        seen["errors"] = record_errors(swarm)

    swarm, results = train(config, 2, before=before)
    assert seen["failed"] == 1
    assert_parity(swarm, results)
    assert seen["strikes"] == []
    assert seen["errors"] == [("s0r0", "s1r0", Cause.OWN_FAILURE, True)]
    assert results[0].replay_causes == {"hop failure (replayed by a stage)": 1}
    assert swarm.replicas["s0r0"].service.counters.replayed == 1


def test_a_commit_whose_total_would_overflow_the_optimizer_is_refused_before_any_stage_applies():
    # 1e25 planted in s1r0's accumulated sum just before its exchange: its square overflows
    # fp32, so the exchange is refused and the step fails; no stage applied anything.
    config = InProcessConfig(manifest=manifest(), replicas=(2, 1))

    async def scenario():
        data = iter(batches())
        async with InProcessSwarm(config) as swarm:
            before = {n: r.runner.param_digest() for n, r in swarm.replicas.items()}

            def plant():
                with torch.no_grad():
                    swarm.replicas["s1r0"].runner.params[0].grad[0] = 1e25

            swarm.network.on_delivery(
                lambda s, r, f: f.kind == "step" and f.meta.get("phase") == "exchange" and r == "s1r0", plant
            )
            mbs = [loss_inputs_of(next(data)) for _ in range(config.manifest.batch.microbatches_per_step)]
            with pytest.raises(
                StepFailedError, match="a stage refused to commit.*beyond what the optimizer can square"
            ):
                await swarm.step(mbs)
            after = {n: r.runner.param_digest() for n, r in swarm.replicas.items()}
            steps = {n: r.runner.step for n, r in swarm.replicas.items()}
            return before, after, steps

    before, after, steps = asyncio.run(scenario())
    assert after == before
    assert set(steps.values()) == {0}
