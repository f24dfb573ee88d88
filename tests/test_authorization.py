"""Authorization: who may ask a stage replica for what.

The rule itself (`authority.refusal`, the resync rule) as pure unit tests; then the attacks
an outsider that joined the swarm can make with well-formed frames, each against an
in-process swarm: every frame is refused as UNAUTHORIZED with a strike, leaves no trace,
and training ends bit-identical to the same run without the attack."""

import asyncio
import itertools
import logging

import pytest
import torch

from swarmtrain.errors import Cause, ConfigError, RemoteError
from swarmtrain.train import step as step_module
from swarmtrain.train.authority import (
    RunAuthority,
    StepClaims,
    committed_step,
    join_sources,
    microbatch_id,
    refusal,
    resync_sources,
    trainer_of,
)
from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.inprocess import TRAINER, InProcessConfig, InProcessSwarm
from swarmtrain.train.reference import stage_state_dict
from swarmtrain.transport.memory import frame_is
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import Abort, Apply, Exchange, ForwardMeta, GradsMeta, Prepare
from swarmtrain.wire.metrics import TrainerPoint
from swarmtrain.wire.records import PeerRecord
from tests.test_protocol import assert_parity, batches, manifest

A, B, OUT = "trainerA", "trainerB", "outsider"
MEMBERS = {"s0r0": 0, "s0r1": 0, "s1r0": 1}


def refused(kind, caller, *, stage, mb_id="", trainers=(A,), group=None):
    r = refusal(kind, caller, stage=stage, mb_id=mb_id, trainers=trainers, stage_of=MEMBERS.get, group=group)
    return None if r is None else r.reason


# the rule


def test_microbatch_ids_name_their_trainer_in_full():
    peer = "12D3KooWJbW5C6zZ6GwV4Qm7yU9dF1iKc3pE2xHnTqRsaLvMbN8o"
    assert trainer_of(microbatch_id(peer, 3, 7, 2)) == peer
    assert trainer_of("t:0:0") == "t" and trainer_of("no-colons") is None and trainer_of(":0.0:1") is None


def test_commit_phases_only_from_an_authorized_trainer():
    assert refused("step", A, stage=1) is None
    assert (
        refused("step", "s0r0", stage=1)
        == "peer s0r0 is not a trainer this run's owner authorized: only they may send commit phases"
    )
    assert refused("step", OUT, stage=0, trainers=None) is None  # an open run


def test_stage_zero_serves_a_trainer_only_its_own_microbatches():
    assert refused("forward", A, stage=0, mb_id=microbatch_id(A, 0, 0, 0)) is None
    assert "only they may send microbatches into stage 0" in refused(
        "forward", OUT, stage=0, mb_id="outsider:0.0:0"
    )
    hijack = refused("forward", B, stage=0, mb_id=microbatch_id(A, 0, 0, 0), trainers=(A, B))
    assert "belongs to trainer trainerA, not to peer trainerB" in hijack
    assert "names no trainer" in refused("forward", A, stage=0, mb_id="0")
    # an open run authorizes any trainer, but still only for its own microbatches
    assert refused("forward", OUT, stage=0, mb_id=microbatch_id(A, 0, 0, 0), trainers=None) is not None


def test_a_later_stage_serves_the_stage_before_for_authorized_trainers():
    mb = microbatch_id(A, 0, 0, 0)
    assert refused("forward", "s0r1", stage=1, mb_id=mb) is None
    assert "is not a replica of stage 0" in refused("forward", OUT, stage=1, mb_id=mb)
    assert "is not a replica of stage 0" in refused("forward", "s1r0", stage=1, mb_id=mb)
    assert "not one of a trainer" in refused("forward", "s0r0", stage=1, mb_id=microbatch_id(OUT, 0, 0, 0))


def test_grads_only_from_the_stage_and_its_exchange_group_and_state_only_to_members():
    assert refused("grads", "s0r1", stage=0) is None
    assert "only its replicas exchange gradients" in refused("grads", "s1r0", stage=0)
    assert "exchange group" in refused("grads", "s0r1", stage=0, group={"s0r0"})
    assert refused("grads", "s0r1", stage=0, group={"s0r0", "s0r1"}) is None
    assert refused("state", "s0r1", stage=0) is None and refused("state", A, stage=0) is None
    assert "only they may download its state" in refused("state", "s1r0", stage=0)
    assert refused("ping", OUT, stage=0) is None


def test_only_membership_refusals_are_worth_a_fresher_view():
    def membership(kind, caller, stage, mb_id=""):
        r = refusal(kind, caller, stage=stage, mb_id=mb_id, trainers=(A,), stage_of=MEMBERS.get)
        return r.membership

    assert membership("grads", OUT, 0) and membership("state", OUT, 0)
    assert membership("forward", OUT, 1, microbatch_id(A, 0, 0, 0))
    assert not membership("step", OUT, 0) and not membership("forward", OUT, 0, "outsider:0.0:0")


def test_an_unknown_peer_is_decided_again_after_one_refresh_at_most_once_per_interval():
    members, now = {}, [100.0]

    async def refresh():
        members.update(MEMBERS)

    async def scenario():
        authority = RunAuthority(
            trainers=lambda: (A,),
            stage_of=members.get,
            refresh=refresh,
            refresh_interval_s=1.0,
            clock=lambda: now[0],
        )
        first = await authority.check("state", "s0r1", stage=0)  # joined a heartbeat ago
        outsider = await authority.check("state", OUT, stage=0)  # within the interval: no refresh
        now[0] += 1.0
        later = await authority.check("state", OUT, stage=0)
        return authority.refreshes, first, outsider, later

    refreshes, first, outsider, later = asyncio.run(scenario())
    assert first is None and outsider is not None and later is not None
    assert refreshes == 2


def test_a_caller_only_membership_refuses_is_spared_strikes_for_the_grace_then_struck():
    now = [100.0]

    async def refresh():  # a DHT read that comes back without the caller (a congested link)
        pass

    async def scenario():
        authority = RunAuthority(
            trainers=lambda: (A,),
            stage_of=MEMBERS.get,
            refresh=refresh,
            refresh_interval_s=1.0,
            unknown_grace_s=30.0,
            clock=lambda: now[0],
        )
        mb = microbatch_id(A, 0, 0, 0)
        first = await authority.check("forward", "newcomer", stage=1, mb_id=mb)
        now[0] += 29.0
        within = await authority.check("forward", "newcomer", stage=1, mb_id=mb)
        now[0] += 1.0
        past = await authority.check("forward", "newcomer", stage=1, mb_id=mb)
        # refusals membership does not decide are never spared
        hijack = await authority.check("forward", "s0r1", stage=0, mb_id=mb)
        return first, within, past, hijack

    first, within, past, hijack = asyncio.run(scenario())
    assert first.pending and within.pending and "is not a replica of stage 0" in first.reason
    assert past is not None and not past.pending
    assert hijack is not None and not hijack.membership and not hijack.pending
    with pytest.raises(ConfigError, match="unknown_grace_s must be >= 0"):
        RunAuthority(trainers=lambda: None, stage_of=MEMBERS.get, refresh=refresh, unknown_grace_s=-1)


def test_a_membership_proof_admits_a_caller_the_view_lacks_without_a_refresh():
    members, refreshes = dict(MEMBERS), []

    async def refresh():  # a DHT read that comes back without the caller (a congested link)
        refreshes.append(1)

    def prove(caller, proof):
        if proof != f"signed record of {caller} at stage 0":
            return False
        members[caller] = 0
        return True

    async def scenario():
        authority = RunAuthority(trainers=lambda: (A,), stage_of=members.get, refresh=refresh, prove=prove)
        mb = microbatch_id(A, 0, 0, 0)
        proven = await authority.check(
            "forward", "newcomer", stage=1, mb_id=mb, proof="signed record of newcomer at stage 0"
        )
        forged = await authority.check(
            "forward", "other", stage=1, mb_id=mb, proof="signed record of newcomer at stage 0"
        )
        return proven, forged

    proven, forged = asyncio.run(scenario())
    assert proven is None and members["newcomer"] == 0 and refreshes == [1]  # only the forged one refreshed
    assert forged is not None and forged.pending and "other" not in members


def test_resync_goes_only_to_steps_an_authorized_trainer_committed():
    points = [
        TrainerPoint(trainer=A, step=4, loss=1.0, tokens_per_s=1.0, t=0.0),
        TrainerPoint(trainer=OUT, step=99, loss=1.0, tokens_per_s=1.0, t=0.0),  # not authorized
    ]
    assert committed_step(points, (A,)) == 4
    assert committed_step(points, None) == 99  # an open run counts every trainer
    assert committed_step(points[1:], (A,)) is None
    replicas = [("forger", 1000), ("r1", 5), ("r2", 4), ("r3", 3)]
    # step 4 committed: a replica is at most at step 5
    assert resync_sources(replicas, 3, 4) == (["r1", "r2"], [("forger", 1000)])
    assert resync_sources(replicas, 5, 4) == ([], [("forger", 1000)])
    assert resync_sources(replicas, 3, None) == ([], [("forger", 1000), ("r1", 5), ("r2", 4)])
    # a joiner tries the plausible replicas first, furthest first; the forger last
    assert join_sources(replicas, 4) == ["r1", "r2", "r3", "forger"]
    assert join_sources([("forger", 9), ("r1", 0)], None) == ["r1", "forger"]  # a fresh run is at step 0


def test_a_stage_peer_resyncs_from_committed_claims_and_warns_once_about_a_forged_one(caplog):
    claims = StepClaims(lambda: (A,))
    records = [PeerRecord(peer_id=p, role="stage", stage=0, step=s) for p, s in (("forger", 1000), ("r1", 5))]
    points = [
        TrainerPoint(trainer=A, step=4, loss=1.0, tokens_per_s=1.0, t=0.0).to_dict(),
        TrainerPoint(trainer=OUT, step=999, loss=1.0, tokens_per_s=1.0, t=0.0).to_dict(),
        {"trainer": A, "step": "many"},  # malformed: skipped
    ]
    with caplog.at_level(logging.WARNING, logger="swarmtrain.train.authority"):
        assert claims.resync_from(records, 3, points) == ["r1"]
        assert claims.resync_from(records, 3, points) == ["r1"]
        assert claims.resync_from(records, 5, points[1:]) == []  # nothing committed: no resync
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "replica forger claims step 1000" in warned[0] and "furthest: 4" in warned[0]
    assert claims.join_from(records, points) == ["r1", "forger"]


# the attacks, in process

STEPS = 2


def config() -> InProcessConfig:
    """Static routes and compute order: two runs of it are bit-identical."""
    return InProcessConfig(manifest=manifest(schedule="static"), replicas=(2, 2))


def run(attack=None):
    """Train STEPS steps; `attack(swarm, moment)` runs between steps ('between', after step 0),
    as step 1's first forward reaches stage 1 ('flow'), and as its commit starts ('commit')."""

    async def scenario():
        data = iter(batches())
        async with InProcessSwarm(config()) as swarm:
            strikes = record_strikes(swarm)
            fired, started = [], set()
            if attack is not None:
                for moment, match in (("flow", frame_is("forward", stage=1)), ("commit", frame_is("step"))):

                    def fire(moment=moment):
                        if swarm.trainer_step == 1 and moment not in started:
                            started.add(moment)
                            fired.append(asyncio.ensure_future(attack(swarm, moment)))

                    swarm.network.on_delivery(match, fire, times=1000)
            results = []
            for s in range(STEPS):
                mbs = [loss_inputs_of(next(data)) for _ in range(swarm.manifest.batch.microbatches_per_step)]
                results.append(await swarm.step(mbs))
                if s == 0 and attack is not None:
                    await attack(swarm, "between")
            await asyncio.gather(*fired)
            return swarm, results, strikes, len(fired)

    return asyncio.run(scenario())


def record_strikes(swarm) -> list[tuple[str, str, str]]:
    """(replica, struck peer, reason) for every strike a replica makes from now on."""
    seen = []
    for name, replica in swarm.replicas.items():
        transport = replica.service.ctx.transport

        def recording(peer, reason, name=name, strike=transport.strike):
            seen.append((name, peer, reason))
            strike(peer, reason)

        transport.strike = recording
    return seen


@pytest.fixture(scope="module")
def unattacked():
    swarm, results, _, _ = run()
    return [r.loss for r in results], params(swarm)


def params(swarm) -> dict[str, dict[str, torch.Tensor]]:
    return {n: stage_state_dict(r.runner.module) for n, r in swarm.replicas.items()}


_outsiders = itertools.count()


async def send(swarm, frame: Frame, to: str) -> RemoteError:
    """`frame` from a fresh outsider (one strike each, so none is banned); its refusal."""
    outsider = swarm.network.transport(f"outsider{next(_outsiders)}")
    with pytest.raises(RemoteError) as info:
        await outsider.call(to, swarm.replicas[to].service.ctx.handler, frame, timeout_s=5)
    return info.value


def assert_no_trace(swarm, step: int) -> None:
    for name, replica in swarm.replicas.items():
        runner = replica.runner
        assert runner.step == step, name
        assert not runner.has_gradients and runner.num_pending == 0, name
        assert replica.service.commit.exchange_group(step, 0) is None, name


async def commit_phases(swarm, moment):
    errors = []
    for name, replica in swarm.replicas.items():
        group = (name, "outsider")
        for request in (Prepare(), Exchange(fresh=(), take=(), group=group), Apply(), Abort()):
            frame = Frame(
                kind="step",
                run_id="protocol",
                stage=replica.stage,
                step=swarm.trainer_step,
                meta=request.to_meta(),
            )
            errors.append(await send(swarm, frame, name))
    return errors, "only they may send commit phases"


async def gradients(swarm, moment):
    errors = []
    for name, replica in swarm.replicas.items():
        poison = {str(i): torch.full_like(g, 1e3) for i, g in enumerate(replica.runner.grads())}
        meta = GradsMeta(attempt=0).to_meta()
        frame = Frame(
            kind="grads",
            run_id="protocol",
            stage=replica.stage,
            step=replica.runner.step,
            tensors=poison,
            meta=meta,
        )
        errors.append(await send(swarm, frame, name))
    return errors, "only its replicas exchange gradients"


def hijacked_forwards(swarm, stage: int):
    """Forwards under the trainer's ids of the next step (the epoch is guessed exactly), with
    the outsider's own data; at stage 1, its input as stage 0 would send it."""
    epoch = next(step_module._epochs) + 1  # the next step's epoch
    x, loss_inputs = loss_inputs_of(next(iter(batches())))
    if stage == 1:
        x = swarm.replicas["s0r0"].runner.module.embed(x).detach()  # (B, T, C)
    meta = ForwardMeta(loss_scale=0.25, budget_s=5.0, slots=(0, 0), slot_counts=(1, 1), microbatches=4)
    for n in range(swarm.manifest.batch.microbatches_per_step):
        mb = microbatch_id(TRAINER, swarm.trainer_step, epoch, n)
        yield Frame(
            kind="forward",
            run_id="protocol",
            mb_id=mb,
            stage=stage,
            step=swarm.trainer_step,
            tensors={"x": x, **loss_inputs},
            meta=meta.to_meta(),
        )


async def forwards_at(stage: int, swarm, moment):
    errors = []
    for frame in hijacked_forwards(swarm, stage):
        for name in swarm.live(stage):
            errors.append(await send(swarm, frame, name))
            kept = swarm.replicas[name].service.forward.cache.get(frame.mb_id, frame.tensors["x"])
            assert kept is None
    lacks = "only they may send microbatches into stage 0" if stage == 0 else "is not a replica of stage 0"
    return errors, lacks


async def state(swarm, moment):
    frame = lambda k: Frame(kind="state", run_id="protocol", stage=k)  # noqa: E731
    errors = [await send(swarm, frame(r.stage), name) for name, r in swarm.replicas.items()]
    return errors, "only they may download its state"


ATTACKS = {
    "commit phases (poison, stall, split)": commit_phases,
    "gradients (poison)": gradients,
    "forwards at stage 0 under the trainer's ids (hijack)": lambda *a: forwards_at(0, *a),
    "forwards at stage 1 (hijack)": lambda *a: forwards_at(1, *a),
    "state (read)": state,
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_outsiders_attack_is_refused_and_training_ends_as_without_it(name, unattacked):
    refusals = []

    async def attack(swarm, moment):
        errors, lacks = await ATTACKS[name](swarm, moment)
        refusals.extend((moment, e, lacks) for e in errors)
        if moment == "between":
            assert_no_trace(swarm, 1)

    swarm, results, strikes, fired = run(attack)
    assert fired == 2  # the attack also ran mid-flow and mid-commit
    assert {moment for moment, _, _ in refusals} == {"between", "flow", "commit"}
    for _, error, lacks in refusals:
        assert error.cause == Cause.UNAUTHORIZED and not error.retryable, error
        assert lacks in str(error), error
    assert len(strikes) == len(refusals) and all(peer.startswith("outsider") for _, peer, _ in strikes)
    losses, unattacked_params = unattacked
    assert [r.loss for r in results] == losses
    assert all(r.replicas_equal for r in results)
    for replica, state_dict in params(swarm).items():
        for key, value in state_dict.items():
            assert torch.equal(value, unattacked_params[replica][key]), f"{replica}: {key}"


def test_the_unattacked_run_is_in_parity_with_single_process_training():
    swarm, results, strikes, _ = run()
    assert_parity(swarm, results)
    assert strikes == []


def test_an_outsider_may_still_ping():
    async def scenario():
        async with InProcessSwarm(config()) as swarm:
            outsider = swarm.network.transport("outsider")
            return await outsider.call(
                "s1r0",
                swarm.replicas["s1r0"].service.ctx.handler,
                Frame(kind="ping", run_id="protocol", stage=1),
                timeout_s=5,
            )

    assert asyncio.run(scenario()).kind == "pong"


def test_a_replica_that_just_joined_is_served_its_state_after_one_refresh():
    async def scenario():
        data = iter(batches())
        async with InProcessSwarm(InProcessConfig(manifest=manifest(), replicas=(1, 1))) as swarm:
            strikes = record_strikes(swarm)
            step = lambda: swarm.step([loss_inputs_of(next(data)) for _ in range(4)])  # noqa: E731
            first = await step()
            joined = await swarm.join(0)  # not yet in the others' view of the membership
            second = await step()
            return swarm, joined, [first, second], strikes

    swarm, joined, results, strikes = asyncio.run(scenario())
    assert joined.name == "s0r1" and strikes == []
    assert swarm.replicas["s0r0"].service.ctx.authority.refreshes == 1
    assert results[1].replicas_equal is True and results[1].replicas_compared[0] == 2
    assert_parity(swarm, results)
