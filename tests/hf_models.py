"""Tiny Hugging Face model folders for the hf-causal-lm tests, made locally (nothing is
downloaded): each supported family's config, random weights and a small trained tokenizer,
and helpers to run the split model against transformers."""

from __future__ import annotations

import functools
import itertools
import tempfile
from pathlib import Path

import pytest
import torch

from swarmtrain.model import build_stage
from swarmtrain.train.data import stdlib_text

transformers = pytest.importorskip("transformers")

HF = "hf-causal-lm"
V, T, B, LAYERS = 300, 16, 3, 4
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


def make_folders(root: Path) -> dict[str, str]:
    """Family name -> a folder under `root` holding that model's config.json, random weights and a tokenizer."""
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


def config_only(tmp_path, family):
    folder = tmp_path / f"{family}-config-only"
    CONFIGS[family]().save_pretrained(folder)
    return folder
