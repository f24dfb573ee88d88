"""The DHT records: run manifest, optimizer, batch and compression settings, peer records,
trainer points."""

from __future__ import annotations

import math
import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.errors import ConfigError
from swarmtrain.wire.metrics import RLPoint, TrainerPoint
from swarmtrain.wire.records import (
    CODEC_CHOICES,
    WIRE_VERSION,
    BatchConfig,
    CompressionConfig,
    OptimizerConfig,
    PeerRecord,
    RunManifest,
    even_split,
)


def manifest(**overrides) -> RunManifest:
    fields = dict(
        run_id="demo-1",
        model="tiny-gpt",
        model_config={"n_layer": 4, "d_model": 32},
        num_blocks=4,
        stage_bounds=(0, 2, 3, 4),
        optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9),
        batch=BatchConfig(microbatch_size=2, microbatches_per_step=3, max_in_flight=2),
        seed=7,
        max_steps=10,
    )
    return RunManifest(**(fields | overrides))


def test_manifest_round_trip_through_msgpack():
    m = manifest()
    data = msgpack.unpackb(msgpack.packb(m.to_dict(), use_bin_type=True), raw=False)
    back = RunManifest.from_dict(data)
    assert back == m
    assert back.stage_bounds == (0, 2, 3, 4) and back.optimizer.betas == (0.9, 0.95)
    assert isinstance(back.optimizer, OptimizerConfig) and isinstance(back.batch, BatchConfig)
    assert back.num_stages == 3 and back.wire_version == WIRE_VERSION
    assert [back.stage_span(k) for k in range(3)] == [(0, 2), (2, 3), (3, 4)]


def test_manifest_from_dict_rejects_unknown_missing_and_malformed_fields():
    data = manifest().to_dict()
    with pytest.raises(ConfigError, match=r"manifest: unknown fields \['bogus'\]"):
        RunManifest.from_dict(data | {"bogus": 1})
    missing = dict(data)
    del missing["num_blocks"]
    with pytest.raises(ConfigError, match="manifest: .*num_blocks"):
        RunManifest.from_dict(missing)
    with pytest.raises(ConfigError, match="manifest: expected a mapping, got list"):
        RunManifest.from_dict([data])
    with pytest.raises(ConfigError, match=r"optimizer: unknown fields \['nesterov'\]"):
        RunManifest.from_dict(data | {"optimizer": data["optimizer"] | {"nesterov": True}})
    with pytest.raises(ConfigError, match="microbatch_size must be a positive integer, got 0"):
        RunManifest.from_dict(data | {"batch": data["batch"] | {"microbatch_size": 0}})
    # Values that fail while being normalised still come back as ConfigError.
    with pytest.raises(ConfigError, match="manifest: invalid literal for int"):
        RunManifest.from_dict(data | {"stage_bounds": [0, "a", 4]})
    with pytest.raises(ConfigError, match="manifest: "):
        RunManifest.from_dict(data | {"stage_bounds": 4})
    with pytest.raises(ConfigError, match="optimizer: could not convert"):
        OptimizerConfig.from_dict({"betas": ["a", 0.9]})


@pytest.mark.parametrize("bounds", [(0, 2), (1, 2, 4), (0, 2, 2, 4), (0, 3, 2, 4), (0,), (0, 5)])
def test_bad_stage_bounds(bounds):
    with pytest.raises(ConfigError, match=r"stage_bounds \[.*\] must rise strictly from 0 to num_blocks=4"):
        manifest(stage_bounds=bounds)


@pytest.mark.parametrize("run_id", ["", "-demo", ".x", "a b", "run/1", "r" * 65, 5, None])
def test_bad_run_id(run_id):
    with pytest.raises(ConfigError, match="invalid run id .*1-64 letters, digits"):
        manifest(run_id=run_id)


def test_good_run_ids():
    for run_id in ("a", "R2-d2_v1.0", "9" + "x" * 63):
        assert manifest(run_id=run_id).run_id == run_id


def test_wrong_wire_version_says_what_to_install():
    data = manifest().to_dict() | {"wire_version": WIRE_VERSION + 1}
    with pytest.raises(
        ConfigError,
        match=f"run 'demo-1' speaks wire version {WIRE_VERSION + 1}, this peer speaks {WIRE_VERSION}: install",
    ):
        RunManifest.from_dict(data)


@pytest.mark.parametrize("stage", [-1, 3, 10, "1", 1.0])
def test_stage_span_out_of_range(stage):
    with pytest.raises(ConfigError, match=f"stage {stage} is out of range: run 'demo-1' has stages 0..2"):
        manifest().stage_span(stage)


def test_manifest_model_fields():
    with pytest.raises(ConfigError, match="model must be a builder name"):
        manifest(model="")
    with pytest.raises(ConfigError, match="model_config must be a mapping"):
        manifest(model_config=[("n_layer", 4)])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_even_split_property(blocks_stages):
    num_blocks, num_stages = blocks_stages
    b = even_split(num_blocks, num_stages)
    sizes = [y - x for x, y in zip(b, b[1:], strict=False)]
    assert len(b) == num_stages + 1 and b[0] == 0 and b[-1] == num_blocks
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    manifest(num_blocks=num_blocks, stage_bounds=b)  # a valid manifest split


def test_even_split_examples_and_errors():
    assert even_split(4, 1) == (0, 4)
    assert even_split(4, 4) == (0, 1, 2, 3, 4)
    assert even_split(10, 3) == (0, 4, 7, 10)
    with pytest.raises(ConfigError, match="cannot split 3 blocks into 4 stages: use at most 3 stages"):
        even_split(3, 4)
    with pytest.raises(ConfigError, match="number of stages must be >= 1, got 0"):
        even_split(3, 0)


def test_optimizer_config():
    cfg = OptimizerConfig(betas=[0.8, 0.99])
    assert cfg.betas == (0.8, 0.99) and cfg.to_dict()["betas"] == [0.8, 0.99]
    assert OptimizerConfig.from_dict(cfg.to_dict()) == cfg
    for kwargs, match in [
        ({"name": "adam"}, "unknown optimizer 'adam': choose 'adamw' or 'sgd'"),
        ({"lr": 0.0}, "learning rate must be > 0, got 0.0"),
        ({"lr": -1e-3}, "learning rate must be > 0"),
        ({"lr": math.nan}, "learning rate must be > 0, got nan"),
        ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
        ({"betas": (0.9,)}, "betas must be two numbers"),
        ({"betas": (0.9, 0.95, 0.99)}, "betas must be two numbers"),
        ({"betas": (-0.1, 0.9)}, "betas must be two numbers"),
        ({"weight_decay": -0.1}, "weight_decay and momentum must be >= 0"),
        ({"momentum": -0.5}, "weight_decay and momentum must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            OptimizerConfig(**kwargs)
    with pytest.raises(ConfigError, match=r"optimizer: unknown fields \['eps'\]"):
        OptimizerConfig.from_dict({"eps": 1e-8})


def test_batch_config():
    cfg = BatchConfig(microbatch_size=3, microbatches_per_step=5, max_in_flight=2)
    assert BatchConfig.from_dict(cfg.to_dict()) == cfg
    for name in ("microbatch_size", "microbatches_per_step", "max_in_flight"):
        for bad in (0, -2, 1.5, "4", None):
            with pytest.raises(ConfigError, match=f"{name} must be a positive integer, got {bad!r}"):
                BatchConfig(**{name: bad})
    with pytest.raises(ConfigError, match=r"batch: unknown fields \['accum'\]"):
        BatchConfig.from_dict({"accum": 2})
    with pytest.raises(ConfigError, match="batch: expected a mapping, got NoneType"):
        BatchConfig.from_dict(None)


def test_peer_record():
    rec = PeerRecord(
        peer_id="QmPeer", role="stage", stage=2, state="joining", device="cpu", served=5, since=1.5
    )
    back = PeerRecord.from_dict(msgpack.unpackb(msgpack.packb(rec.to_dict()), raw=False))
    assert back == rec
    assert PeerRecord(peer_id="QmT", role="trainer").stage == -1
    for kwargs, match in [
        ({"role": "worker"}, "unknown role 'worker'"),
        ({"role": "stage", "state": "dead"}, "unknown state 'dead'"),
        ({"role": "stage"}, "bad stage -1"),  # a stage peer must name its stage
        ({"role": "stage", "stage": "1"}, "bad stage '1'"),
        ({"role": "trainer", "stage": None}, "bad stage None"),
    ]:
        with pytest.raises(ConfigError, match=f"peer record: {match}"):
            PeerRecord(peer_id="QmPeer", **kwargs)
    with pytest.raises(ConfigError, match=r"peer record: unknown fields \['addr'\]"):
        PeerRecord.from_dict(rec.to_dict() | {"addr": "x"})
    with pytest.raises(ConfigError, match="peer record: .*role"):
        PeerRecord.from_dict({"peer_id": "QmPeer"})


def test_peer_record_readiness_and_counters():
    rec = PeerRecord(
        peer_id="QmPeer", role="stage", stage=0, queue_depth=3, backlog_s=0.25, service_s=0.05,
        in_flight_budget=8, holding=2, busy_s=12, replayed=1, failed=2, banned=["QmA", "QmB"],
        bytes_sent=10, bytes_received=20, raw_bytes_sent=40, memory_used_bytes=2**20,
    )  # fmt: skip
    back = PeerRecord.from_dict(msgpack.unpackb(msgpack.packb(rec.to_dict()), raw=False))
    assert back == rec and back.banned == ("QmA", "QmB") and back.busy_s == 12.0
    for kwargs, match in [
        ({"queue_depth": -1}, "queue_depth must be an integer >= 0"),
        ({"replayed": 1.5}, "replayed must be an integer >= 0"),
        ({"bytes_sent": True}, "bytes_sent must be an integer >= 0"),
        ({"service_s": -0.1}, "service_s must be a number >= 0"),
        ({"backlog_s": "1"}, "backlog_s must be a number >= 0"),
        ({"busy_s": math.inf}, "busy_s must be a number >= 0"),
        ({"banned": ["Qm"] * 17}, "banned must list at most 16 peer ids"),
        ({"banned": [5]}, "banned must hold peer ids"),
    ]:
        with pytest.raises(ConfigError, match=f"peer record: {match}"):
            PeerRecord(peer_id="QmPeer", role="stage", stage=0, **kwargs)


def test_a_rollout_peer_record_names_its_quantization():
    rec = PeerRecord(peer_id="QmR", role="rollout", quantize="4bit")
    assert PeerRecord.from_dict(msgpack.unpackb(msgpack.packb(rec.to_dict()), raw=False)) == rec
    assert PeerRecord(peer_id="QmR", role="rollout").quantize is None
    with pytest.raises(
        ConfigError, match=r"peer record: quantize must be null or one of \['8bit', '4bit'\], got '3bit'"
    ):
        PeerRecord(peer_id="QmR", role="rollout", quantize="3bit")


def rl_step(**overrides) -> RLPoint:
    fields = dict(
        samples=32, reward=0.5, accuracy=0.25, policy_lag=1.5, samples_per_s=40.0, stale=2, banned=1
    )
    return RLPoint(**(fields | overrides))


def test_a_trainer_point_carries_an_rl_step_through_msgpack():
    point = TrainerPoint(trainer="T", step=3, loss=0.1, tokens_per_s=900.0, t=5.0, rl=rl_step())
    back = TrainerPoint.from_dict(msgpack.unpackb(msgpack.packb(point.to_dict()), raw=False))
    assert back == point and isinstance(back.rl, RLPoint) and back.rl.stale == 2
    plain = TrainerPoint(trainer="T", step=3, loss=0.1, tokens_per_s=900.0, t=5.0)
    assert TrainerPoint.from_dict(plain.to_dict()).rl is None  # not an RL run
    empty = rl_step(samples=0, reward=math.nan, accuracy=math.nan, policy_lag=math.nan, samples_per_s=0)
    back = TrainerPoint.from_dict(
        msgpack.unpackb(msgpack.packb(plain.to_dict() | {"rl": empty.to_dict()}), raw=False)
    )
    assert back.rl.samples == 0 and math.isnan(back.rl.reward)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"reward": math.nan}, "rl.reward must be finite for a step of 32 samples, got nan"),
        ({"samples": 0}, "rl.reward must be NaN for a step of no samples, got 0.5"),
        ({"accuracy": 1.5}, r"rl.accuracy must be in \[0, 1\], got 1.5"),
        ({"samples_per_s": -1.0}, "rl.samples_per_s must be finite and >= 0, got -1.0"),
        ({"policy_lag": "1"}, "rl.policy_lag must be a number, got '1'"),
        ({"stale": -1}, "rl.stale must be an integer >= 0, got -1"),
        ({"banned": True}, "rl.banned must be an integer >= 0, got True"),
    ],
)
def test_a_bad_rl_step_says_which_figure_is_wrong(overrides, match):
    with pytest.raises(ConfigError, match=f"trainer point: {match}"):
        rl_step(**overrides)


def test_a_trainer_point_from_the_wire_rejects_a_malformed_rl_step():
    data = TrainerPoint(trainer="T", step=3, loss=0.1, tokens_per_s=9.0, t=5.0, rl=rl_step()).to_dict()
    with pytest.raises(ConfigError, match=r"trainer point: rl: unknown fields \['bogus'\]"):
        TrainerPoint.from_dict(data | {"rl": data["rl"] | {"bogus": 1}})
    with pytest.raises(ConfigError, match="trainer point: rl must be a mapping or null, got list"):
        TrainerPoint.from_dict(data | {"rl": [1, 2]})
    with pytest.raises(ConfigError, match="trainer point: rl: .*samples"):
        TrainerPoint.from_dict(data | {"rl": {"reward": 1.0}})


def test_manifest_schedule():
    assert manifest().schedule == "readiness"
    assert RunManifest.from_dict(manifest(schedule="static").to_dict()).schedule == "static"
    with pytest.raises(
        ConfigError, match=r"unknown schedule 'fifo': choose 'readiness' or 'static' \(--schedule\)"
    ):
        manifest(schedule="fifo")


def test_manifest_loss():
    assert manifest().loss is None  # the model's own loss
    m = manifest(loss="weighted_cross_entropy")
    data = msgpack.unpackb(msgpack.packb(m.to_dict(), use_bin_type=True), raw=False)
    assert data["loss"] == "weighted_cross_entropy"
    assert RunManifest.from_dict(data) == m and RunManifest.from_dict(data).loss == "weighted_cross_entropy"
    assert RunManifest.from_dict(manifest().to_dict()).loss is None
    older = dict(data)
    del older["loss"]
    assert RunManifest.from_dict(older).loss is None
    for bad in ("", "bad name", "1st", "a" * 65, 5, ["cross_entropy"]):
        with pytest.raises(
            ConfigError,
            match=rf"manifest: invalid loss name {re.escape(repr(bad))}: use 1-64 letters.*--loss",
        ):
            RunManifest.from_dict(data | {"loss": bad})


def test_the_coordinator_publishes_the_loss_it_checked():
    from swarmtrain.peers.coordinator import CoordinatorConfig, make_manifest

    small = {"n_layer": 2, "d_model": 32}
    m = make_manifest(CoordinatorConfig(model_config=small, num_stages=2, loss="weighted_cross_entropy"))
    assert m.loss == "weighted_cross_entropy"
    assert make_manifest(CoordinatorConfig(model_config=small, num_stages=2)).loss is None
    with pytest.raises(ConfigError, match=r"unknown loss 'focal': registered losses are 'cross_entropy'"):
        make_manifest(CoordinatorConfig(model_config=small, num_stages=2, loss="focal"))
    with pytest.raises(ConfigError, match=r"loss 'grpo' trains on rollout peers' completions: .*--task"):
        make_manifest(CoordinatorConfig(model_config=small, num_stages=2, loss="grpo"))
    with pytest.raises(ConfigError, match=r"invalid loss name 'bad name'.*--loss cross_entropy"):
        CoordinatorConfig(loss="bad name")


def test_compression_config_in_the_manifest():
    assert manifest().compression == CompressionConfig()  # none everywhere by default
    assert not CompressionConfig().is_enabled
    cfg = CompressionConfig(activations="int8", gradients="nf4", averaging="auto", error_feedback=False)
    assert cfg.is_enabled
    m = manifest(compression=cfg)
    data = msgpack.unpackb(msgpack.packb(m.to_dict(), use_bin_type=True), raw=False)
    assert data["compression"] == {
        "activations": "int8",
        "gradients": "nf4",
        "averaging": "auto",
        "error_feedback": False,
    }
    assert RunManifest.from_dict(data) == m and RunManifest.from_dict(data).compression == cfg
    older = dict(data)
    del older["compression"]
    assert RunManifest.from_dict(older).compression == CompressionConfig()
    for choice in CODEC_CHOICES:
        assert CompressionConfig(activations=choice, gradients=choice, averaging=choice).activations == choice


@pytest.mark.parametrize("direction", ["activations", "gradients", "averaging"])
@pytest.mark.parametrize("bad", ["zstd", "INT8", "", None, 8])
def test_bad_compression_settings_name_the_flag(direction, bad):
    with pytest.raises(ConfigError, match=f"unknown codec {bad!r} for {direction}: choose one of none, fp16.*auto "
                       rf"\(--compress-{direction}\)"):  # fmt: skip
        CompressionConfig(**{direction: bad})
    data = manifest().to_dict()
    with pytest.raises(ConfigError, match=f"unknown codec {bad!r} for {direction}"):
        RunManifest.from_dict(data | {"compression": {direction: bad}})


def test_the_coordinator_publishes_the_compression_config():
    from swarmtrain.peers.coordinator import CoordinatorConfig, make_manifest

    cfg = CompressionConfig(activations="int8", gradients="int8", averaging="nf4")
    m = make_manifest(
        CoordinatorConfig(model_config={"n_layer": 2, "d_model": 32}, num_stages=2, compression=cfg)
    )
    assert m.compression == cfg
    assert make_manifest(CoordinatorConfig(num_stages=2)).compression == CompressionConfig()


def test_bad_compression_fields():
    with pytest.raises(ConfigError, match=r"error_feedback must be true or false, got 1 \(--error-feedback"):
        CompressionConfig(error_feedback=1)
    with pytest.raises(ConfigError, match=r"compression: unknown fields \['per_boundary'\]"):
        CompressionConfig.from_dict({"per_boundary": ["int8"]})
    with pytest.raises(ConfigError, match=r"unknown codec \[\] for averaging: choose one of"):
        CompressionConfig(averaging=[])
    with pytest.raises(ConfigError, match="manifest: compression must be a mapping"):
        RunManifest.from_dict(manifest().to_dict() | {"compression": "int8"})
    with pytest.raises(ConfigError, match="manifest: compression must be a mapping"):
        manifest(compression="int8")


def test_codecs_per_boundary_and_per_stage():
    # manifest(): 3 stages, so 2 boundaries (0 -> 1, 1 -> 2) and 3 stages to average in
    cfg = CompressionConfig(activations=" none , int8", gradients=("int8", "nf4"), averaging="int8,none,auto")
    assert (cfg.activations, cfg.gradients, cfg.averaging) == ("none,int8", "int8,nf4", "int8,none,auto")
    assert [cfg.codec("activations", k) for k in (0, 1)] == ["none", "int8"]
    assert [cfg.codec("gradients", k) for k in (0, 1)] == ["int8", "nf4"]
    assert [cfg.codec("averaging", k) for k in (0, 1, 2)] == ["int8", "none", "auto"]
    assert cfg.is_enabled and not CompressionConfig(activations="none,none").is_enabled
    uniform = CompressionConfig(activations="int8")
    assert [uniform.codec("activations", k) for k in (0, 1, 5)] == ["int8"] * 3  # one for every boundary
    m = manifest(compression=cfg)
    data = msgpack.unpackb(msgpack.packb(m.to_dict(), use_bin_type=True), raw=False)
    assert data["compression"]["gradients"] == "int8,nf4"
    assert RunManifest.from_dict(data).compression == cfg
    assert cfg.describe() == (
        "activations none,int8, gradients int8,nf4, averaging int8,none,auto, error feedback on"
    )


def test_per_boundary_lists_must_fit_the_stages():
    with pytest.raises(
        ConfigError,
        match=r"--compress-activations names 3 codecs \('int8,int8,nf4'\), but the run has 2 boundaries "
        r"between its 3 stages: give one codec for all of them, or 2 separated by commas",
    ):
        manifest(compression=CompressionConfig(activations="int8,int8,nf4"))
    with pytest.raises(
        ConfigError,
        match=r"--compress-averaging names 2 codecs \('int8,nf4'\), but the run has 3 stages: give one",
    ):
        manifest(compression=CompressionConfig(averaging="int8,nf4"))
    with pytest.raises(
        ConfigError,
        match=r"--compress-gradients names 2 codecs \('int8,nf4'\), but the run has 1 boundary between its "
        r"2 stages: give one codec$",
    ):
        manifest(stage_bounds=(0, 2, 4), compression=CompressionConfig(gradients="int8,nf4"))
    with pytest.raises(
        ConfigError,
        match=r"unknown codec 'zstd' for gradients at boundary 1 of 'int8,zstd': choose one of none, .*auto "
        r"\(--compress-gradients\)",
    ):
        CompressionConfig(gradients="int8,zstd")
    with pytest.raises(ConfigError, match=r"unknown codec '' for averaging at stage 1 of 'int8,'"):
        CompressionConfig(averaging="int8,")


def test_an_rl_manifest_round_trips_and_its_settings_are_checked():
    from swarmtrain.wire.rl_config import RLConfig

    rl = RLConfig(
        task="add", task_options={"digits": 2}, samples_per_prompt=4, max_staleness=1, verify_fraction=0.5,
        logprob_tolerance=0.2,
    )  # fmt: skip
    m = RunManifest(
        run_id="rl", model="tiny-gpt", num_blocks=2, stage_bounds=(0, 1, 2), loss="grpo", rl=rl,
        batch=BatchConfig(microbatch_size=8, microbatches_per_step=2),
    )  # fmt: skip
    again = RunManifest.from_dict(m.to_dict())
    assert again == m and again.rl.prompts_per_step(16) == 4
    with pytest.raises(ConfigError, match="an RL run must name its GRPO loss"):
        RunManifest(run_id="rl", model="tiny-gpt", num_blocks=2, stage_bounds=(0, 2), rl=rl)
    with pytest.raises(ConfigError, match="not a multiple of samples_per_prompt=3"):
        RunManifest(
            run_id="rl", model="tiny-gpt", num_blocks=2, stage_bounds=(0, 2), loss="grpo",
            rl=RLConfig(task="add", samples_per_prompt=3),
        )  # fmt: skip
    for bad, match in (
        ({"samples_per_prompt": 1}, "samples_per_prompt must be an integer in 2..1024"),
        ({"max_staleness": -1}, "max_staleness must be an integer in 0..1000"),
        ({"weights_codec": "zip"}, "weights_codec must be 'none', 'bf16' or 'int8'"),
        ({"verify_fraction": -0.1}, r"verify_fraction must be a number in \[0, 1\]"),
        ({"verify_fraction": True}, r"verify_fraction must be a number in \[0, 1\]"),
        ({"logprob_tolerance": 0}, "logprob_tolerance must be a number of nats > 0, got 0"),
        ({"logprob_tolerance": float("nan")}, "logprob_tolerance must be a number of nats > 0"),
        ({"task": ""}, "task must be a task name or import path"),
    ):
        with pytest.raises(ConfigError, match=match):
            RLConfig.from_dict({"task": "add", **bad})
    with pytest.raises(ConfigError, match="rl: unknown field"):
        RLConfig.from_dict({"task": "add", "temperature": 2})


def test_a_partial_read_of_the_run_keeps_the_peers_it_lacks_and_a_whole_one_replaces_the_view():
    from swarmtrain.swarm import fresher_view

    def rec(peer: str, stage: int) -> PeerRecord:
        return PeerRecord(peer_id=peer, role="stage", stage=stage)

    view = [rec("me", 1), rec("up", 0), rec("down", 2)]
    # a read that came back from a node that missed stores: neither our own record nor "up"
    partial = fresher_view(view, [rec("down", 2), rec("new", 0)], "me")
    assert {(r.peer_id, r.stage) for r in partial} == {("me", 1), ("up", 0), ("down", 2), ("new", 0)}
    assert set(map(id, fresher_view(view, [], "me"))) == set(map(id, view))  # a read that found nothing
    # a whole read (it holds our own record) is the view: "up" left, "down" moved
    whole = fresher_view(partial, [rec("me", 1), rec("down", 0)], "me")
    assert [(r.peer_id, r.stage) for r in whole] == [("me", 1), ("down", 0)]
