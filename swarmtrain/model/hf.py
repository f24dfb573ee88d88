"""hf-causal-lm: a Hugging Face causal language model from a local folder, cut into swarm parts.

    swarmtrain coordinator --model hf-causal-lm --model-config '{"path": "/models/gpt2", "seq_len": 512}'

The folder is what `save_pretrained` writes: config.json, and optionally the weights
(*.safetensors, sharded or not) and the tokenizer files. Nothing is ever downloaded; every
peer needs the folder at the same path. Supported families: GPT-2 ('gpt2') and the Llama
family ('llama', 'mistral', 'qwen2').

The parts are transformers' own layers:
- embed: token embeddings (GPT-2: wte + wpe; Llama: embed_tokens);
- block i: decoder layer i, given what the full model gives its layers: the causal mask of
  the chosen attention implementation (built by transformers' own mask functions, sliding
  windows included), position ids 0..T-1, and for the Llama family the rotary cos/sin;
- head: the final norm and lm_head.

Tied embeddings are untied: SwarmModel parts share no weights, so the head holds its own copy
of the embedding matrix. Loaded from a tied checkpoint, that copy starts equal to the
embedding (both read the same tensor); from scratch, the two start independent. After
training they differ, and `save_native` writes config.json with tie_word_embeddings false.

Dropout is off (GPT-2's embd/attn/resid_pdrop, the Llama family's attention_dropout): every
replica of a stage, and a replayed microbatch, must compute the same activations.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor, nn

from swarmtrain.errors import ConfigError
from swarmtrain.model.hf_folder import (
    BUILDER,
    FAMILIES,
    GPT2,
    Family,
    family_classes,
    in_folder,
    load_config,
    model_folder,
    native_names,
    save_native,
    text_encoder,
    weights_to_load,
)
from swarmtrain.model.native import checkpoint_files
from swarmtrain.model.registry import register_builder
from swarmtrain.model.swarm_model import EMBED_KEY, HEAD_KEY, SwarmModel, block_key

__all__ = ["BUILDER", "hf_causal_lm", "save_native"]

log = logging.getLogger(__name__)

ATTENTION = ("sdpa", "eager")
"""Attention implementations a block may use; both apply the causal mask."""
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary embedding types whose frequencies depend on the config only (not on the sequence)."""


class GPT2Embed(nn.Module):
    """Token ids (B, T) -> token + learned position embeddings (B, T, C), as GPT2Model begins."""

    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
        return self.wte(idx) + self.wpe(pos)  # (B, T, C)


class TokenEmbed(nn.Module):
    """Token ids (B, T) -> embeddings (B, T, C), as the Llama family's models begin."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, idx: Tensor) -> Tensor:
        return self.embed_tokens(idx)  # (B, T, C)


class Head(nn.Module):
    """(B, T, C) -> logits (B, T, V): the final norm (named as the family names it) and lm_head."""

    def __init__(self, config, norm: nn.Module, norm_name: str):
        super().__init__()
        self.norm_name = norm_name
        self.add_module(norm_name, norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(getattr(self, self.norm_name)(x))  # (B, T, V)


def rope_frequencies(config, rotary_cls: type) -> tuple[Tensor, float]:
    """(inv_freq (D/2,) on the CPU, attention scaling) of the config's rotary embedding, as the
    family's rotary module computes them; ConfigError for a type that depends on the sequence."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = config.rope_parameters["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise ConfigError(
            f"model {BUILDER!r}: rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    init = (
        rotary_cls.compute_default_rope_parameters
        if rope_type == "default"
        else ROPE_INIT_FUNCTIONS[rope_type]
    )
    with torch.device("cpu"):  # not the meta device a model is built on: these are constants
        return init(config)


class DecoderBlock(nn.Module):
    """One transformers decoder layer as a swarm block: (B, T, C) -> (B, T, C).

    It gives the layer what the full model gives it: the causal mask, from transformers' own
    mask function for the layer's attention (sliding window or full) and implementation
    (eager: an additive (B, 1, T, T) mask; sdpa: None with is_causal, unless a window needs a
    mask), position ids 0..T-1, and for rotary models cos/sin of those positions.
    """

    def __init__(self, layer: nn.Module, config, *, sliding: bool, rope: tuple[Tensor, float] | None):
        super().__init__()
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        self.layer = layer
        self.config = config
        self.mask_fn = create_sliding_window_causal_mask if sliding else create_causal_mask
        # A constant of the config, kept off the module's parameters and buffers: `to_empty`
        # would leave a buffer holding garbage, and no checkpoint holds it.
        self.inv_freq, self.rope_scaling = rope if rope is not None else (None, 1.0)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        pos = torch.arange(T, device=x.device)[None]  # (1, T)
        # position_ids=None: positions are 0..T-1 in every row, so no packed sequences to find
        # (and the mask builds on the meta device too).
        mask = self.mask_fn(config=self.config, inputs_embeds=x, attention_mask=None, cache=None)
        kwargs = {}
        if self.inv_freq is not None:
            freqs = pos[..., None].float() * self.inv_freq.to(x.device)  # (1, T, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, D)
            cos = (emb.cos() * self.rope_scaling).to(x.dtype)
            sin = (emb.sin() * self.rope_scaling).to(x.dtype)
            kwargs["position_embeddings"] = (cos, sin)
        return self.layer(x, attention_mask=mask, position_ids=pos, is_causal=True, **kwargs)  # (B, T, C)


def init_hf_weights(module: nn.Module, *, std: float, residual_std: float, norm_cls: type) -> None:
    """transformers' init for these families: N(0, initializer_range) for Linear, Conv1D and
    Embedding weights (a padding row zero), zero biases, ones for RMSNorm weights; GPT-2's
    residual projections (c_proj) at initializer_range / sqrt(2 n_layer). LayerNorm resets itself."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, GPT2Attention | GPT2MLP):
        # Conv1D has no reset_parameters: the layers that own them set them, c_proj scaled.
        for name, child in module.named_children():
            if isinstance(child, Conv1D):
                nn.init.normal_(child.weight, mean=0.0, std=residual_std if name == "c_proj" else std)
                nn.init.zeros_(child.bias)
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, norm_cls) and norm_cls is not nn.LayerNorm:
        nn.init.ones_(module.weight)


def _parts(config, family: Family) -> tuple[nn.Module, list[DecoderBlock], Head]:
    """The embed, blocks and head of the model `config` describes, on the current default device."""
    classes = family_classes(family)
    rope = rope_frequencies(config, classes["rotary"]) if family.rotary else None
    layer_types = getattr(config, "layer_types", None)  # Qwen2: per layer; Mistral: sliding_window
    blocks = []
    for i in range(config.num_hidden_layers):
        if layer_types:
            sliding = layer_types[i] == "sliding_attention"
        else:
            sliding = getattr(config, "sliding_window", None) is not None
        layer = classes["layer"](config, layer_idx=i)
        blocks.append(DecoderBlock(layer, config, sliding=sliding, rope=rope))
    if family is GPT2:
        embed, norm = GPT2Embed(config), nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
    else:
        embed, norm = TokenEmbed(config), classes["norm"](config.hidden_size, eps=config.rms_norm_eps)
    return embed, blocks, Head(config, norm, family.norm_name)


@register_builder(BUILDER)
def hf_causal_lm(
    path: str, seq_len: int, pretrained: bool | None = None, attn_implementation: str = "sdpa"
) -> SwarmModel:
    """A transformers causal LM from local folder `path`, over sequences of `seq_len` tokens.

    `pretrained`: None loads the folder's safetensors if it has any (and starts from scratch,
    per-part seeded, if it has only config.json); True requires them; False ignores them.
    `attn_implementation`: 'sdpa' (default) or 'eager'. Input: (seq_len,) int64 token ids;
    loss: 'cross_entropy' on (seq_len,) next-token targets. See the module docstring.
    """
    folder = model_folder(path)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ConfigError(f"model {BUILDER!r}: seq_len must be a positive integer, got {seq_len!r}")
    if pretrained not in (None, True, False):
        raise ConfigError(f"model {BUILDER!r}: pretrained must be true, false or null, got {pretrained!r}")
    if attn_implementation not in ATTENTION:
        raise ConfigError(
            f"model {BUILDER!r}: attn_implementation {attn_implementation!r} is not one of {', '.join(ATTENTION)}"
        )
    config = load_config(folder)
    family = FAMILIES[config.model_type]
    if seq_len > config.max_position_embeddings:
        raise ConfigError(
            f"model {BUILDER!r}: seq_len {seq_len} is longer than the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    if getattr(config, "add_cross_attention", False):
        raise ConfigError(f"model {BUILDER!r}: cross-attention (add_cross_attention) is not supported")
    for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop", "attention_dropout"):
        if getattr(config, name, 0.0):
            setattr(config, name, 0.0)
    config._attn_implementation = attn_implementation
    tied = bool(config.tie_word_embeddings)
    if tied:
        log.info("%s: the folder's tied lm_head gets its own copy of the embedding (untied)", folder)

    embed, blocks, head = _parts(config, family)
    parts = [(EMBED_KEY, embed), *((block_key(i), b) for i, b in enumerate(blocks)), (HEAD_KEY, head)]
    names = native_names(parts, family, tied=tied)
    load = weights_to_load(folder, pretrained)
    if load:
        names = in_folder(names, set(checkpoint_files(folder)), family)
    std = config.initializer_range
    norm_cls = type(head.get_submodule(family.norm_name))
    return SwarmModel(
        embed=embed,
        blocks=blocks,
        head=head,
        loss="cross_entropy",
        input_shape=(seq_len,),
        input_dtype=torch.int64,
        init_weights=lambda m: init_hf_weights(
            m, std=std, residual_std=std / math.sqrt(2 * config.num_hidden_layers), norm_cls=norm_cls
        ),
        native_names=names,
        native_weights=folder if load else None,
        encode_text=text_encoder(folder, config.vocab_size),
    )
