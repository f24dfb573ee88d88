"""hf-causal-lm training and export, against transformers: a swarm (in one process, and a
real one) trains like transformers' own model trained alone, a trained state exported loads
back into transformers with the same logits, and text goes through the folder's tokenizer.

Every model and tokenizer here is made locally into tmp folders; nothing is downloaded."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.model.hf import save_native
from swarmtrain.train.data import TokenBatches, loss_inputs_of, stdlib_text, text_batches_for
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.train.reference import stage_state_dict, train_reference
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest
from tests.conftest import TINY_GPT
from tests.hf_models import (
    CONFIGS,
    HF,
    LAYERS,
    B,
    T,
    V,
    config_only,
    make_folders,
    run_chain,
    stages,
    tokens,
    transformers,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return make_folders(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def stdlib_sample(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "stdlib.py"
    path.write_bytes(stdlib_text(2**17))
    return path


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


@pytest.mark.swarm
def test_a_real_swarm_trains_a_gpt2_folder_like_the_reference(local_swarm, tmp_path):
    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS["gpt2"]()).save_pretrained(folder)
    config = {"path": str(folder), "seq_len": T}
    optimizer = OptimizerConfig(name="adamw", lr=1e-2)
    batch = BatchConfig(microbatch_size=B, microbatches_per_step=2, max_in_flight=2)
    ids = torch.randint(0, V, (5000,), generator=torch.Generator().manual_seed(6))

    def batches():
        return TokenBatches(ids, seq_len=T, microbatch_size=B, seed=0)

    swarm = local_swarm(model=HF, model_config=config, num_stages=2, optimizer=optimizer, batch=batch)
    with swarm.trainer() as trainer:
        results = list(trainer.train(batches(), steps=3))
    reference = train_reference(
        model=HF, model_config=config, seed=0, optimizer=optimizer, batches=batches(), steps=3,
        microbatches_per_step=batch.microbatches_per_step,
    )  # fmt: skip
    losses = torch.tensor([r.loss for r in results])
    torch.testing.assert_close(losses, torch.tensor(reference.losses), rtol=1e-4, atol=0)
    assert reference.losses[-1] < reference.losses[0]
    # out of the swarm as a folder transformers loads, holding the swarm's trained weights
    from safetensors.torch import load_file

    from swarmtrain.peers.export import load_exported
    from tests.test_durability import export

    assert "as a Hugging Face folder" in export(swarm, tmp_path / "out")
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(reference.state)
    for key, value in reference.state.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=1e-4)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_exported(tmp_path / "out")(x)
        torch.testing.assert_close(loaded(x).logits, ours, rtol=1e-5, atol=1e-5)
