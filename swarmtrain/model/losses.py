"""Named losses: what the last stage computes from the head's output and a microbatch's named inputs.

A microbatch is its inputs `x` plus named per-sample tensors the loss takes: 'targets', and
whatever else the objective needs (per-token weights, masks, advantages, behaviour
log-probs). A loss is `fn(output, inputs) -> scalar`, the mean over the microbatch, declared
together with the per-sample (shape, dtype) of each input it takes: fixed, or derived from
the per-sample spec of the head's output (cross-entropy's targets drop the class dim). Every
stage derives the same specs, so each can check a microbatch's inputs before computing
anything, and the run manifest names the loss by its registered name.

    @register_loss("masked_mse", inputs=lambda out: {"targets": (out[0], torch.float32),
                                                     "mask": (out[0], torch.float32)})
    def masked_mse(output, inputs):
        return ((output - inputs["targets"]) ** 2 * inputs["mask"]).mean()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from swarmtrain.errors import ConfigError
from swarmtrain.wire.records import check_loss_name

SampleSpec = tuple[tuple[int, ...], torch.dtype]
"""(shape without the batch dim, dtype) of one sample of a tensor."""
LossFn = Callable[[Tensor, Mapping[str, Tensor]], Tensor]
"""fn(output, inputs) -> the scalar mean loss over the microbatch."""
ScoreFn = Callable[[Tensor, Mapping[str, Tensor]], Tensor]
"""fn(output, inputs) -> per-sample scores, float32, shaped like the input 'targets' (a score
pass answers with these: e.g. GRPO's per-token log-probs of the taken tokens)."""
InputSpecs = Mapping[str, SampleSpec] | Callable[[SampleSpec], Mapping[str, SampleSpec]]
"""A loss's inputs: name -> per-sample spec, or a function of the head's per-sample output spec giving them."""

RESERVED_INPUT_NAMES = ("x", "grad")
"""Names no loss input may take: a forward frame carries the stage input as 'x', its reply the gradient as 'grad'."""


def _describe(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(repr(n) for n in names) if names else "no inputs"


def check_input_specs(specs: Mapping[str, SampleSpec], where: str) -> dict[str, SampleSpec]:
    """`specs` as a plain dict of (shape tuple, dtype); raises ConfigError naming the first bad entry."""
    if not isinstance(specs, Mapping):
        raise ConfigError(
            f"{where}: loss inputs must map names to (shape, dtype), got {type(specs).__name__}"
        )
    out = {}
    for name, spec in specs.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_INPUT_NAMES:
            raise ConfigError(
                f"{where}: loss input name {name!r} must be a Python identifier other than "
                f"{' and '.join(map(repr, RESERVED_INPUT_NAMES))}"
            )
        try:
            shape, dtype = spec
            shape = tuple(shape)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}: loss input {name!r} has spec {spec!r}; give (per-sample shape, dtype), e.g. ((128,), torch.int64)"
            ) from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
            raise ConfigError(f"{where}: loss input {name!r} has shape {shape}; dims must be integers >= 1")
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"{where}: loss input {name!r} has dtype {dtype!r}, not a torch.dtype")
        out[name] = (shape, dtype)
    return out


def name_mismatch(given: Iterable[str], expected: Iterable[str], loss_name: str) -> str | None:
    """None if `given` names exactly `expected`, else one line saying what is missing and what is unknown."""
    given, expected = set(given), set(expected)
    if given == expected:
        return None
    problems = []
    if expected - given:
        problems.append(f"missing loss input {_describe(expected - given)}")
    if given - expected:
        problems.append(f"unknown loss input {_describe(given - expected)}")
    return f"{'; '.join(problems)}: loss {loss_name!r} takes {_describe(expected)}"


@dataclass(frozen=True, kw_only=True)
class Loss:
    """A loss over the head's output and named per-sample inputs."""

    name: str
    """Its registered name ('cross_entropy'), or the qualified name of a model's own loss function."""
    fn: LossFn
    """fn(output, inputs) -> the scalar mean loss over the microbatch."""
    inputs: InputSpecs
    """The per-sample (shape, dtype) of each named input: fixed, or derived from the head's per-sample output spec."""
    score: ScoreFn | None = None
    """What a score pass answers with (None: the loss has no score and score passes are refused)."""

    def input_specs(self, output_spec: SampleSpec) -> dict[str, SampleSpec]:
        """Per-sample specs of the inputs this loss takes on a head whose per-sample output is `output_spec`.

        Raises ConfigError when the head's output does not fit the loss (cross-entropy over an
        output with no class dim, say) or the declared specs are malformed.
        """
        specs = self.inputs(output_spec) if callable(self.inputs) else self.inputs
        return check_input_specs(specs, f"loss {self.name!r}")

    def __call__(self, output: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
        """The scalar loss of `output` (batch on dim 0) against `inputs`, which must name exactly
        the inputs this loss takes (ValueError saying which are missing or unknown otherwise)."""
        if not isinstance(inputs, Mapping):
            raise ValueError(
                f"loss {self.name!r} takes its inputs by name, got a {type(inputs).__name__}: "
                f"pass a mapping such as {{'targets': targets}}"
            )
        want = self.input_specs((tuple(output.shape[1:]), output.dtype))
        problem = name_mismatch(inputs, want, self.name)
        if problem is not None:
            raise ValueError(problem)
        return self.fn(output, inputs)


_LOSSES: dict[str, Loss] = {}


def register_loss(
    name: str, *, inputs: InputSpecs, score: ScoreFn | None = None
) -> Callable[[LossFn], LossFn]:
    """Decorator: register `fn(output, inputs) -> scalar` as loss `name`, taking `inputs`.

    `score(output, inputs)`, if given, is what a score pass through the pipeline answers with
    (`swarmtrain.train.scoring`): per-sample float32 scores shaped like 'targets', computed
    under no_grad from the same output and inputs as the loss.
    `name` is what a run manifest (`--loss`) refers to; register the loss in the module of the
    model's builder, so that every peer that builds the model knows it. Registering a different
    function under a taken name raises ConfigError. The function is returned unchanged.
    """
    check_loss_name(name)
    if not callable(inputs):
        inputs = check_input_specs(inputs, f"loss {name!r}")

    def register(fn: LossFn) -> LossFn:
        known = _LOSSES.get(name)
        if known is not None and known.fn is not fn:
            raise ConfigError(
                f"loss name {name!r} is already registered to {known.fn.__module__}.{known.fn.__qualname__}"
            )
        _LOSSES[name] = Loss(name=name, fn=fn, inputs=inputs, score=score)
        return fn

    return register


def registered_losses() -> list[str]:
    """The registered loss names, sorted."""
    return sorted(_LOSSES)


def get_loss(name: str) -> Loss:
    """The loss registered as `name`; raises ConfigError listing the registered ones."""
    loss = _LOSSES.get(name)
    if loss is None and name.startswith("grpo"):
        import swarmtrain.rl.grpo  # noqa: F401  (registers the built-in GRPO losses)

        loss = _LOSSES.get(name)
    if loss is None:
        raise ConfigError(
            f"unknown loss {name!r}: registered losses are {_describe(_LOSSES)} (--loss); "
            "register another with @register_loss in your model builder's module"
        )
    return loss


# built-in losses


def class_targets(output_spec: SampleSpec, loss_name: str) -> SampleSpec:
    """Per-sample spec of class ids for scores `output_spec`: the output's shape without its last
    (class) dim, int64. (T, V) logits take (T,) targets, (C,) scores take one () target."""
    shape, _ = output_spec
    if not shape:
        raise ConfigError(
            f"loss {loss_name!r} needs class scores on the last dim of the head's output, "
            "but it is one number per sample: choose a loss for this model's output"
        )
    return shape[:-1], torch.int64


def _token_cross_entropy(output: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy at every position: scores (B, ..., V), class ids (B, ...) -> (B*...,)."""
    V = output.size(-1)
    return F.cross_entropy(output.reshape(-1, V), targets.reshape(-1), reduction="none")  # (B*...,)


@register_loss("cross_entropy", inputs=lambda out: {"targets": class_targets(out, "cross_entropy")})
def cross_entropy(output: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """Mean cross-entropy of scores (B, ..., V) against class ids 'targets' (B, ...), int64.

    For (B, T, V) logits this is the language model's next-token loss; for (B, C) scores a
    classifier's. Targets of -100 are ignored, as in torch's cross_entropy.
    """
    V = output.size(-1)
    return F.cross_entropy(output.reshape(-1, V), inputs["targets"].reshape(-1))  # over (B*..., V)


def _weighted_inputs(output_spec: SampleSpec) -> dict[str, SampleSpec]:
    targets = class_targets(output_spec, "weighted_cross_entropy")
    return {"targets": targets, "weights": (targets[0], torch.float32)}


@register_loss("weighted_cross_entropy", inputs=_weighted_inputs)
def weighted_cross_entropy(output: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """Cross-entropy at each position times its 'weights' (B, ...), float32, averaged over all positions.

    The mean is over every position, weighted or not, so the loss is linear in the weights and
    a step's gradient does not depend on how samples fall into microbatches; all-ones weights
    give `cross_entropy` (where no target is -100: cross_entropy leaves those out of its mean,
    here they count as zeros). For a mask's mean over the kept positions only, scale the mask
    by (positions / kept positions) of the whole step.
    """
    per_position = _token_cross_entropy(output, inputs["targets"])  # (B*...,)
    return (per_position * inputs["weights"].reshape(-1)).mean()
