"""hf-causal-lm: transformers causal LMs from a local folder as swarm models, checked against
transformers itself (logits at every stage split, causality, per-stage loading, init from
scratch, errors), and the build-time refusal of parameters no initialiser sets, for every
builder. Training and export: test_hf_training.py.

Every model and tokenizer here is made locally into tmp folders; nothing is downloaded."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import swarmtrain.model.native as native
from swarmtrain.errors import ConfigError
from swarmtrain.model import ModelSources, SwarmModel, build_model, build_stage, registered_models
from swarmtrain.model.native import load_native_weights
from swarmtrain.train.reference import stage_state_dict
from tests.conftest import TINY_GPT
from tests.hf_models import (
    CONFIGS,
    HF,
    LAYERS,
    SPLITS,
    B,
    T,
    V,
    config_only,
    hf_model,
    make_folders,
    run_chain,
    stages,
    tokens,
    transformers,
)

OWN = "tests.test_hf_models:*"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return make_folders(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_split_model_computes_transformers_logits_at_every_split(folders, family):
    reference = hf_model(folders[family])
    x = tokens()
    with torch.no_grad():
        want = reference(x).logits  # (B, T, V)
        assert want.shape == (B, T, V)
        for bounds in SPLITS:
            got = run_chain(stages(folders[family], bounds), x)[-1]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{family} split {bounds}")


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_eager_attention_matches_transformers_too(folders, family):
    x = tokens(1)
    with torch.no_grad():
        want = hf_model(folders[family], "eager")(x).logits
        got = run_chain(stages(folders[family], (0, 2, 4), attn_implementation="eager"), x)[-1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_later_token_changes_no_earlier_output_through_any_stage(folders, family, attn):
    t = 9
    x = tokens(2)
    changed = x.clone()
    changed[:, t] = (x[:, t] + 1) % V
    chain = stages(folders[family], (0, 1, 3, 4), attn_implementation=attn)
    with torch.no_grad():
        for k, (a, b) in enumerate(zip(run_chain(chain, x), run_chain(chain, changed), strict=True)):
            torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0, msg=f"stage {k}, positions < {t}")
            assert not torch.allclose(a[:, t:], b[:, t:]), f"stage {k} ignores the changed token"


def test_a_bare_transformers_layer_under_eager_attention_sees_the_future():
    """Why each block builds its mask: a layer called alone, as a naive split would call it, is
    not causal. (The causality test above would catch a block that forgot.)"""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = CONFIGS["gpt2"]()
    config._attn_implementation = "eager"
    layer = GPT2Block(config, layer_idx=0).eval()
    x = torch.randn(1, T, 32)
    changed = x.clone()
    changed[:, -1] = torch.randn(32)  # not a constant shift, which the LayerNorm would undo
    with torch.no_grad():
        assert (layer(x)[:, 0] - layer(changed)[:, 0]).abs().max() > 1e-4


def test_tied_embeddings_are_untied_into_equal_copies(folders):
    (stage,) = stages(folders["gpt2-tied"], (0, 4))
    assert stage.embed.wte.weight.data_ptr() != stage.head.lm_head.weight.data_ptr()
    assert torch.equal(stage.embed.wte.weight, stage.head.lm_head.weight)
    assert stage.native_names["head.lm_head.weight"] == "transformer.wte.weight"
    (untied,) = stages(folders["gpt2"], (0, 4))
    assert untied.native_names["head.lm_head.weight"] == "lm_head.weight"
    assert not torch.equal(untied.embed.wte.weight, untied.head.lm_head.weight)


def test_a_stage_reads_only_its_own_tensors(folders, monkeypatch):
    read = []

    class Spy:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    real = native.safe_open
    monkeypatch.setattr(native, "safe_open", lambda *a, **k: Spy(real(*a, **k).__enter__()))
    (stage,) = stages(folders["llama"], (1, 3))
    assert sorted(read) == sorted(
        f"model.layers.{i}.{name}"
        for i in (1, 2)
        for name in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        )
    )  # fmt: skip
    read.clear()
    (last,) = stages(folders["gpt2-tied"], (3, 4))
    assert "transformer.h.3.attn.c_attn.weight" in read
    assert not any(name.startswith(("transformer.h.2.", "transformer.wpe")) for name in read)
    assert "transformer.wte.weight" in read  # the untied head's copy of the tied matrix
    first = list(read)
    assert load_native_weights(last, folders["gpt2-tied"]) == first


def test_a_sharded_checkpoint_and_a_base_model_checkpoint_load(folders, tmp_path):
    reference = hf_model(folders["llama"])
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    x = tokens(3)
    with torch.no_grad():
        torch.testing.assert_close(run_chain(stages(str(sharded), (0, 2, 4)), x)[-1], reference(x).logits)
    # GPT-2's original checkpoint is a base model's: 'h.0.attn...', 'wte.weight', no prefix.
    base = tmp_path / "base"
    gpt2 = hf_model(folders["gpt2-tied"])
    gpt2.transformer.save_pretrained(base)
    with torch.no_grad():
        torch.testing.assert_close(run_chain(stages(str(base), (0, 4)), x)[-1], gpt2(x).logits)


def test_a_checkpoint_that_does_not_fit_is_refused_by_name(folders, tmp_path):
    folder = tmp_path / "smaller"
    config = CONFIGS["llama"]()
    config.intermediate_size = 48
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    with open(folder / "config.json") as f:
        wider = json.load(f) | {"intermediate_size": 64}
    (folder / "config.json").write_text(json.dumps(wider))
    with pytest.raises(
        ConfigError, match=r"other shapes.*block\.1\.layer\.mlp\.gate_proj\.weight \(64, 32\)"
    ):
        build_stage(HF, {"path": str(folder), "seq_len": T}, 1, 2, seed=0)
    partial = tmp_path / "partial"
    model = hf_model(folders["llama"])
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.3.")}
    model.save_pretrained(partial, state_dict=state)
    build_stage(HF, {"path": str(partial), "seq_len": T}, 0, 3, seed=0)  # holds no layer 3
    with pytest.raises(ConfigError, match=r"lacks tensors model\.layers\.3\.self_attn\.q_proj\.weight, "):
        build_stage(HF, {"path": str(partial), "seq_len": T}, 3, 4, seed=0)
    with pytest.raises(ConfigError, match="pretrained is true, but folder .* holds no"):
        build_model(HF, {"path": str(config_only(tmp_path, "llama")), "seq_len": T, "pretrained": True})


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_from_scratch_every_parameter_is_initialised_per_part_as_transformers_would(tmp_path, family):
    config = {"path": str(config_only(tmp_path, family)), "seq_len": T}
    full = stage_state_dict(build_stage(HF, config, 0, 4, seed=5))
    middle = stage_state_dict(build_stage(HF, config, 1, 3, seed=5))
    for name, value in middle.items():
        assert torch.equal(value, full[name]), name  # per-part seeds: any split, same block
    other = stage_state_dict(build_stage(HF, config, 1, 3, seed=6))
    assert all(not torch.equal(other[n], middle[n]) for n in middle if n.endswith("proj.weight"))
    std = 0.02
    if family == "gpt2":
        assert abs(full["block.0.layer.attn.c_attn.weight"].std().item() - std) < 0.003
        assert abs(full["block.0.layer.mlp.c_proj.weight"].std().item() - std / (2 * LAYERS) ** 0.5) < 0.001
        assert torch.count_nonzero(full["block.0.layer.attn.c_attn.bias"]) == 0
        assert torch.equal(full["head.ln_f.weight"], torch.ones(32))
    else:
        assert abs(full["block.0.layer.self_attn.q_proj.weight"].std().item() - std) < 0.003
        assert torch.equal(full["block.2.layer.input_layernorm.weight"], torch.ones(32))
        assert torch.count_nonzero(full["embed.embed_tokens.weight"][1]) == 0  # the padding row
    assert all(torch.isfinite(v).all() for v in full.values())


# The uninitialised-parameter check, for every builder.


def conv1d_blocks(init_conv: bool = False) -> SwarmModel:
    """A model whose blocks hold transformers' Conv1D, which has no reset_parameters."""
    from transformers.pytorch_utils import Conv1D

    def init(m: nn.Module) -> None:
        if init_conv and isinstance(m, Conv1D):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    return SwarmModel(
        embed=nn.Embedding(V, 8),
        blocks=[nn.Sequential(nn.LayerNorm(8), Conv1D(8, 8)) for _ in range(2)],
        head=nn.Linear(8, V),
        loss="cross_entropy",
        input_shape=(T,),
        input_dtype=torch.int64,
        init_weights=init,
    )


def conv1d_initialised() -> SwarmModel:
    return conv1d_blocks(init_conv=True)


def test_a_parameter_no_initialiser_sets_is_refused_by_name():
    sources = ModelSources(allow=(OWN,))
    ref = "tests.test_hf_models:conv1d_blocks"
    with pytest.raises(ConfigError) as e:
        build_stage(ref, {}, 1, 2, seed=0, sources=sources)
    message = str(e.value)
    assert "parameter block.1.1.weight, parameter block.1.1.bias are set by no reset_parameters()" in message
    assert "block.0" not in message  # only the held parts are built
    with torch.device("meta"):
        full = conv1d_blocks()
    with pytest.raises(ConfigError, match=r"block\.0\.1\.weight.*block\.1\.1\.bias"):
        full.materialise(0)  # the full-model build of a reference run
    stage = build_stage("tests.test_hf_models:conv1d_initialised", {}, 0, 2, seed=0, sources=sources)
    assert all(torch.isfinite(p).all() for p in stage.parameters())


def test_every_built_in_builder_initialises_every_parameter(folders):
    assert {"tiny-gpt", HF} <= set(registered_models())  # built in: no --allow-model needed
    build_stage("tiny-gpt", TINY_GPT, 0, TINY_GPT["n_layer"], seed=0)
    for family in CONFIGS:
        build_stage(HF, {"path": folders[family], "seq_len": T, "pretrained": False}, 0, LAYERS, seed=0)


# Clear errors.


def test_bad_folders_and_options_are_refused_clearly(tmp_path, folders):
    cases = [
        ({"path": str(tmp_path / "nope"), "seq_len": T}, "is not a local folder"),
        ({"path": str(tmp_path), "seq_len": T}, "holds no config.json"),
        ({"path": folders["gpt2"], "seq_len": 33}, "seq_len 33 is longer than the model's max_position_embeddings 32"),
        ({"path": folders["gpt2"], "seq_len": 0}, "seq_len must be a positive integer"),
        ({"path": folders["gpt2"], "seq_len": T, "attn_implementation": "flash"}, "not one of sdpa, eager"),
        ({"path": folders["gpt2"]}, "missing a required argument: 'seq_len'"),
        ({"path": folders["gpt2"], "seq_len": T, "n_layer": 2}, "does not take option 'n_layer'"),
    ]  # fmt: skip
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    cases.append(
        ({"path": str(bert), "seq_len": T}, "model_type 'bert'; supported: gpt2, llama, mistral, qwen2")
    )
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_model(HF, options)


def test_without_transformers_the_error_says_what_to_install(folders, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(ConfigError, match=r"needs transformers .*pip install 'swarmtrain\[hf\]'"):
        build_model(HF, {"path": folders["gpt2"], "seq_len": T})
    assert "tiny-gpt" in registered_models()  # the registry itself never needs it
