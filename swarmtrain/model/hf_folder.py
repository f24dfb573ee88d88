"""The folder an hf-causal-lm model comes from (swarmtrain.model.hf): its config and model
family, the names its checkpoint gives each tensor, its tokenizer, and writing a trained model
back as such a folder.

Local folders only: nothing here downloads, and transformers loads with local_files_only.
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from swarmtrain.errors import ConfigError
from swarmtrain.model.native import SINGLE_FILE, save_native_tensors
from swarmtrain.model.registry import build_model
from swarmtrain.model.swarm_model import EMBED_KEY, HEAD_KEY

BUILDER = "hf-causal-lm"
INSTALL_HINT = "pip install 'swarmtrain[hf]'"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""Tokenizer files a model folder may hold; `save_native` copies those present."""


@dataclass(frozen=True, kw_only=True)
class Family:
    """Where transformers keeps one model family's classes, and how its checkpoints name things."""

    module: str
    """Its modeling module, under transformers.models."""
    layer: str
    """The decoder layer class."""
    norm: str | None
    """The final norm's class (None: torch's LayerNorm, GPT-2)."""
    rotary: str | None
    """The rotary embedding class (None: learned positions, GPT-2)."""
    base: str
    """Native prefix of the base model's tensors: 'transformer' (GPT-2) or 'model'."""
    layers: str
    """Native name of the layer list under `base`: 'h' (GPT-2) or 'layers'."""
    norm_name: str
    """Native name of the final norm under `base`: 'ln_f' or 'norm'."""


GPT2 = Family(
    module="gpt2.modeling_gpt2", layer="GPT2Block", norm=None, rotary=None,
    base="transformer", layers="h", norm_name="ln_f",
)  # fmt: skip
FAMILIES = {
    "gpt2": GPT2,
    "llama": Family(
        module="llama.modeling_llama", layer="LlamaDecoderLayer", norm="LlamaRMSNorm",
        rotary="LlamaRotaryEmbedding", base="model", layers="layers", norm_name="norm",
    ),
    "mistral": Family(
        module="mistral.modeling_mistral", layer="MistralDecoderLayer", norm="MistralRMSNorm",
        rotary="MistralRotaryEmbedding", base="model", layers="layers", norm_name="norm",
    ),
    "qwen2": Family(
        module="qwen2.modeling_qwen2", layer="Qwen2DecoderLayer", norm="Qwen2RMSNorm",
        rotary="Qwen2RotaryEmbedding", base="model", layers="layers", norm_name="norm",
    ),
}  # fmt: skip
"""Supported config.json model_types."""


def transformers_module():
    """transformers, imported on first use; ConfigError saying how to install it if missing."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ConfigError(f"model {BUILDER!r} needs transformers ({e}): {INSTALL_HINT}") from None


def model_folder(path: Any) -> Path:
    """`path` as a model folder holding config.json; ConfigError saying what is missing."""
    if not isinstance(path, str | Path) or not str(path):
        raise ConfigError(f"model {BUILDER!r}: 'path' must be a local folder, got {path!r}")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model {BUILDER!r}: path {str(path)!r} is not a local folder; give the folder save_pretrained "
            "wrote (config.json, *.safetensors, tokenizer files) at the same path on every peer; "
            "nothing is downloaded"
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model {BUILDER!r}: folder {str(folder)!r} holds no config.json")
    return folder


def load_config(folder: Path):
    """The folder's transformers config; ConfigError for a model_type we do not support."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"model {BUILDER!r}: {folder / 'config.json'} is not a JSON object: {e}") from None
    if model_type not in FAMILIES:
        raise ConfigError(
            f"model {BUILDER!r}: {folder / 'config.json'} has model_type {model_type!r}; supported: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    transformers = transformers_module()
    return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)


def family_classes(family: Family) -> dict[str, type]:
    """The family's classes by role ('layer', 'norm', 'rotary') as far as it names them."""
    mod = importlib.import_module(f"transformers.models.{family.module}")
    roles = {"layer": family.layer, "norm": family.norm, "rotary": family.rotary}
    return {role: getattr(mod, name) for role, name in roles.items() if name is not None}


def native_names(parts: list[tuple[str, nn.Module]], family: Family, *, tied: bool) -> dict[str, str]:
    """Swarm name -> transformers checkpoint name for each parameter of `parts` (a model's
    `parts()`); with `tied`, the head's lm_head reads the embedding matrix, which a tied
    checkpoint stores once."""
    embed_name = f"{family.base}.{'wte' if family is GPT2 else 'embed_tokens'}.weight"
    names = {}
    for key, part in parts:
        for name, _ in part.named_parameters():
            if key == HEAD_KEY and name == "lm_head.weight":
                native = embed_name if tied else name  # lm_head lies outside the base model
            elif key in (EMBED_KEY, HEAD_KEY):
                native = f"{family.base}.{name}"
            else:
                index = int(key.removeprefix("block."))
                native = f"{family.base}.{family.layers}.{index}.{name.removeprefix('layer.')}"
            names[f"{key}.{name}"] = native
    return names


def in_folder(names: dict[str, str], present: set[str], family: Family) -> dict[str, str]:
    """`names` as this folder spells them: a base model's checkpoint (GPT-2's original one)
    stores 'h.0.attn.c_attn.weight' where a causal LM stores 'transformer.h.0...'."""
    prefix = f"{family.base}."

    def spelled(native: str) -> str:
        bare = native.removeprefix(prefix)
        return bare if native not in present and bare in present else native

    return {swarm: spelled(native) for swarm, native in names.items()}


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def text_encoder(folder: Path, vocab_size: int):
    """A function: text (bytes) -> int64 token ids (N,) by the folder's tokenizer, which it loads
    when called (building the model does not need the tokenizer)."""

    def encode(text: bytes) -> Tensor:
        if not has_tokenizer(folder):
            raise ConfigError(
                f"model {BUILDER!r}: folder {str(folder)!r} holds no tokenizer (tokenizer.json, tokenizer.model "
                "or vocab.json): save the tokenizer there with save_pretrained, or feed token ids from Python"
            )
        tokenizer = transformers_module().AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
        chunk = 256  # lines a chunk: the fast tokenizer encodes a batch of chunks in parallel
        chunks = ["".join(lines[i : i + chunk]) for i in range(0, len(lines), chunk)]
        ids = tokenizer(chunks, add_special_tokens=False, verbose=False)["input_ids"]
        tokens = torch.cat([torch.tensor(c, dtype=torch.int64) for c in ids if c])  # (N,)
        top = int(tokens.max())
        if top >= vocab_size:
            raise ConfigError(
                f"model {BUILDER!r}: the tokenizer in {str(folder)!r} gives token id {top}, but the model's "
                f"vocab_size is {vocab_size}: the tokenizer does not belong to this model"
            )
        return tokens

    return encode


def weights_to_load(folder: Path, pretrained: bool | None) -> bool:
    """Whether to load the folder's weights, given the builder's `pretrained` option."""
    has_weights = any(folder.glob("*.safetensors"))
    if pretrained and not has_weights:
        raise ConfigError(
            f"model {BUILDER!r}: pretrained is true, but folder {str(folder)!r} holds no *.safetensors weights"
        )
    return has_weights if pretrained is None else pretrained


def save_native(
    full_state: Mapping[str, Tensor], model_config: Mapping[str, Any], out_dir: str | Path
) -> Path:
    """Write a trained hf-causal-lm as a folder transformers loads: `from_pretrained(out_dir)`.

    `full_state` holds every parameter by swarm name ('block.3.layer.attn.c_attn.weight'), as a
    `ReferenceResult.state` or the stages' `stage_state_dict`s together; `model_config` is the
    run's model options (its 'path' gives the config and tokenizer to write beside the weights).
    Writes model.safetensors under transformers' names, config.json with tie_word_embeddings
    false (the head holds its own lm_head; see the module docstring) and dtype float32, and a
    copy of the folder's tokenizer files. Returns `out_dir`. Raises ConfigError if the state
    does not hold exactly the model's parameters.
    """
    model = build_model(BUILDER, {**model_config, "pretrained": False}, device="meta")
    folder = model_folder(model_config["path"])
    config = load_config(folder)
    names = native_names(model.parts(), FAMILIES[config.model_type], tied=False)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_native_tensors(full_state, names, out / SINGLE_FILE)
    config.tie_word_embeddings = False
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    return out
