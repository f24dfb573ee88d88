"""`SwarmModel`: a model cut into parts a pipeline can split, and seeded per-part init.

A swarm model is `embed -> blocks[0] -> ... -> blocks[N-1] -> head`, plus a loss on the
head's output. Each part has a key ("embed", "block.0", ..., "head") and is initialised from
its own seed, derived from the run seed and that key alone. So block i gets bit-identical
weights on every peer, whichever other blocks the peer holds and in whatever order it built
them, and the global RNG is left untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from swarmtrain.errors import ConfigError
from swarmtrain.model.losses import Loss, SampleSpec, check_input_specs, get_loss
from swarmtrain.model.native import load_native_weights

EMBED_KEY = "embed"
HEAD_KEY = "head"
PROBE_BATCH = 2
"""Batch of the meta probes that learn shapes; 2, not 1, so a part that squeezes the batch dim shows up."""

InitWeights = Callable[[nn.Module], None]
"""Called on every submodule of a part after `reset_parameters()`, nanoGPT's `_init_weights` style."""
EncodeText = Callable[[bytes], Tensor]
"""Training text (bytes) -> a 1-D int64 tensor of the model's token ids."""


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
    peers, so it raises ValueError. Parameters that neither hook touches keep whatever was there
    (`materialise_parts` refuses a part that has any).
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


def materialise_parts(
    parts: Sequence[tuple[str, nn.Module]], run_seed: int, *, init_weights: InitWeights | None = None
) -> None:
    """Give meta-built `parts` (key, module) real storage on the CPU and initialise each with `init_part`.

    Every floating parameter and buffer is filled with NaN between `to_empty` and the init, so
    one that no initialiser sets is seen, not left holding whatever memory it landed on (which
    may differ between peers, or look like plausible weights). Raises ConfigError naming each
    such tensor by part key and name ('block.3.attn.c_attn.weight'), across all the parts.
    """
    unset = []
    for key, part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            for t in [*part.parameters(), *part.buffers()]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        init_part(part, key, run_seed, init_weights=init_weights)
        unset += [
            f"{kind} {key}.{name}"
            for kind, named in (("parameter", part.named_parameters()), ("buffer", part.named_buffers()))
            for name, t in named
            if t.is_floating_point() and torch.isnan(t).any()
        ]
    if unset:
        raise ConfigError(
            f"{', '.join(unset)} {'is' if len(unset) == 1 else 'are'} set by no reset_parameters() or "
            "init_weights (NaN after init): give its module a reset_parameters, or set it in the "
            "SwarmModel's init_weights"
        )


def sample_spec(x: Tensor, where: str) -> SampleSpec:
    """Per-sample spec of a probe's result `x`; raises ConfigError unless it kept the probe's batch on dim 0."""
    if x.dim() == 0 or x.shape[0] != PROBE_BATCH:
        raise ConfigError(
            f"{where} returned shape {tuple(x.shape)} for a batch of {PROBE_BATCH}: parts must keep the batch on dim 0"
        )
    return tuple(x.shape[1:]), x.dtype


def _own_loss(
    loss: str | Callable,
    loss_inputs: Mapping[str, SampleSpec] | None,
    target_shape: tuple[int, ...] | None,
    target_dtype: torch.dtype | None,
) -> Loss:
    """The model's own Loss from SwarmModel's arguments (see SwarmModel for the three forms)."""
    has_targets = target_shape is not None or target_dtype is not None
    if isinstance(loss, str):
        if loss_inputs is not None or has_targets:
            raise ConfigError(
                f"loss {loss!r} is registered with its own inputs: give neither loss_inputs nor target_shape/target_dtype"
            )
        return get_loss(loss)
    if not callable(loss):
        raise ConfigError(f"loss must be a registered loss name or a callable, got {type(loss).__name__}")
    name = f"{getattr(loss, '__module__', None) or '?'}.{getattr(loss, '__qualname__', type(loss).__name__)}"
    if loss_inputs is not None and not has_targets:
        return Loss(name=name, fn=loss, inputs=check_input_specs(loss_inputs, f"loss {name!r}"))
    if loss_inputs is None and target_shape is not None and target_dtype is not None:
        specs = check_input_specs({"targets": (target_shape, target_dtype)}, f"loss {name!r}")
        return Loss(name=name, fn=lambda out, inputs: loss(out, inputs["targets"]), inputs=specs)
    raise ConfigError(
        f"loss {name!r}: give either loss_inputs (a mapping name -> (per-sample shape, dtype), the loss "
        "called as loss(output, {name: tensor})) or target_shape and target_dtype (loss(output, targets)), not both"
    )


class SwarmModel(nn.Module):
    """`embed -> blocks -> head`, with a loss over named inputs and the per-sample shapes a pipeline needs.

    The loss takes one of three forms:
    - `loss="cross_entropy"`: a registered loss (swarmtrain.model.losses), whose inputs derive
      from the head's output;
    - `loss=fn, loss_inputs={"targets": ((T,), torch.int64), "weights": ((T,), torch.float32)}`:
      `fn(output, {name: tensor})` over the named per-sample inputs declared;
    - `loss=fn, target_shape=(T,), target_dtype=torch.int64`: `fn(output, targets)`, one input
      named 'targets' (the original form, still accepted).

    Contract for builders: parts share no parameters (no weight tying across parts), every
    parameter is set by some submodule's `reset_parameters()` or by `init_weights` (a meta-built
    part materialised with `to_empty` holds garbage otherwise; `materialise_parts` refuses it),
    each part maps a batch to a batch with the batch on dim 0, and nothing registers buffers
    that must survive `to_empty`.

    Optional, for models that have a checkpoint format of their own (swarmtrain.model.hf):
    `native_names` maps each parameter's swarm name to its name there, `native_weights` names a
    folder of such a checkpoint that parts load after their init (`swarmtrain.model.native`),
    and `encode_text` turns training text into the model's token ids (None: the bytes are the
    tokens, as for tiny-gpt).
    """

    def __init__(
        self,
        *,
        embed: nn.Module,
        blocks: Sequence[nn.Module],
        head: nn.Module,
        loss: str | Callable[[Tensor, Mapping[str, Tensor]], Tensor] | Callable[[Tensor, Tensor], Tensor],
        input_shape: tuple[int, ...],
        input_dtype: torch.dtype,
        loss_inputs: Mapping[str, SampleSpec] | None = None,
        target_shape: tuple[int, ...] | None = None,
        target_dtype: torch.dtype | None = None,
        init_weights: InitWeights | None = None,
        native_names: Mapping[str, str] | None = None,
        native_weights: str | Path | None = None,
        encode_text: EncodeText | None = None,
    ):
        super().__init__()
        if len(blocks) == 0:
            raise ConfigError("a SwarmModel needs at least one block to split into stages")
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.loss_fn = _own_loss(loss, loss_inputs, target_shape, target_dtype)
        """The model's own loss, called as loss_fn(output, {name: tensor})."""
        self.input_shape = tuple(int(d) for d in input_shape)
        """Shape of one input sample, without the batch dim, e.g. (seq_len,) for tokens."""
        self.input_dtype = input_dtype
        self.init_weights = init_weights
        self.native_names = dict(native_names) if native_names else None
        """Swarm parameter name ('block.3.attn.c_attn.weight') -> its name in the model's native
        checkpoint ('transformer.h.3.attn.c_attn.weight'), for every parameter; None: the model
        has no native format."""
        self.native_weights = None if native_weights is None else str(native_weights)
        """A folder of native safetensors (named as `native_names` says) whose tensors every
        stage loads into its parts after their init; None: the parts keep their init."""
        self.encode_text = encode_text
        """Text (bytes) -> a 1-D int64 tensor of token ids; None: each byte is a token."""
        if native_weights is not None and not self.native_names:
            raise ConfigError("a SwarmModel with native_weights needs native_names to find its tensors there")

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

    def materialise(self, run_seed: int) -> None:
        """Give a meta-built model real storage on the CPU in float32 and its initial weights:
        every part initialised as a stage initialises it (`materialise_parts`: ConfigError for a
        parameter no initialiser sets), then the parts' tensors loaded from `native_weights` if set."""
        materialise_parts(self.parts(), run_seed, init_weights=self.init_weights)
        if self.native_weights is not None:
            load_native_weights(self, self.native_weights)

    def resolve_loss(self, loss: str | None = None) -> Loss:
        """The registered loss named `loss`, or the model's own for None; ConfigError for an unknown name."""
        return self.loss_fn if loss is None else get_loss(loss)

    @torch.no_grad()
    def output_spec(self) -> SampleSpec:
        """Per-sample (shape, dtype) of the head's output, from meta tensors run through the
        parts with meta stand-ins for the parameters: no memory, no compute, on any device."""
        meta = {
            name: torch.empty_like(t, device="meta")
            for name, t in [*self.named_parameters(), *self.named_buffers()]
        }
        x = torch.empty((PROBE_BATCH, *self.input_shape), dtype=self.input_dtype, device="meta")
        return sample_spec(torch.func.functional_call(self, meta, (x,)), "the head")

    def loss_input_specs(self, loss: str | None = None) -> dict[str, SampleSpec]:
        """Per-sample (shape, dtype), without the batch dim, of each named input that `loss` (a
        registered name; None: the model's own loss) takes on this model. Raises ConfigError for
        an unknown loss or one that does not fit the head's output."""
        return self.resolve_loss(loss).input_specs(self.output_spec())

    def forward(self, x: Tensor, targets: Tensor | Mapping[str, Tensor] | None = None) -> Tensor:
        """The head's output for inputs `x`, or the model's scalar loss if `targets` is given:
        named inputs {name: tensor}, or one tensor for a loss that takes 'targets' alone."""
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        if targets is None:
            return out
        if isinstance(targets, Tensor):
            names = self.loss_fn.input_specs((tuple(out.shape[1:]), out.dtype))
            if set(names) != {"targets"}:
                raise ValueError(
                    f"loss {self.loss_fn.name!r} takes named inputs {sorted(names)}, not one targets tensor: "
                    "call model(x, {name: tensor})"
                )
            targets = {"targets": targets}
        return self.loss_fn(out, targets)
