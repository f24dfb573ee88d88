"""Mixed precision on stage peers (`join --dtype`): forward and backward under bf16 autocast,
float32 master weights, gradients and optimizer state, float32 at the stage boundary. On the
CPU: a bf16 stage agrees with the float32 one within a stated tolerance, a bf16 swarm trains
within that tolerance of one float32 process, and replicas stay bit-identical, whether they
compute in bf16 or one in bf16 and the other in float32."""

import pytest
import torch

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_stage
from swarmtrain.peers.probe import resolve_dtype
from swarmtrain.peers.stage_config import StageConfig
from swarmtrain.train.inprocess import InProcessConfig
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


def test_a_bf16_stage_agrees_with_float32_and_keeps_float32_state():
    x, targets = next(iter(batches()))
    losses, grads = {}, {}
    for dtype in ("fp32", "bf16"):
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
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=LOSS_RTOL)
    assert losses["bf16"] != losses["fp32"]  # it did compute in bf16
    cosine = torch.nn.functional.cosine_similarity(grads["bf16"], grads["fp32"], dim=0)
    assert cosine > 0.99, float(cosine)


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
    ],
    ids=["all-bf16", "mixed"],
)
def test_a_bf16_swarm_trains_near_float32_and_its_replicas_stay_bit_identical(dtypes):
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


def test_dtype_flags_are_resolved_or_refused_with_what_to_do():
    assert resolve_dtype("auto", "cpu") == "fp32"  # CPU swarms match one process unless asked
    assert resolve_dtype("BF16", "cpu") == "bf16" and resolve_dtype("fp32", "cpu") == "fp32"
    with pytest.raises(ConfigError, match="fp16 needs loss scaling"):
        resolve_dtype("fp16", "cpu")
    with pytest.raises(ConfigError, match="'half' is not a compute dtype: use auto, fp32, bf16, fp16"):
        resolve_dtype("half", "cpu")
    with pytest.raises(ConfigError, match="fp32 or bf16"):
        StageConfig(dtype="fp16")
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        runner("fp16")
