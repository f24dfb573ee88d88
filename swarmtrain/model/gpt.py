"""tiny-gpt: a nanoGPT-style causal transformer over bytes, cut into swarm parts.

embed (token + learned position embedding) -> n_layer pre-LN blocks -> head (final LayerNorm
and an untied projection to the vocabulary). No weight tying and no registered buffers, so
any contiguous run of blocks can live on its own peer and be built on the meta device.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarmtrain.errors import ConfigError
from swarmtrain.model.registry import register_builder
from swarmtrain.model.swarm_model import SwarmModel


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a tiny-gpt model; the defaults train in minutes on a CPU."""

    vocab_size: int = 256
    """Tokens in the vocabulary; 256 covers byte-level text."""
    seq_len: int = 128
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Transformer blocks, i.e. the model's num_blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and residual branches (0 for exact parity)."""

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"tiny-gpt: {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ConfigError(f"tiny-gpt: d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"tiny-gpt: dropout must be a number in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))


KV = tuple[Tensor, Tensor]
"""One block's cached keys and values, each (B, H, S, D)."""


class ResidualProjection(nn.Linear):
    """A Linear that writes into the residual stream; nanoGPT scales its init by 1/sqrt(2 n_layer)."""


class GPTEmbed(nn.Module):
    """Token ids (B, T) -> token + position embeddings (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.size(1) > self.seq_len:
            raise ValueError(f"tiny-gpt: {idx.size(1)} tokens is longer than seq_len={self.seq_len}")
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def forward_at(self, idx: Tensor, pos: Tensor) -> Tensor:
        """Token ids (B, T) at positions `pos` (B, T) -> embeddings (B, T, C): for incremental
        decoding, where a step's tokens sit at each row's own position."""
        if int(pos.max()) >= self.seq_len:
            raise ValueError(f"tiny-gpt: position {int(pos.max())} is beyond seq_len={self.seq_len}")
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = ResidualProjection(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        # is_causal builds the mask on the fly: no mask buffer to materialise or ship.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def forward_cached(self, x: Tensor, past: KV | None, mask: Tensor) -> tuple[Tensor, KV]:
        """Attention of new positions x (B, T, C) over the cached ones and themselves.

        `past` holds the keys and values (B, H, S0, D) of earlier positions (None: none yet);
        `mask` (B, 1, T, S0 + T) bool says which key each query may attend to (True: attend),
        so it carries both causality and padding. Returns the output (B, T, C) and the keys and
        values of all S0 + T positions, the next call's `past`. The training `forward` is
        untouched: this path exists for generation only.
        """
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # (B, H, S0 + T, D)
            v = torch.cat((past[1], v), dim=2)  # (B, H, S0 + T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU()
        self.c_proj = ResidualProjection(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class GPTBlock(nn.Module):
    """One pre-LN transformer block: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # (B, T, C)

    def forward_cached(self, x: Tensor, past: KV | None, mask: Tensor) -> tuple[Tensor, KV]:
        """`forward` for incremental decoding: (B, T, C) -> (B, T, C) and this block's keys and
        values so far (see `CausalSelfAttention.forward_cached`)."""
        a, kv = self.attn.forward_cached(self.ln_1(x), past, mask)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv  # (B, T, C)


class GPTHead(nn.Module):
    """(B, T, C) -> logits (B, T, V): final LayerNorm and an untied projection to the vocabulary."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def init_gpt_weights(module: nn.Module, *, n_layer: int) -> None:
    """nanoGPT's init: N(0, 0.02) for Linear and Embedding weights, zero biases, residual
    projections at 0.02 / sqrt(2 * n_layer) so the residual stream's variance does not grow with depth."""
    if isinstance(module, nn.Linear):
        std = 0.02 / math.sqrt(2 * n_layer) if isinstance(module, ResidualProjection) else 0.02
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


@register_builder("tiny-gpt")
def tiny_gpt(**options) -> SwarmModel:
    """Build tiny-gpt; `options` are GPTConfig fields. Input: (seq_len,) int64 tokens; loss: the
    registered 'cross_entropy', whose 'targets' are (seq_len,) int64 next tokens."""
    cfg = GPTConfig(**options)
    return SwarmModel(
        embed=GPTEmbed(cfg),
        blocks=[GPTBlock(cfg) for _ in range(cfg.n_layer)],
        head=GPTHead(cfg),
        loss="cross_entropy",
        input_shape=(cfg.seq_len,),
        input_dtype=torch.int64,
        init_weights=functools.partial(init_gpt_weights, n_layer=cfg.n_layer),
    )


# Advertise GPTConfig's fields as the builder's options, so build_model can name them in errors.
tiny_gpt.__signature__ = inspect.signature(GPTConfig)
