"""The learning-rate schedule, gradient clipping's coefficient and the run's length: pure
functions of the run's settings, and the settings' checks."""

import math

import pytest
import torch

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_stage
from swarmtrain.train.optim import clip_coefficient, lr_at
from swarmtrain.train.run_length import RunFinishedError, is_finished, run_is_over, steps_to_run
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.wire.keys import check_record, manifest_key
from swarmtrain.wire.records import OptimizerConfig, PeerRecord, RunManifest

LR = 1e-2
OWNER = "12D3KooWCiAFw8rTr8Bq7H4nhRW8SPpug8M8fpPas952YKMD4frV"


def lrs(cfg: OptimizerConfig, max_steps: int, steps: int | None = None) -> list[float]:
    return [lr_at(cfg, s, max_steps) for s in range(max_steps if steps is None else steps)]


def test_warmup_ramps_linearly_up_to_the_learning_rate():
    cfg = OptimizerConfig(lr=LR, warmup_steps=4)
    assert lrs(cfg, 0, steps=6) == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR])
    assert lr_at(cfg, 3, 0) == LR  # the last warmup step is at the full rate exactly


def test_the_constant_schedule_keeps_the_learning_rate():
    assert lrs(OptimizerConfig(lr=LR), 5) == [LR] * 5
    assert lrs(OptimizerConfig(lr=LR), 0, steps=3) == [LR] * 3  # a run without a step count


def test_cosine_decays_from_the_learning_rate_to_min_lr_at_the_last_step():
    cfg = OptimizerConfig(lr=LR, warmup_steps=2, schedule="cosine", min_lr=1e-3)
    values = lrs(cfg, 11)
    assert values[:2] == pytest.approx([LR / 2, LR])
    assert values[2] == LR  # the decay starts where warmup ends
    assert values[6] == pytest.approx((LR + 1e-3) / 2)  # halfway through the decay
    assert values[10] == 1e-3  # the run's last step
    assert all(a > b for a, b in zip(values[2:], values[3:]))
    assert lr_at(cfg, 11, 11) == lr_at(cfg, 50, 11) == 1e-3  # past the end: stays at the floor


def test_cosine_without_warmup_and_a_one_step_run():
    cfg = OptimizerConfig(lr=LR, schedule="cosine")
    assert lrs(cfg, 3) == pytest.approx([LR, LR / 2, 0.0])
    assert lrs(cfg, 3)[0] == LR and lrs(cfg, 3)[2] == 0.0
    assert lrs(cfg, 1) == [0.0]  # the only step is the last one


def test_the_clip_coefficient_is_clip_grad_norm_s():
    assert clip_coefficient(5.0, 0.0) == 1.0  # off
    assert clip_coefficient(0.5, 1.0) == 1.0  # under the bound: untouched
    grads = [torch.full((3,), 2.0), torch.full((2, 2), -1.0)]
    norm = math.sqrt(3 * 4 + 4 * 1)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    assert float(torch.nn.utils.clip_grad_norm_(params, 1.0)) == pytest.approx(norm)
    coefficient = clip_coefficient(norm, 1.0)
    assert coefficient == pytest.approx(1.0 / (norm + 1e-6))
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * coefficient)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1: give --warmup-steps"),
        ({"warmup_steps": 2.5}, "warmup_steps must be an integer >= 0, got 2.5"),
        ({"warmup_steps": True}, "warmup_steps must be an integer >= 0, got True"),
        ({"schedule": "linear"}, "unknown learning-rate schedule 'linear': choose 'constant' or 'cosine'"),
        ({"schedule": "cosine", "min_lr": -1e-4}, "min_lr must be a number >= 0, got -0.0001: give --min-lr"),
        ({"schedule": "cosine", "min_lr": math.nan}, "min_lr must be a number >= 0, got nan"),
        ({"schedule": "cosine", "min_lr": "0.1"}, "min_lr must be a number >= 0, got '0.1'"),
        (
            {"schedule": "cosine", "min_lr": 0.1},
            "min_lr 0.1 is above the learning rate 0.01: give a --min-lr",
        ),
        ({"min_lr": 1e-3}, "min_lr 0.001 ends a cosine schedule, and this one is constant"),
        ({"max_grad_norm": -1.0}, "max_grad_norm must be a number >= 0, got -1.0: give --max-grad-norm"),
        ({"max_grad_norm": math.inf}, "max_grad_norm must be a number >= 0, got inf"),
        ({"max_grad_norm": None}, "max_grad_norm must be a number >= 0, got None"),
    ],
)
def test_bad_schedule_and_clipping_settings_name_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OptimizerConfig(lr=LR, **kwargs)


def manifest(**fields) -> dict:
    """A manifest as it comes off the wire."""
    return RunManifest(
        run_id="sched", model="tiny-gpt", num_blocks=4, stage_bounds=(0, 2, 4), **fields
    ).to_dict()


def test_the_new_settings_travel_in_the_manifest_and_pass_the_record_check():
    cfg = OptimizerConfig(lr=LR, warmup_steps=3, schedule="cosine", min_lr=0, max_grad_norm=1)
    assert cfg.min_lr == 0.0 and isinstance(cfg.min_lr, float) and isinstance(cfg.max_grad_norm, float)
    body = manifest(optimizer=cfg, max_steps=10)
    check_record(manifest_key("sched"), OWNER, body)
    assert RunManifest.from_dict(body).optimizer == cfg
    body["optimizer"]["min_lr"] = 1.0
    with pytest.raises(ConfigError, match="min_lr 1.0 is above the learning rate 0.01"):
        check_record(manifest_key("sched"), OWNER, body)


def test_a_manifest_without_the_new_settings_loads_with_the_defaults():
    body = manifest()
    for name in ("warmup_steps", "schedule", "min_lr", "max_grad_norm"):
        del body["optimizer"][name]
    check_record(manifest_key("sched"), OWNER, body)
    cfg = RunManifest.from_dict(body).optimizer
    assert (cfg.warmup_steps, cfg.schedule, cfg.min_lr, cfg.max_grad_norm) == (0, "constant", 0.0, 0.0)
    body["optimizer"]["warmup"] = 3
    with pytest.raises(ConfigError, match=r"optimizer: unknown fields \['warmup'\]"):
        RunManifest.from_dict(body)


@pytest.mark.parametrize(
    ("optimizer", "max_steps", "match"),
    [
        ({"schedule": "cosine"}, 0, "the cosine schedule decays over the run's steps.*--steps N"),
        ({"warmup_steps": 10}, 10, "warmup_steps 10 would last the whole run of 10 steps"),
        ({}, -1, "max_steps must be an integer >= 0, got -1"),
        ({}, True, "max_steps must be an integer >= 0, got True"),
        ([], 0, "manifest: optimizer must be a mapping"),
    ],
)
def test_the_manifest_checks_the_schedule_against_the_run_length(optimizer, max_steps, match):
    body = manifest() | {"max_steps": max_steps}
    body["optimizer"] = optimizer if isinstance(optimizer, list) else body["optimizer"] | optimizer
    with pytest.raises(ConfigError, match=match):
        RunManifest.from_dict(body)


def test_a_trainer_runs_no_more_than_the_steps_the_run_has_left():
    assert steps_to_run("r", 0, 100, 0) == 100  # no step count: as asked
    assert steps_to_run("r", 3, 100, 5) == 2
    assert steps_to_run("r", 3, 1, 5) == 1
    with pytest.raises(RunFinishedError, match="run 'r' is finished: it ran all its 5 steps"):
        steps_to_run("r", 5, 1, 5)
    assert not is_finished(4, 5) and is_finished(5, 5) and not is_finished(7, 0)


def test_the_run_is_over_only_by_evidence_a_stranger_cannot_forge():
    stranger = "QmStrangerStrangerStrangerStrangerStrangerStr"
    coordinator = PeerRecord(peer_id=OWNER, role="coordinator", state="finished", step=5)
    forged = PeerRecord(peer_id=stranger, role="stage", stage=0, state="finished", step=5)
    assert run_is_over(5, 4, [], None)  # an authorized trainer committed the last step
    assert not run_is_over(5, 3, [forged], OWNER)
    assert run_is_over(5, None, [forged, coordinator], OWNER)
    assert not run_is_over(5, None, [coordinator], stranger)
    assert not run_is_over(0, 100, [coordinator], OWNER)  # a run without a step count never is


def test_a_replica_that_took_another_s_state_mid_run_steps_at_the_schedule_s_rate():
    """The rate follows the runner's step, not how many steps it applied itself: a replica that
    joins mid-run stays bit-identical with the one it took its state from."""
    cfg = OptimizerConfig(lr=LR, warmup_steps=1, schedule="cosine", min_lr=1e-3)
    model = {"n_layer": 2, "d_model": 16, "n_head": 2, "seq_len": 8}

    def runner() -> StageRunner:
        module = build_stage("tiny-gpt", model, 0, 2, num_blocks=2, seed=3)
        return StageRunner(module, cfg, microbatch_size=2, max_steps=4)

    def step(r: StageRunner, n: int) -> None:
        x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(n))
        r.forward_loss_backward(f"t:{n}.0:0", x, {"targets": x}, 1.0)
        r.fold(r.step, fresh={f"t:{n}.0:0"}, take=[])
        r.apply_step(r.step)

    first = runner()
    for n in range(2):
        step(first, n)
        assert first.optimizer.param_groups[0]["lr"] == lr_at(cfg, n, 4)
    joined = runner()
    joined.import_state(first.export_state(), first.step)
    step(first, 2)
    step(joined, 2)
    assert joined.optimizer.param_groups[0]["lr"] == lr_at(cfg, 2, 4) < LR
    assert joined.param_digest() == first.param_digest()
