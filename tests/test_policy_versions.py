"""Policy versions: what a replica keeps (pure), who may fetch, and fetches over an in-memory
swarm: exact and compressed, across commits, from a replica that dies, and refused once gone."""

import asyncio
import dataclasses
import itertools

import pytest
import torch

from swarmtrain.errors import BadFrameError, Cause, ConfigError, RemoteError
from swarmtrain.model import build_model
from swarmtrain.model.param_names import model_param_name
from swarmtrain.rl.weights import (
    FetchConfig,
    PolicySource,
    candidates,
    fetch_version,
    latest_version,
    plan_requests,
)
from swarmtrain.train.authority import refusal
from swarmtrain.train.data import TokenBatches, loss_inputs_of, stdlib_text
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.train.versions import PolicyVersions, VersionsConfig, describe_versions
from swarmtrain.transport import handler_name
from swarmtrain.transport.memory import frame_is
from swarmtrain.wire.frames import MAX_TENSORS, Frame
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest
from tests.conftest import TINY_GPT


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def params(value: float) -> dict[str, torch.Tensor]:
    value = float(value)
    return {"a.w": torch.full((4, 3), value), "b.s": torch.tensor(value)}


ALL = [("a.w", 0, 4), ("b.s", 0, 1)]


# what a replica keeps


def test_a_replica_nobody_asked_keeps_no_snapshot_and_serves_only_its_current_version():
    versions = PolicyVersions()
    for step in range(3):
        versions.before_apply(step, params(step))
    assert versions.stats.snapshots == 0 and versions.held(3) == [3]
    a, s = versions.read(3, 3, params(3.0), ALL)
    assert torch.equal(a, torch.full((4, 3), 3.0)) and float(s) == 3.0
    with pytest.raises(RemoteError, match=r"version 2 is gone: this replica holds versions 3$") as gone:
        versions.read(2, 3, params(3.0), ALL)
    assert gone.value.cause == Cause.VERSION_GONE and gone.value.retryable
    with pytest.raises(RemoteError, match="version 4 is not here yet") as early:
        versions.read(4, 3, params(3.0), ALL)
    assert early.value.cause == Cause.WRONG_STEP


def test_once_asked_a_replica_keeps_the_outgoing_version_at_each_commit_up_to_keep_versions():
    clock = Clock()
    versions = PolicyVersions(VersionsConfig(keep_versions=3, interest_s=10, lease_s=0), clock=clock)
    versions.mark_interest()
    for step in range(4):  # versions 0..3 snapshotted as they go out; 4 is live
        versions.before_apply(step, params(step))
    assert versions.held(4) == [2, 3, 4] and versions.stats.snapshots == 4
    assert versions.stats.held_bytes == 2 * (12 + 1) * 4
    (a, _) = versions.read(2, 4, params(4.0), ALL)
    assert torch.equal(a, torch.full((4, 3), 2.0))
    clock.now = 11.0  # interest lapsed: nothing more is copied, what was kept ages out
    versions.before_apply(4, params(4))
    assert versions.held(5) == [3, 5]
    versions.before_apply(5, params(5))
    assert versions.held(6) == [6] and versions.stats.snapshots == 4


def test_a_version_read_lately_is_kept_one_commit_longer_and_reset_forgets_everything():
    clock = Clock()
    versions = PolicyVersions(VersionsConfig(keep_versions=2, lease_s=5), clock=clock)
    versions.mark_interest()
    versions.before_apply(0, params(0))
    versions.read_held(0, ALL)  # a fetch of version 0 is in flight
    versions.before_apply(1, params(1))
    assert versions.held(2) == [0, 1, 2]
    clock.now = 6.0
    versions.before_apply(2, params(2))
    assert versions.held(3) == [2, 3]
    versions.reset()
    assert versions.held(3) == [3] and versions.stats.held_bytes == 0


def test_pieces_are_rows_of_named_parameters():
    versions = PolicyVersions()
    rows = versions.read(0, 0, {"a.w": torch.arange(12.0).view(4, 3)}, [("a.w", 1, 3)])
    assert torch.equal(rows[0], torch.arange(3.0, 9.0).view(2, 3))
    with pytest.raises(BadFrameError, match="no parameter 'x'"):
        versions.read(0, 0, params(0), [("x", 0, 1)])
    with pytest.raises(BadFrameError, match="rows 0..4, a piece asks for 2..5"):
        versions.read(0, 0, params(0), [("a.w", 2, 5)])
    assert describe_versions([4, 6, 7]) == "4, 6..7" and describe_versions([]) == "none"
    with pytest.raises(ConfigError, match="keep_versions"):
        VersionsConfig(keep_versions=0)


# the client's plan


def test_requests_fit_the_byte_limit_splitting_a_large_parameter_by_rows():
    specs = [
        ("big", torch.Size([10, 4]), torch.float32),  # 16 bytes a row
        ("small", torch.Size([3]), torch.float32),
        ("scalar", torch.Size([]), torch.float32),
    ]
    plan = plan_requests(specs, 64)
    assert plan == [
        [("big", 0, 4)],
        [("big", 4, 8)],
        [("big", 8, 10), ("small", 0, 3), ("scalar", 0, 1)],
    ]
    many = [(f"p{i}", torch.Size([1]), torch.float32) for i in range(MAX_TENSORS + 1)]
    assert [len(r) for r in plan_requests(many, 2**20)] == [MAX_TENSORS, 1]
    with pytest.raises(ConfigError, match="one row of parameter 'big' is 16 bytes"):
        plan_requests(specs, 8)


def test_replicas_at_the_version_are_asked_first_then_those_past_it_then_those_behind():
    replicas = [("behind", 3), ("far", 7), ("at", 5), ("next", 6)]
    assert candidates(replicas, 5) == ["at", "next", "far", "behind"]


def test_weights_are_open_unless_the_manifest_lists_readers():
    def ask(caller, readers):
        return refusal(
            "weights",
            caller,
            stage=1,
            trainers={"trainer"},
            stage_of={"s1": 1, "s0": 0}.get,
            owner="owner",
            weight_readers=readers,
        )

    assert ask("stranger", None) is None
    for caller in ("reader", "s1", "trainer", "owner"):
        assert ask(caller, {"reader"}) is None
    for caller in ("stranger", "s0"):
        refused = ask(caller, {"reader"})
        assert "weight readers" in refused.reason and refused.membership
    with pytest.raises(ConfigError, match="weight_readers"):
        manifest(weight_readers=["not a peer id"])


# over an in-memory swarm

B, T, M = 4, TINY_GPT["seq_len"], 2
HANDLER = handler_name("versions")


def manifest(**kw) -> RunManifest:
    return RunManifest(
        run_id="versions",
        model="tiny-gpt",
        model_config=TINY_GPT,
        num_blocks=TINY_GPT["n_layer"],
        stage_bounds=(0, 2, 4),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2),
        batch=BatchConfig(microbatch_size=B, microbatches_per_step=M, max_in_flight=4),
        **kw,
    )


def source_of(swarm: InProcessSwarm) -> PolicySource:
    async def replicas():
        return {
            k: [(n, swarm.replicas[n].runner.step) for n in swarm.live(k)]
            for k in range(swarm.manifest.num_stages)
        }

    return PolicySource(
        manifest=swarm.manifest, transport=swarm.network.transport("rollout"), replicas=replicas
    )


def live_params(swarm: InProcessSwarm) -> dict[str, torch.Tensor]:
    """The whole model's trained parameters, from the first live replica of each stage."""
    out = {}
    for k in range(swarm.manifest.num_stages):
        runner = swarm.replicas[swarm.live(k)[0]].runner
        out |= {model_param_name(n): p.detach().clone() for n, p in runner.named_params.items()}
    return out


def assert_equal(fetched, expected):
    assert fetched.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(fetched[name], t), name


def run(scenario, replicas=(1, 2), **manifest_fields):
    async def main():
        data = iter(TokenBatches(stdlib_text(2**18), seq_len=T, microbatch_size=B, seed=0))
        config = InProcessConfig(manifest=manifest(**manifest_fields), replicas=replicas)
        async with InProcessSwarm(config) as swarm:

            async def step():
                await swarm.step([loss_inputs_of(b) for b in itertools.islice(data, M)])

            return await scenario(swarm, source_of(swarm), step)

    return asyncio.run(main())


def test_versions_fetched_exact_are_the_stages_parameters_at_those_steps_and_old_ones_are_refused():
    async def scenario(swarm, source, step):
        await step()
        assert await latest_version(source) == 1
        v1 = live_params(swarm)
        got, stats = await fetch_version(source, 1)
        assert_equal(got, v1)
        rollout = build_model("tiny-gpt", TINY_GPT, device="cpu")  # a whole copy loads it as it is
        rollout.load_state_dict(got, strict=True)
        assert stats.version == 1 and stats.wire_bytes == stats.raw_bytes == sum(
            t.nbytes for t in v1.values()
        )
        await step()  # someone asked: version 1 is kept as the commit steps past it
        v2 = live_params(swarm)
        assert_equal((await fetch_version(source, 1))[0], v1)
        assert_equal((await fetch_version(source, 2))[0], v2)
        compressed, small = await fetch_version(source, 2, FetchConfig(codec="int8"))
        assert small.wire_bytes < stats.wire_bytes / 3.5
        for name, t in v2.items():
            assert (compressed[name] - t).abs().max() <= t.abs().max() / 127 + 1e-7, name
        bf16, half = await fetch_version(source, 2, FetchConfig(codec="bf16"))
        assert half.wire_bytes == stats.wire_bytes // 2
        assert all(torch.allclose(bf16[n], t, rtol=2**-8, atol=0) for n, t in v2.items())
        await step()
        await step()
        # kept: 3 and the live 4, and 2, read a moment ago (a fetch of it may still be going on)
        with pytest.raises(
            RemoteError, match=r"version 1 is gone .*this replica holds versions 2..4"
        ) as gone:
            await fetch_version(source, 1)
        assert gone.value.cause == Cause.VERSION_GONE
        with pytest.raises(RemoteError, match="version 9 is not yet applied") as early:
            await fetch_version(source, 9)
        assert early.value.cause == Cause.WRONG_STEP

    run(scenario)


def test_a_fetch_in_several_requests_reads_one_version_across_a_commit():
    async def scenario(swarm, source, step):
        await step()
        v1 = live_params(swarm)
        specs = source.param_specs()[0]
        plan = plan_requests(specs, 8192)
        assert len(plan) > 1
        second = plan[1][0]
        match = frame_is("weights", stage=0)

        def is_second(sender, receiver, frame):
            return (
                match(sender, receiver, frame)
                and (frame.meta["names"][0], frame.meta["starts"][0]) == second[:2]
            )

        reached = asyncio.Event()
        swarm.network.on_delivery(is_second, reached.set)
        held = swarm.network.hold(is_second)
        fetch = asyncio.create_task(fetch_version(source, 1, FetchConfig(max_request_bytes=8192)))
        await reached.wait()  # the first piece of stage 0 is read at version 1...
        await step()  # ...and the run commits step 1 before the rest is asked for
        held.released.set()
        got, stats = await fetch
        assert_equal(got, v1)
        assert stats.requests > 2 and swarm.replicas["s0r0"].runner.step == 2

    run(scenario)


def test_a_replica_that_dies_is_replaced_by_another_of_its_stage():
    async def scenario(swarm, source, step):
        await step()
        v1 = live_params(swarm)
        first = candidates([(n, 1) for n in swarm.live(1)], 1)[0]
        swarm.kill(first)
        got, stats = await fetch_version(source, 1)
        assert_equal(got, v1)
        assert stats.sources[1] != first

    async def fallback(swarm, source, step):
        await step()
        source_replicas = source.replicas

        async def stale():  # records still list the dead replica, first
            view = await source_replicas()
            return view | {1: [("s1r0", 1), ("s1r1", 1)]}

        swarm.kill("s1r0")
        source.replicas = stale
        got, stats = await fetch_version(source, 1)
        assert stats.fallbacks == 1 and stats.sources[1] == "s1r1"
        assert_equal(got, live_params(swarm))

    run(scenario)
    run(fallback)


def test_a_malformed_weights_request_is_refused_and_struck_and_an_oversized_one_refused():
    async def scenario(swarm, source, step):
        def request(**meta):
            base = {
                "version": 0,
                "codec": "none",
                "names": ["head.lm_head.weight"],
                "starts": [0],
                "ends": [1],
            }
            return Frame(kind="weights", run_id="versions", stage=1, meta=base | meta)

        replica = swarm.replicas["s1r0"].service.ctx.transport
        for meta, why in (
            ({"starts": [0, 1]}, "1 names, 2 starts"),
            ({"names": ["nope"]}, "no parameter 'nope'"),
        ):
            with pytest.raises(RemoteError, match=why) as refused:
                await source.transport.call("s1r0", HANDLER, request(**meta), timeout_s=5)
            assert refused.value.cause == Cause.BAD_FRAME
        assert replica.strikes("rollout") == 2
        replica.config = dataclasses.replace(
            replica.config, max_frame_bytes=1024, max_peer_bytes_in_flight=None
        )
        for meta, why in (({"codec": "zip"}, "unknown codec 'zip'"), ({"ends": [256]}, "at most 1024 bytes")):
            with pytest.raises(RemoteError, match=why) as refused:  # refused, not struck: the asker's limit
                await source.transport.call("s1r0", HANDLER, request(**meta), timeout_s=5)
            assert refused.value.cause == Cause.BAD_FRAME
        assert replica.strikes("rollout") == 2

    run(scenario)


def test_a_run_that_lists_its_weight_readers_refuses_anyone_else():
    async def scenario(swarm, source, step):
        with pytest.raises(RemoteError, match="not among the weight readers") as refused:
            await fetch_version(source, 0)
        assert refused.value.cause == Cause.UNAUTHORIZED
        as_trainer = dataclasses.replace(source, transport=swarm.trainer)
        got, _ = await fetch_version(as_trainer, 0)
        assert_equal(got, live_params(swarm))

    run(scenario, weight_readers=())
