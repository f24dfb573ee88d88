"""`SwarmModel`: a model cut into parts a pipeline can split, and seeded per-part init.

A swarm model is `embed -> blocks[0] -> ... -> blocks[N-1] -> head`, plus a loss on the
head's output. Each part has a key ("embed", "block.0", ..., "head") and is initialised from
its own seed, derived from the run seed and that key alone. So block i gets bit-identical
weights on every peer, whichever other blocks the peer holds and in whatever order it built
them, and the global RNG is left untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from swarmtrain.errors import ConfigError

EMBED_KEY = "embed"
HEAD_KEY = "head"

InitWeights = Callable[[nn.Module], None]
"""Called on every submodule of a part after `reset_parameters()`, nanoGPT's `_init_weights` style."""


def block_key(index: int) -> str:
    """The part key of block `index` (global index within the whole model)."""
    return f"block.{index}"


def part_seed(run_seed: int, key: str) -> int:
    """The init seed of part `key` in a run seeded `run_seed`: 63 bits of sha256("{run_seed}:{key}")."""
    digest = hashlib.sha256(f"{run_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_part(module: nn.Module, key: str, run_seed: int, *, init_weights: InitWeights | None = None) -> None:
    """Initialise every parameter of part `key` in place, deterministically from (`run_seed`, `key`).

    Calls `reset_parameters()` on each submodule that has one (in `module.modules()` order),
    then `init_weights(m)` on each submodule if given, all under a forked CPU RNG seeded with
    `part_seed(run_seed, key)`; the caller's RNG state is unchanged afterwards.

    The module must already hold real storage on the CPU in float32 (after `to_empty(device="cpu")`
    for a meta-built module); init on any other device or dtype would not be bit-identical across
    peers, so it raises ValueError. Parameters that neither hook touches keep whatever was there.
    """
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.device.type != "cpu" or (tensor.is_floating_point() and tensor.dtype != torch.float32):
            raise ValueError(
                f"part {key!r}: {name} is {tensor.dtype} on {tensor.device}; parts are initialised on the CPU "
                "in float32 (call to_empty(device='cpu') first, move the part after init)"
            )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(part_seed(run_seed, key))
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
        if init_weights is not None:
            for m in module.modules():
                init_weights(m)


class SwarmModel(nn.Module):
    """`embed -> blocks -> head`, with a loss and the per-sample shapes a pipeline needs.

    Contract for builders: parts share no parameters (no weight tying across parts), every
    parameter is set by some submodule's `reset_parameters()` or by `init_weights` (a meta-built
    part materialised with `to_empty` holds garbage otherwise), each part maps a batch to a batch
    with the batch on dim 0, and nothing registers buffers that must survive `to_empty`.
    """

    def __init__(
        self,
        *,
        embed: nn.Module,
        blocks: Sequence[nn.Module],
        head: nn.Module,
        loss: Callable[[Tensor, Tensor], Tensor],
        input_shape: tuple[int, ...],
        input_dtype: torch.dtype,
        target_shape: tuple[int, ...],
        target_dtype: torch.dtype,
        init_weights: InitWeights | None = None,
    ):
        super().__init__()
        if len(blocks) == 0:
            raise ConfigError("a SwarmModel needs at least one block to split into stages")
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.loss_fn = loss
        self.input_shape = tuple(int(d) for d in input_shape)
        """Shape of one input sample, without the batch dim, e.g. (seq_len,) for tokens."""
        self.input_dtype = input_dtype
        self.target_shape = tuple(int(d) for d in target_shape)
        """Shape of one target sample, without the batch dim."""
        self.target_dtype = target_dtype
        self.init_weights = init_weights

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def parts(self) -> list[tuple[str, nn.Module]]:
        """(key, module) for every part in pipeline order: embed, block.0 .. block.N-1, head."""
        return [
            (EMBED_KEY, self.embed),
            *((block_key(i), block) for i, block in enumerate(self.blocks)),
            (HEAD_KEY, self.head),
        ]

    def reset_parameters(self, run_seed: int) -> None:
        """Initialise every part from `run_seed` (see `init_part`); the model must be on the CPU in float32."""
        for key, part in self.parts():
            init_part(part, key, run_seed, init_weights=self.init_weights)

    def forward(self, x: Tensor, targets: Tensor | None = None) -> Tensor:
        """The head's output for inputs `x`, or the scalar loss against `targets` if given."""
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out if targets is None else self.loss_fn(out, targets)
