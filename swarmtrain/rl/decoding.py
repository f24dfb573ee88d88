"""Incremental decoding of a whole policy with a KV cache: tiny-gpt and hf-causal-lm.

A rollout peer holds the whole `SwarmModel` (embed, blocks, head). A `Decoder` runs it one
token at a time, keeping each block's keys and values, so a step costs one position, not the
whole prefix:

    dec = decoder_for(model)
    logits = dec.prefill(ids, attention_mask)  # (B, P, V): every prompt position
    logits = dec.step(tokens)                  # (B, V): the next position of every row

Prompts are LEFT-padded to a common length P: `attention_mask` (B, P) is 0 on the padding
and 1 on the prompt. A row's positions count its own tokens only (position = number of
non-pad tokens before it), and no query attends to a pad key, so each row's logits are those
of its unpadded sequence starting at position 0: what the training forward computes on the
same tokens right-padded to the model's seq_len (`swarmtrain.rl.grpo.grpo_microbatch`).

tiny-gpt decodes through its blocks' `forward_cached` path. An hf-causal-lm decodes through
the transformers model its parts come from, rebuilt around the very same parameter tensors
(no copy: an optimizer step on the SwarmModel is seen by the next generation), with
transformers' own `DynamicCache`, attention masks and rotary embeddings.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Protocol

import torch
from torch import Tensor, nn

from swarmtrain.errors import ConfigError
from swarmtrain.model.gpt import KV, GPTBlock, GPTEmbed
from swarmtrain.model.swarm_model import SwarmModel


class Decoder(Protocol):
    """One decoding session over a batch of left-padded prompts."""

    def prefill(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Start a session: ids (B, P) int64 left-padded, attention_mask (B, P) (1: token, 0: pad)
        -> logits (B, P, V) at every prompt position (pad positions hold garbage)."""
        ...

    def step(self, tokens: Tensor) -> Tensor:
        """Append one token per row, tokens (B,) int64 -> logits (B, V) for the position after it."""
        ...


def positions_of(attention_mask: Tensor) -> Tensor:
    """Position of each token of left-padded rows (B, P): 0 at a row's first real token (pads: 0)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P)


class GPTDecoder:
    """A `Decoder` for tiny-gpt (swarmtrain.model.gpt) through its blocks' `forward_cached`."""

    def __init__(self, model: SwarmModel):
        self.model = model
        self._kv: list[KV | None] = []
        self._keep: Tensor | None = None  # (B, S) bool: which cached keys are real tokens
        self._next_pos: Tensor | None = None  # (B,) position of each row's next token

    def _run(self, ids: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        x = self.model.embed.forward_at(ids, pos)  # (B, T, C)
        for i, block in enumerate(self.model.blocks):
            x, self._kv[i] = block.forward_cached(x, self._kv[i], mask)  # (B, T, C)
        return self.model.head(x)  # (B, T, V)

    def prefill(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        B, P = ids.shape
        keep = attention_mask.bool()  # (B, P)
        pos = positions_of(attention_mask)  # (B, P)
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()  # (P, P)
        # A pad query may attend to itself: a row with no key at all would give NaN.
        mask = (causal[None] & keep[:, None, :]) | torch.eye(
            P, dtype=torch.bool, device=ids.device
        )  # (B, P, P)
        self._kv = [None] * len(self.model.blocks)
        self._keep, self._next_pos = keep, pos[:, -1] + 1  # (B, P), (B,)
        return self._run(ids, pos, mask[:, None])  # (B, P, V)

    def step(self, tokens: Tensor) -> Tensor:
        B = tokens.size(0)
        self._keep = torch.cat((self._keep, self._keep.new_ones(B, 1)), dim=1)  # (B, S)
        logits = self._run(
            tokens[:, None], self._next_pos[:, None], self._keep[:, None, None, :]
        )  # (B, 1, V)
        self._next_pos = self._next_pos + 1
        return logits[:, -1]  # (B, V)


_HF_VIEWS: weakref.WeakKeyDictionary[SwarmModel, nn.Module] = weakref.WeakKeyDictionary()


def hf_model_of(model: SwarmModel) -> nn.Module:
    """The transformers causal LM that an hf-causal-lm SwarmModel's parts come from, holding the
    SwarmModel's own parameter tensors (shared, not copied), with untied embeddings.

    Built once per SwarmModel (on the meta device, then given the shared parameters; the rotary
    embedding, a constant of the config, is rebuilt on the parameters' device). In-place
    updates of the parameters (optimizer steps, `load_state_dict`) are seen; a parameter
    replaced by another tensor object after the first call is not. Raises
    ConfigError if the model's parameters do not map one to one onto the transformers model's.
    """
    view = _HF_VIEWS.get(model)
    if view is not None:
        return view
    from transformers import AutoModelForCausalLM

    from swarmtrain.model.hf_folder import FAMILIES, native_names

    config = copy.deepcopy(model.blocks[0].config)
    config.tie_word_embeddings = False  # the swarm's head holds its own lm_head
    with torch.device("meta"):
        view = AutoModelForCausalLM.from_config(config)
    names = native_names(model.parts(), FAMILIES[config.model_type], tied=False)
    params = {f"{key}.{name}": p for key, part in model.parts() for name, p in part.named_parameters()}
    expected = {name for name, _ in view.named_parameters()}
    if set(names.values()) != expected:
        raise ConfigError(
            f"the {config.model_type} model's parameters do not match the swarm parts': "
            f"{sorted(expected ^ set(names.values()))[:4]}"
        )
    for swarm_name, native in names.items():
        owner, _, leaf = native.rpartition(".")
        view.get_submodule(owner)._parameters[leaf] = params[swarm_name]
    device = next(model.parameters()).device
    for name, module in view.named_modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, leaf = name.rpartition(".")
            with torch.device(device):
                setattr(view.get_submodule(parent), leaf, type(module)(config))
    view.eval()
    _HF_VIEWS[model] = view
    return view


class HFDecoder:
    """A `Decoder` for hf-causal-lm (swarmtrain.model.hf): the transformers model `hf_model_of`
    gives, with a `DynamicCache` and explicit position ids."""

    def __init__(self, model: SwarmModel):
        self.hf = hf_model_of(model)
        # transformers 5 renamed past_key_values to cache (the old name warns, then goes)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"
        )
        self._cache = None
        self._mask: Tensor | None = None  # (B, S) 1 on real tokens
        self._next_pos: Tensor | None = None  # (B,)

    def prefill(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        from transformers import DynamicCache

        self._cache = DynamicCache()
        self._mask = attention_mask.long()  # (B, P)
        pos = positions_of(attention_mask)  # (B, P)
        self._next_pos = pos[:, -1] + 1  # (B,)
        out = self.hf(
            input_ids=ids,
            attention_mask=self._mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        return out.logits  # (B, P, V)

    def step(self, tokens: Tensor) -> Tensor:
        B = tokens.size(0)
        self._mask = torch.cat((self._mask, self._mask.new_ones(B, 1)), dim=1)  # (B, S)
        out = self.hf(
            input_ids=tokens[:, None],
            attention_mask=self._mask,
            position_ids=self._next_pos[:, None],
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self._next_pos = self._next_pos + 1
        return out.logits[:, -1]  # (B, V)


def decoder_for(model: SwarmModel) -> Decoder:
    """A new decoding session for `model`: tiny-gpt or hf-causal-lm; ConfigError for other models."""
    if isinstance(model.embed, GPTEmbed) and all(isinstance(b, GPTBlock) for b in model.blocks):
        return GPTDecoder(model)
    from swarmtrain.model.hf import DecoderBlock

    if all(isinstance(b, DecoderBlock) for b in model.blocks):
        return HFDecoder(model)
    raise ConfigError(
        f"no incremental decoder for a model with {type(model.embed).__name__} and "
        f"{type(model.blocks[0]).__name__} parts: generation supports tiny-gpt and hf-causal-lm"
    )
