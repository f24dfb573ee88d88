"""Mixed precision on stage peers (`join --dtype`): forward and backward under bf16 or fp16
autocast (fp16 loss-scaled by the stage), float32 master weights, gradients and optimizer
state, float32 out of the runner. On the CPU: a 16-bit stage agrees with the float32 one
within a stated tolerance, a 16-bit swarm trains within that tolerance of one float32
process, and replicas stay bit-identical, whether they compute in 16 bits or one in 16 and
the other in float32; where the run sets no codec, activations cross in the compute dtype."""

import pytest
import torch

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_stage
from swarmtrain.peers.probe import resolve_dtype
from swarmtrain.peers.stage_config import StageConfig
from swarmtrain.train.inprocess import InProcessConfig
from swarmtrain.train.loss_scale import LossScale
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.wire.records import OptimizerConfig
from tests.conftest import TINY_GPT, reference_losses
from tests.test_protocol import batches, manifest, train

LOSS_RTOL = 2e-2
"""bf16 keeps 8 bits of mantissa: a loss of a few nats agrees with float32's to about 1%, over
the first steps of training too (the tests check both)."""


def runner(dtype: str) -> StageRunner:
    n = TINY_GPT["n_layer"]
    module = build_stage("tiny-gpt", TINY_GPT, 0, n, num_blocks=n, seed=0)
    return StageRunner(module, OptimizerConfig(), microbatch_size=4, compute_dtype=dtype)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_a_16_bit_stage_agrees_with_float32_and_keeps_float32_state(half):
    x, targets = next(iter(batches()))
    losses, grads = {}, {}
    for dtype in ("fp32", half):
        r = runner(dtype)
        loss, _ = r.forward_loss_backward("mb", x, {"targets": targets}, 1.0)
        losses[dtype] = loss
        grads[dtype] = torch.cat([p.grad.flatten() for p in r.params])
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in r.params)
        r.fold(0, fresh={"mb"}, take=[])
        r.apply_step(0)
        assert all(
            s.dtype == torch.float32 for st in r.optimizer.state.values() for s in st.values() if s.dim()
        )
    assert losses[half] == pytest.approx(losses["fp32"], rel=LOSS_RTOL)
    assert losses[half] != losses["fp32"]  # it did compute in 16 bits
    cosine = torch.nn.functional.cosine_similarity(grads[half], grads["fp32"], dim=0)
    assert cosine > 0.99, float(cosine)


def grads_of(r: StageRunner, loss_scale: float) -> torch.Tensor:
    x, targets = next(iter(batches()))
    r.forward_loss_backward("mb", x, {"targets": targets}, loss_scale)
    return torch.cat([p.grad.flatten() for p in r.params])


def test_fp16_loss_scaling_keeps_the_small_gradients_fp16_would_flush_to_zero():
    """A step of many microbatches scales each one's loss down (here 1e-5): its gradients are
    below fp16's smallest value. At scale 1 almost all of them vanish (98.7% measured); the
    stage's loss scale keeps them (0.07% lost), and the result agrees with float32."""
    tiny = 1e-5
    reference = grads_of(runner("fp32"), tiny)
    unscaled = runner("fp16")
    unscaled.loss_scale = LossScale(scale=1.0)
    flushed = grads_of(unscaled, tiny)
    scaled = grads_of(runner("fp16"), tiny)
    alive = reference != 0  # (some are zero in float32 too: embedding rows no token used)
    assert (flushed[alive] == 0).float().mean() > 0.5  # fp16 at scale 1 lost most of the gradient
    assert (scaled[alive] == 0).float().mean() < 0.01
    cos = torch.nn.functional.cosine_similarity
    assert cos(scaled, reference, dim=0) > 0.99
    assert cos(flushed, reference, dim=0) < 0.9


def test_an_fp16_overflow_runs_that_backward_again_at_half_the_scale():
    r = runner("fp16")
    r.loss_scale = LossScale(scale=2.0**40, max_scale=2.0**40)  # fp16 overflows far below this
    got = grads_of(r, 1.0)
    assert r.loss_scale.overflows > 0 and r.loss_scale.scale < 2.0**40
    assert r.loss_scale.scale == 2.0 ** (40 - r.loss_scale.overflows)
    assert bool(torch.isfinite(got).all())
    cosine = torch.nn.functional.cosine_similarity(got, grads_of(runner("fp32"), 1.0), dim=0)
    assert cosine > 0.99, float(cosine)


def test_the_loss_scale_grows_after_clean_passes_and_refuses_a_bad_value():
    s = LossScale(scale=4.0, growth_interval=3)
    for _ in range(2):
        s.passed()
    assert s.scale == 4.0
    s.passed()
    assert s.scale == 8.0
    assert s.backoff() and s.scale == 4.0 and s.overflows == 1
    one = LossScale(scale=1.0)
    assert one.backoff() is False and one.scale == 1.0  # not finite at any scale: the caller refuses
    with pytest.raises(ValueError, match="power of two"):
        LossScale(scale=3.0)
    with pytest.raises(ValueError, match="growth_interval"):
        LossScale(growth_interval=0)


def test_a_bf16_stage_hands_on_float32_activations_and_gradients():
    first = build_stage("tiny-gpt", TINY_GPT, 0, 2, num_blocks=TINY_GPT["n_layer"], seed=0)
    r = StageRunner(first, OptimizerConfig(), microbatch_size=4, compute_dtype="bf16")
    x, _ = next(iter(batches()))
    out = r.forward("mb", x)
    assert out.dtype == torch.float32 and r.output_spec.dtype == torch.float32
    assert r.backward("mb", torch.ones_like(out)) is None  # stage 0: no input gradient to hand back
    assert all(p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in r.params)


@pytest.mark.parametrize(
    "dtypes",
    [
        {name: "bf16" for name in ("s0r0", "s0r1", "s1r0", "s1r1")},
        {"s0r0": "bf16", "s1r1": "bf16"},  # one replica of each stage in bf16, the other in fp32
        {name: "fp16" for name in ("s0r0", "s0r1", "s1r0", "s1r1")},
        {"s0r0": "fp16", "s0r1": "bf16", "s1r0": "fp16"},
    ],
    ids=["all-bf16", "mixed", "all-fp16", "fp16-bf16-fp32"],
)
def test_a_16_bit_swarm_trains_near_float32_and_its_replicas_stay_bit_identical(dtypes):
    config = InProcessConfig(manifest=manifest(), replicas=(2, 2), dtypes=dtypes)
    swarm, results = train(config, 3)
    m = swarm.manifest
    reference = reference_losses(
        seed=m.seed,
        optimizer=m.optimizer,
        batches=iter(batches()),
        steps=len(results),
        microbatches_per_step=4,
    )
    for result, expected in zip(results, reference.losses, strict=True):
        assert result.loss == pytest.approx(expected, rel=LOSS_RTOL), (result.step, result.loss, expected)
    for result in results:  # every step compared both replicas' parameter digests: equal
        assert result.replicas_equal is True and result.replicas_compared == {0: 2, 1: 2}
    for k in (0, 1):
        a, b = (swarm.replicas[name].runner for name in swarm.live(k))
        assert a.param_digest() == b.param_digest()
        names = swarm.live(k)
        assert [swarm.replicas[n].runner.compute_dtype for n in names] == [
            dtypes.get(n, "fp32") for n in names
        ]


def test_16_bit_stages_send_activations_in_their_dtype_where_the_run_sets_no_codec():
    swarm, _ = train(InProcessConfig(manifest=manifest(), replicas=(1, 1), dtypes={"s0r0": "fp16"}), 1)
    first, last = (swarm.replicas[swarm.live(k)[0]] for k in (0, 1))
    assert first.service.ctx.codec_for("activations", "anyone", 1 << 20) == "fp16"
    assert last.service.ctx.codec_for("gradients", "anyone", 1 << 20) == "none"  # fp32 stage
    first.runner.compute_dtype = "bf16"
    assert first.service.ctx.codec_for("activations", "anyone", 1 << 20) == "bf16"
    last.runner.compute_dtype = "fp16"
    assert last.service.ctx.codec_for("gradients", "anyone", 1 << 20) == "bf16"  # fp16's range flushes them
    assert last.service.ctx.codec_for("averaging", "anyone", 1 << 20) == "none"  # sums stay float32


def test_dtype_flags_are_resolved_or_refused_with_what_to_do():
    assert resolve_dtype("auto", "cpu") == "fp32"  # CPU swarms match one process unless asked
    assert resolve_dtype("BF16", "cpu") == "bf16" and resolve_dtype("fp32", "cpu") == "fp32"
    assert resolve_dtype("fp16", "cpu") == "fp16"
    with pytest.raises(ConfigError, match="'half' is not a compute dtype: use auto, fp32, bf16, fp16"):
        resolve_dtype("half", "cpu")
    assert StageConfig(dtype="fp16").dtype == "fp16"
    with pytest.raises(ConfigError, match="fp32, bf16 or fp16"):
        StageConfig(dtype="int8")
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        runner("fp8")
