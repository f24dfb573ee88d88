"""hf-causal-lm: transformers causal LMs from a local folder as swarm models, checked against
transformers itself (logits at every stage split, causality, training, export), and the
build-time refusal of parameters no initialiser sets, for every builder.

Every model and tokenizer here is made locally into tmp folders; nothing is downloaded."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import swarmtrain.model.native as native
from swarmtrain.errors import ConfigError
from swarmtrain.model import ModelSources, SwarmModel, build_model, build_stage, registered_models
from swarmtrain.model.hf import save_native
from swarmtrain.model.native import load_native_weights
from swarmtrain.train.data import TokenBatches, loss_inputs_of, stdlib_text, text_batches_for
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.train.reference import stage_state_dict, train_reference
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest
from tests.conftest import TINY_GPT

transformers = pytest.importorskip("transformers")

HF = "hf-causal-lm"
V, T, B, LAYERS = 300, 16, 3, 4
OWN = "tests.test_hf_models:*"
SPLITS = [(0, 4), (0, 1, 4), (0, 2, 3, 4), (0, 1, 2, 3, 4)]
"""Stage boundaries: one stage, then cuts after the embedding's block, in the middle, everywhere."""
LLAMA_SHAPE = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=False, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
    ),
    "gpt2-tied": lambda: transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4, bos_token_id=0, eos_token_id=0,
    ),
    "llama": lambda: transformers.LlamaConfig(**LLAMA_SHAPE, pad_token_id=1),
    "qwen2": lambda: transformers.Qwen2Config(
        **LLAMA_SHAPE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6, max_window_layers=2
    ),
    "mistral": lambda: transformers.MistralConfig(**LLAMA_SHAPE, sliding_window=6),
}  # fmt: skip
"""Tiny configs of each supported family: tied and untied embeddings, grouped-query attention,
a padding row, and sliding windows shorter than the sequence (Qwen2's on its upper layers only)."""


@functools.cache
def tokenizer_files() -> dict[str, bytes]:
    """A byte-level BPE of V tokens trained on a little stdlib text, as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=V, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tok.train_from_iterator([stdlib_text(2**14).decode()], trainer=trainer)
    assert tok.get_vocab_size() == V
    with tempfile.TemporaryDirectory() as tmp:
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
        fast.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir()}


def make_tokenizer(folder) -> None:
    for name, data in tokenizer_files().items():
        (Path(folder) / name).write_bytes(data)


@pytest.fixture(scope="module")
def stdlib_sample(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "stdlib.py"
    path.write_bytes(stdlib_text(2**17))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Family name -> a folder holding that model's config.json, random weights and a tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        folder = root / name
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(folder)
        make_tokenizer(folder)
        out[name] = str(folder)
    return out


def hf_model(folder, attn="sdpa"):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn).eval()


def stages(folder, bounds, **options) -> list:
    config = {"path": folder, "seq_len": T, **options}
    return [build_stage(HF, config, a, b, seed=0).eval() for a, b in itertools.pairwise(bounds)]


def run_chain(chain, x) -> list[torch.Tensor]:
    """Every stage's output, in order."""
    outs = []
    for stage in chain:
        x = stage(x)
        outs.append(x)
    return outs


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


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


def config_only(tmp_path, family):
    folder = tmp_path / f"{family}-config-only"
    CONFIGS[family]().save_pretrained(folder)
    return folder


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


# Training: the swarm against transformers trained in one process.


def hf_training_losses(folder, batches, *, steps: int, microbatches: int, optimizer: OptimizerConfig):
    """transformers' model trained alone: the same AdamW, batches and next-token cross-entropy."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=optimizer.lr, betas=optimizer.betas, weight_decay=optimizer.weight_decay
    )
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(microbatches):
            x, y = next(batches)
            logits = model(x).logits  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
            (loss / microbatches).backward()
            total += loss.item()
        opt.step()
        losses.append(total / microbatches)
    return losses, model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_swarm_trains_like_transformers_in_one_process(folders, family, stdlib_sample):
    steps, microbatches = 3, 2
    optimizer = OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.01)
    manifest = RunManifest(
        run_id="hf", model=HF, model_config={"path": folders[family], "seq_len": T}, num_blocks=LAYERS,
        stage_bounds=(0, 1, 4), optimizer=optimizer,
        batch=BatchConfig(microbatch_size=B, microbatches_per_step=microbatches, max_in_flight=2),
    )  # fmt: skip
    ids = text_batches_for(manifest, str(stdlib_sample)).data
    assert int(ids.max()) < V and len(ids) < 0.8 * stdlib_sample.stat().st_size  # the tokenizer's ids

    def batches():
        return TokenBatches(ids, seq_len=T, microbatch_size=B, seed=0)

    async def swarm_run():
        feed = batches()
        async with InProcessSwarm(InProcessConfig(manifest=manifest, replicas=(2, 1))) as swarm:
            results = []
            for _ in range(steps):
                results.append(await swarm.step([loss_inputs_of(next(feed)) for _ in range(microbatches)]))
            return swarm, results

    swarm, results = asyncio.run(swarm_run())
    want, model = hf_training_losses(
        folders[family], batches(), steps=steps, microbatches=microbatches, optimizer=optimizer
    )
    got = torch.tensor([r.loss for r in results])
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=0)
    assert want[-1] < want[0]  # it learns: parity with a run that does nothing would be vacuous
    reference = train_reference(
        model=HF, model_config=manifest.model_config, seed=0, optimizer=optimizer, batches=batches(),
        steps=steps, microbatches_per_step=microbatches,
    )  # fmt: skip
    torch.testing.assert_close(torch.tensor(reference.losses), torch.tensor(want), rtol=1e-5, atol=0)
    native_state = model.state_dict()
    names = swarm.replicas["s1r0"].runner.module.native_names
    for name, value in stage_state_dict(swarm.replicas["s1r0"].runner.module).items():
        torch.testing.assert_close(value, native_state[names[name]], rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["gpt2-tied", "qwen2"])
def test_export_loads_back_into_transformers_with_the_same_logits(folders, family, tmp_path):
    config = {"path": folders[family], "seq_len": T}
    optimizer = OptimizerConfig(name="adamw", lr=1e-2)
    ids = torch.randint(0, V, (5000,), generator=torch.Generator().manual_seed(4))
    trained = train_reference(
        model=HF, model_config=config, seed=0, optimizer=optimizer, steps=2, microbatches_per_step=1,
        batches=TokenBatches(ids, seq_len=T, microbatch_size=B, seed=0),
    )  # fmt: skip
    out = save_native(trained.state, config, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").is_file()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    x = tokens(5)
    with torch.no_grad():
        want = run_chain(stages(folders[family], (0, 4)), x)[-1]  # the untrained model differs
        swarm_model = build_model(HF, {"path": str(out), "seq_len": T}, device="meta")
        swarm_model.materialise(0)
        got = swarm_model.eval()(x)
        torch.testing.assert_close(model.eval()(x).logits, got, rtol=0, atol=1e-5)
    assert not torch.allclose(got, want)
    with pytest.raises(ConfigError, match="missing head.lm_head.weight"):
        save_native(
            {k: v for k, v in trained.state.items() if k != "head.lm_head.weight"}, config, tmp_path / "x"
        )


def test_text_is_tokenized_by_the_folders_tokenizer_and_bytes_stay_bytes(folders, tmp_path):
    manifest = RunManifest(
        run_id="t", model=HF, model_config={"path": folders["gpt2"], "seq_len": T}, num_blocks=LAYERS,
        stage_bounds=(0, 4), batch=BatchConfig(microbatch_size=2, microbatches_per_step=1, max_in_flight=1),
    )  # fmt: skip
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    data = text_batches_for(manifest, str(text))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["gpt2"])
    assert data.data[:4].tolist() == tokenizer("def f(x):")["input_ids"][:4]
    assert len(data.data) < 0.8 * text.stat().st_size  # merges, not bytes
    x, y = next(data)
    assert x.shape == (2, T) and torch.equal(x[:, 1:], y[:, :-1])
    tiny = RunManifest(
        run_id="t", model="tiny-gpt", model_config=TINY_GPT, num_blocks=TINY_GPT["n_layer"],
        stage_bounds=(0, 4), batch=BatchConfig(microbatch_size=2, microbatches_per_step=1, max_in_flight=1),
    )  # fmt: skip
    assert text_batches_for(tiny, str(text)).data[:3].tolist() == list(b"def")
    bare = config_only(tmp_path, "gpt2")
    no_tokenizer = dataclasses.replace(manifest, model_config={"path": str(bare), "seq_len": T})
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        text_batches_for(no_tokenizer, str(text))


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
