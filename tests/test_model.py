"""Model layer: per-part seeded init, stage chains against the full model, registry errors,
byte batches, and a reference run that learns."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from swarmtrain.errors import ConfigError, UnknownModelError
from swarmtrain.model import (
    GPTConfig,
    ModelSources,
    SwarmModel,
    build_model,
    build_stage,
    get_loss,
    part_seed,
    register_loss,
    registered_losses,
    resolve_builder,
)
from swarmtrain.train.data import TokenBatches, load_text, loss_inputs_of, stdlib_text
from swarmtrain.train.reference import stage_state_dict, train_reference
from swarmtrain.wire.records import OptimizerConfig

GPT = "tiny-gpt"
CFG = {"n_layer": 4, "n_head": 4, "d_model": 32, "seq_len": 16}
B, T, C, V = 3, 16, 32, 256
OWN = ModelSources(allow=("tests.test_model:*", "no_such_pkg_xyz.*:*"))
"""This module's builders, reached by import path: the tests' own choice."""


def full_model(seed: int, ref: str = GPT, cfg: dict = CFG) -> SwarmModel:
    model = build_model(ref, cfg, sources=OWN)
    model.to_empty(device="cpu")
    model.reset_parameters(seed)
    return model.eval()


def keyed_state(model: SwarmModel) -> dict[str, torch.Tensor]:
    return {f"{k}.{n}": t for k, part in model.parts() for n, t in part.state_dict().items()}


def block_state(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    prefix = f"block.{i}."
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


# A builder reached by import path: 'tests.test_model:tiny_mlp'.
def tiny_mlp(width: int = 8, depth: int = 2) -> SwarmModel:
    return SwarmModel(
        embed=nn.Linear(4, width),
        blocks=[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)],
        head=nn.Linear(width, 1),
        loss=nn.functional.mse_loss,
        input_shape=(4,),
        input_dtype=torch.float32,
        target_shape=(1,),
        target_dtype=torch.float32,
    )


# A loss registered beside its builder, as a model's module does: every peer that builds the
# model ('tests.test_model:masked_mlp') knows the loss a manifest names.
@register_loss("test_masked_mse", inputs=lambda out: {"targets": out, "mask": (out[0], torch.float32)})
def masked_mse(output: torch.Tensor, inputs) -> torch.Tensor:
    return ((output - inputs["targets"]) ** 2 * inputs["mask"]).mean()


def masked_mlp(width: int = 8, depth: int = 2) -> SwarmModel:
    return SwarmModel(
        embed=nn.Linear(4, width),
        blocks=[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)],
        head=nn.Linear(width, 3),
        loss="test_masked_mse",
        input_shape=(4,),
        input_dtype=torch.float32,
    )


def not_a_model() -> nn.Module:
    return nn.Linear(2, 2)


NOT_CALLABLE = 42


def test_part_seed_is_stable_and_distinct():
    assert part_seed(0, "block.1") == part_seed(0, "block.1")
    seeds = {part_seed(s, k) for s in (0, 1) for k in ("embed", "block.0", "block.1", "head")}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)


def test_block_init_is_identical_in_any_stage_and_the_full_model():
    torch.manual_seed(123)  # the global RNG must not matter
    a = stage_state_dict(build_stage(GPT, CFG, 0, 2, seed=7))
    torch.manual_seed(456)
    b = stage_state_dict(build_stage(GPT, CFG, 1, 3, seed=7))
    full = keyed_state(full_model(7))
    assert_same(block_state(a, 1), block_state(b, 1))
    assert_same(block_state(a, 1), block_state(full, 1))
    assert_same({k: v for k, v in a.items() if k.startswith("embed.")},
                {k: v for k, v in full.items() if k.startswith("embed.")})  # fmt: skip
    # Per-part seeds: blocks differ from each other, and from the same block under another seed.
    w = "attn.c_attn.weight"
    assert not torch.equal(a[f"block.0.{w}"], a[f"block.1.{w}"])
    other = stage_state_dict(build_stage(GPT, CFG, 1, 2, seed=8))
    assert not torch.equal(other[f"block.1.{w}"], a[f"block.1.{w}"])


def test_init_leaves_global_rng_alone():
    before = torch.get_rng_state()
    build_stage(GPT, CFG, 0, 4, seed=1)
    assert torch.equal(before, torch.get_rng_state())


def test_nanogpt_init_statistics():
    s = stage_state_dict(build_stage(GPT, CFG, 0, 1, seed=0))
    assert abs(s["block.0.mlp.c_fc.weight"].std().item() - 0.02) < 0.002
    assert abs(s["block.0.mlp.c_proj.weight"].std().item() - 0.02 / math.sqrt(8)) < 0.0007
    assert torch.count_nonzero(s["block.0.attn.c_attn.bias"]) == 0
    assert torch.equal(s["block.0.ln_1.weight"], torch.ones(C))


def test_stage_chain_matches_full_model():
    model = full_model(3)
    stages = [build_stage(GPT, CFG, a, b, num_blocks=4, seed=3).eval() for a, b in ((0, 1), (1, 3), (3, 4))]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=gen)
    y = torch.randint(0, V, (B, T), generator=gen)
    with torch.no_grad():
        h = x
        for stage in stages:
            h = stage(h)
        assert torch.equal(h, model(x))
        assert torch.equal(stages[-1].loss(h, {"targets": y}), model(x, y))
        assert torch.equal(model(x, {"targets": y}), model(x, y))
    with pytest.raises(ValueError, match="computes no loss"):
        stages[0].loss(h, {"targets": y})


@pytest.mark.parametrize(
    ("start", "end", "inp", "out"),
    [
        (0, 1, ((B, T), torch.int64), ((B, T, C), torch.float32)),
        (1, 3, ((B, T, C), torch.float32), ((B, T, C), torch.float32)),
        (3, 4, ((B, T, C), torch.float32), ((B, T, V), torch.float32)),
        (0, 4, ((B, T), torch.int64), ((B, T, V), torch.float32)),
    ],
)
def test_stage_specs(start, end, inp, out):
    stage = build_stage(GPT, CFG, start, end, seed=0)
    assert (stage.is_first, stage.is_last) == (start == 0, end == 4)
    assert stage.input_spec(B) == inp
    assert stage.output_spec(B) == out
    assert stage.loss_input_specs(B) == {"targets": ((B, T), torch.int64)}
    shape, dtype = inp
    x = torch.randint(0, V, shape) if dtype == torch.int64 else torch.randn(shape)
    with torch.no_grad():
        y = stage(x)
    assert (tuple(y.shape), y.dtype) == out


def test_stage_bounds_are_checked():
    with pytest.raises(ConfigError, match="has 4 blocks, but the run expects 6"):
        build_stage(GPT, CFG, 0, 2, num_blocks=6, seed=0)
    for start, end in ((2, 2), (-1, 2), (3, 5)):
        with pytest.raises(ConfigError, match="0 <= start < end <= 4"):
            build_stage(GPT, CFG, start, end, seed=0)


def test_unknown_name_lists_registered_models():
    with pytest.raises(UnknownModelError, match=r"'tiny-gpt'.*package\.module:function"):
        resolve_builder("gpt-5")
    with pytest.raises(UnknownModelError, match="unknown model 'os.path.join'"):
        resolve_builder("os.path.join")  # a dotted name is not an import path


def test_bad_import_paths():
    with pytest.raises(
        UnknownModelError, match="cannot import module 'no_such_pkg_xyz.models': No module named"
    ):
        resolve_builder("no_such_pkg_xyz.models:build", OWN)
    with pytest.raises(UnknownModelError, match="has no attribute 'missing'"):
        resolve_builder("tests.test_model:missing", OWN)
    with pytest.raises(UnknownModelError, match="not a callable"):
        resolve_builder("tests.test_model:NOT_CALLABLE", OWN)
    with pytest.raises(ConfigError, match="returned a Linear, not a SwarmModel"):
        build_model("tests.test_model:not_a_model", {}, sources=OWN)


def test_bad_options_name_the_option():
    with pytest.raises(
        ConfigError, match=r"'tiny-gpt' does not take option 'foo'; it takes: vocab_size, seq_len"
    ):
        build_model(GPT, {"foo": 1})
    with pytest.raises(ConfigError, match="does not take option 'heads'; it takes: width, depth"):
        build_model("tests.test_model:tiny_mlp", {"heads": 2}, sources=OWN)
    with pytest.raises(ConfigError, match="d_model=30 must be divisible by n_head=4"):
        build_model(GPT, {"d_model": 30})
    with pytest.raises(ConfigError, match="n_layer must be a positive integer"):
        GPTConfig(n_layer=0)


def test_import_path_builder_builds_stages():
    ref = "tests.test_model:tiny_mlp"
    stage = build_stage(ref, {"depth": 3}, 1, 3, num_blocks=3, seed=0, sources=OWN)
    assert stage.is_last and not stage.is_first
    assert stage.input_spec(5) == ((5, 8), torch.float32)
    assert stage.output_spec(5) == ((5, 1), torch.float32)
    x = torch.randn(5, 4)
    model = full_model(0, ref, {"depth": 3})
    first = build_stage(ref, {"depth": 3}, 0, 1, seed=0, sources=OWN)
    with torch.no_grad():
        assert torch.equal(stage(first(x)), model(x))


def test_token_batches_are_deterministic_shifted_windows():
    data = bytes(i % 251 for i in range(5000))
    a = TokenBatches(data, seq_len=T, microbatch_size=4, seed=5)
    b = TokenBatches(data, seq_len=T, microbatch_size=4, seed=5)
    c = TokenBatches(data, seq_len=T, microbatch_size=4, seed=6)
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert xa.shape == ya.shape == (4, T) and xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
        assert torch.equal(ya, (xa + 1) % 251)  # the next byte of each window
    with pytest.raises(ConfigError, match="too few"):
        TokenBatches(b"x" * T, seq_len=T, microbatch_size=1, seed=0)


def test_load_text(tmp_path):
    assert len(stdlib_text(10_000)) == 10_000
    with pytest.raises(ConfigError, match="neither 'stdlib' nor an existing file"):
        load_text(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds no text"):
        load_text(str(tmp_path / "empty.txt"))
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    assert load_text(str(tmp_path)) == b"hello world"


def test_reference_training_reduces_loss():
    batches = TokenBatches(stdlib_text(2**20), seq_len=T, microbatch_size=8, seed=0)
    result = train_reference(
        model=GPT,
        model_config=CFG,
        seed=0,
        optimizer=OptimizerConfig(lr=3e-3),
        batches=batches,
        steps=30,
        microbatches_per_step=2,
    )
    assert len(result.losses) == 30
    assert abs(result.losses[0] - math.log(V)) < 0.3  # starts near uniform over bytes
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 1.0
    assert "block.3.attn.c_attn.weight" in result.state and "head.lm_head.weight" in result.state
    assert result.state.keys() == keyed_state(full_model(0)).keys()


# named loss inputs


def mlp(**loss_args) -> SwarmModel:
    """A small float model with a (3,) per-sample output and the loss arguments given."""
    return SwarmModel(
        embed=nn.Linear(4, 8),
        blocks=[nn.Linear(8, 8)],
        head=nn.Linear(8, 3),
        input_shape=(4,),
        input_dtype=torch.float32,
        **loss_args,
    )


def test_registered_losses_and_their_inputs():
    assert {"cross_entropy", "weighted_cross_entropy"} <= set(registered_losses())
    assert registered_losses() == sorted(registered_losses())
    model = build_model(GPT, CFG)
    assert model.output_spec() == ((T, V), torch.float32)
    assert model.loss_fn is get_loss("cross_entropy")  # tiny-gpt's own loss
    assert model.loss_input_specs() == {"targets": ((T,), torch.int64)}
    assert model.loss_input_specs("weighted_cross_entropy") == {
        "targets": ((T,), torch.int64),
        "weights": ((T,), torch.float32),
    }
    with pytest.raises(
        ConfigError,
        match=r"unknown loss 'focal': registered losses are 'cross_entropy', .*'weighted_cross_entropy' "
        r"\(--loss\); register another with @register_loss",
    ):
        model.loss_input_specs("focal")
    with pytest.raises(ConfigError, match="unknown loss 'focal'"):
        build_stage(GPT, CFG, 0, 2, seed=0, loss="focal")


def test_weighted_cross_entropy_against_a_hand_computation():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, V, generator=gen)
    y = torch.randint(0, V, (B, T), generator=gen)
    w = 2 * torch.rand(B, T, generator=gen)
    w[0, :5] = 0.0
    # By hand: each position's -log softmax at its target, times its weight, averaged over all B*T.
    total = 0.0
    for b in range(B):
        for t in range(T):
            z = logits[b, t].double().tolist()
            nll = math.log(sum(math.exp(v) for v in z)) - z[y[b, t]]
            total += w[b, t].item() * nll
    weighted, plain = get_loss("weighted_cross_entropy"), get_loss("cross_entropy")
    assert weighted(logits, {"targets": y, "weights": w}).item() == pytest.approx(total / (B * T), rel=1e-6)
    ones = weighted(logits, {"targets": y, "weights": torch.ones(B, T)})
    torch.testing.assert_close(ones, plain(logits, {"targets": y}), rtol=1e-6, atol=0)
    # A classifier's (B, C) scores take one class id per sample.
    scores, labels = logits[:, 0], y[:, 0]
    torch.testing.assert_close(
        plain(scores, {"targets": labels}), nn.functional.cross_entropy(scores, labels), rtol=0, atol=0
    )


def test_a_stage_chain_computes_the_weighted_loss_of_the_full_model():
    model = full_model(3)
    stages = [
        build_stage(GPT, CFG, a, b, num_blocks=4, seed=3, loss="weighted_cross_entropy").eval()
        for a, b in ((0, 1), (1, 4))
    ]
    for stage in stages:
        assert stage.loss_input_specs(B) == {
            "targets": ((B, T), torch.int64),
            "weights": ((B, T), torch.float32),
        }
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=gen)
    inputs = {
        "targets": torch.randint(0, V, (B, T), generator=gen),
        "weights": torch.rand(B, T, generator=gen),
    }
    with torch.no_grad():
        out = stages[1](stages[0](x))
        expected = model.resolve_loss("weighted_cross_entropy")(model(x), inputs)
        assert torch.equal(stages[1].loss(out, inputs), expected)
        assert not torch.equal(expected, model(x, inputs["targets"]))
        with pytest.raises(ValueError, match=r"missing loss input 'weights': loss 'weighted_cross_entropy'"):
            stages[1].loss(out, {"targets": inputs["targets"]})
        with pytest.raises(ValueError, match=r"takes its inputs by name, got a Tensor"):
            stages[1].loss(out, inputs["targets"])


def test_the_three_forms_of_a_model_loss():
    # 1. loss(output, targets) with target_shape/target_dtype: one input named 'targets'.
    old = tiny_mlp()
    assert old.loss_input_specs() == {"targets": ((1,), torch.float32)}
    assert old.loss_fn.name == "torch.nn.functional.mse_loss"
    # 2. loss(output, {name: tensor}) over declared named inputs.
    named = mlp(
        loss=lambda out, i: ((out - i["targets"]) ** 2 * i["mask"]).mean(),
        loss_inputs={"targets": ((3,), torch.float32), "mask": ([3], torch.float32)},
    )
    assert named.loss_input_specs() == {"targets": ((3,), torch.float32), "mask": ((3,), torch.float32)}
    # 3. a registered name: its inputs derive from the head's output.
    assert mlp(loss="cross_entropy").loss_input_specs() == {"targets": ((), torch.int64)}
    for model in (named, mlp(loss="test_masked_mse")):
        model.to_empty(device="cpu")
        model.reset_parameters(0)
        x, t, mask = torch.randn(5, 4), torch.randn(5, 3), torch.ones(5, 3)
        with torch.no_grad():
            torch.testing.assert_close(model(x, {"targets": t, "mask": mask}), ((model(x) - t) ** 2).mean())
            with pytest.raises(
                ValueError, match=r"takes named inputs \['mask', 'targets'\], not one targets tensor"
            ):
                model(x, t)
            with pytest.raises(ValueError, match=r"unknown loss input 'weights'"):
                model(x, {"targets": t, "mask": mask, "weights": mask})
    stage = build_stage("tests.test_model:masked_mlp", {}, 1, 2, seed=0, sources=OWN)
    assert stage.loss_input_specs(5) == {"targets": ((5, 3), torch.float32), "mask": ((5, 3), torch.float32)}


def test_a_model_loss_given_wrongly_says_how_to_give_it():
    fn = nn.functional.mse_loss
    specs = {"targets": ((3,), torch.float32)}
    cases = [
        ({"loss": "cross_entropy", "target_shape": (), "target_dtype": torch.int64}, "registered with its own inputs"),
        ({"loss": fn, "loss_inputs": specs, "target_shape": (3,), "target_dtype": torch.float32}, "not both"),
        ({"loss": fn}, "give either loss_inputs"),
        ({"loss": fn, "target_shape": (3,)}, "give either loss_inputs"),
        ({"loss": 5}, "a registered loss name or a callable, got int"),
        ({"loss": "nope"}, "unknown loss 'nope'"),
        ({"loss": fn, "loss_inputs": {"x": ((3,), torch.float32)}}, "name 'x' must be a Python identifier other than 'x' and 'grad'"),
        ({"loss": fn, "loss_inputs": {"a b": ((3,), torch.float32)}}, "name 'a b' must be a Python identifier"),
        ({"loss": fn, "loss_inputs": {"t": ((0,), torch.float32)}}, r"shape \(0,\); dims must be integers >= 1"),
        ({"loss": fn, "loss_inputs": {"t": (torch.float32,)}}, r"give \(per-sample shape, dtype\)"),
        ({"loss": fn, "loss_inputs": {"t": ((3,), "float32")}}, "dtype 'float32', not a torch.dtype"),
        ({"loss": fn, "loss_inputs": [("t", ((3,), torch.float32))]}, "must map names to"),
    ]  # fmt: skip
    for args, match in cases:
        with pytest.raises(ConfigError, match=match):
            mlp(**args)


def test_a_loss_that_does_not_fit_the_model_or_a_bad_registration_is_refused():
    scalar = "tests.test_model:scalar_mlp"
    assert build_model(scalar, {}, sources=OWN).loss_input_specs() == {"targets": ((), torch.float32)}
    with pytest.raises(ConfigError, match=r"loss 'cross_entropy' needs class scores on the last dim"):
        build_stage(scalar, {}, 0, 1, seed=0, loss="cross_entropy", sources=OWN)
    with pytest.raises(
        ConfigError, match=r"'cross_entropy' is already registered to swarmtrain.model.losses.cross_entropy"
    ):
        register_loss("cross_entropy", inputs={})(masked_mse)
    assert register_loss("test_masked_mse", inputs={})(masked_mse) is masked_mse  # the same function again
    for bad in ("bad name", "", "1st", "a" * 65):
        with pytest.raises(ConfigError, match="invalid loss name"):
            register_loss(bad, inputs={})
    with pytest.raises(ConfigError, match="loss 'fine': loss input name 'grad'"):
        register_loss("fine", inputs={"grad": ((1,), torch.float32)})


def scalar_mlp() -> SwarmModel:
    """One number per sample: fits an MSE on () targets, not a cross-entropy."""
    return SwarmModel(
        embed=nn.Linear(4, 8),
        blocks=[nn.Linear(8, 8)],
        head=nn.Sequential(nn.Linear(8, 1), nn.Flatten(0)),  # (B, 1) -> (B,)
        loss=nn.functional.mse_loss,
        input_shape=(4,),
        input_dtype=torch.float32,
        target_shape=(),
        target_dtype=torch.float32,
    )


def test_loss_inputs_of_normalises_both_microbatch_forms():
    x, y, w = torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64), torch.ones(2)
    got_x, got = loss_inputs_of((x, y))
    assert got_x is x and list(got) == ["targets"] and got["targets"] is y
    named = {"targets": y, "weights": w}
    got_x, got = loss_inputs_of([x, named])
    assert got_x is x and got == named and got is not named  # a copy: the caller's dict stays as it was
    cases = [
        (x, "got a Tensor"),
        ((x,), "got a tuple of 1"),
        ((x, y, w), "got a tuple of 3"),
        (([0.0], y), "the inputs are a list, not a tensor"),
        ((x, [y]), "the second item is a list"),
        ((x, {1: y}), "loss input names must be strings, got 1"),
        ((x, {"targets": [1]}), "loss input 'targets' is a list, not a tensor"),
    ]
    for item, match in cases:
        with pytest.raises(
            ConfigError,
            match=rf"each microbatch must be \(inputs, targets\) or \(inputs, {{name: tensor}}\).*{match}",
        ):
            loss_inputs_of(item)


def test_reference_takes_named_inputs_and_the_run_loss():
    def data(weights):
        for x, y in TokenBatches(stdlib_text(2**18), seq_len=T, microbatch_size=2, seed=0):
            yield x, {"targets": y, "weights": weights(y)}

    common = dict(
        model=GPT,
        model_config=CFG,
        seed=0,
        optimizer=OptimizerConfig(name="sgd", lr=0.5),
        steps=2,
        microbatches_per_step=2,
    )
    plain = train_reference(
        batches=TokenBatches(stdlib_text(2**18), seq_len=T, microbatch_size=2, seed=0), **common
    )
    ones = train_reference(
        batches=data(lambda y: torch.ones(y.shape)), loss="weighted_cross_entropy", **common
    )
    halves = train_reference(
        batches=data(lambda y: torch.full(y.shape, 0.5)), loss="weighted_cross_entropy", **common
    )
    assert ones.losses == pytest.approx(plain.losses, rel=1e-6)
    assert halves.losses[0] == pytest.approx(plain.losses[0] / 2, rel=1e-6)  # same start, half the loss
    assert 2 * halves.losses[1] > ones.losses[1]  # half the gradient: it learned less in step 0
    with pytest.raises(ValueError, match="missing loss input 'weights'"):
        train_reference(
            batches=iter(TokenBatches(stdlib_text(2**18), seq_len=T, microbatch_size=2, seed=0)),
            loss="weighted_cross_entropy",
            **common,
        )
