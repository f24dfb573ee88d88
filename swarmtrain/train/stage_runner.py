"""One stage's compute and optimizer state, without any networking.

The contract with the peer shell around it:
- A microbatch is its input `x` and the named loss inputs the run's loss takes
  ({'targets': ...}, plus e.g. 'weights'). Every stage checks both with `check_inputs`
  before any compute, and a stage that is not the last passes the loss inputs on unchanged.
- `forward(mb_id, x)` runs the stage and keeps (input, output) until `backward(mb_id, ...)`
  (or `drop(mb_id)`); the last stage uses `forward_loss_backward` instead.
- A microbatch's parameter gradient is added to the gradient buffer on its first ("fresh")
  pass only. A replay (`replay=True`: it was sent again after a failure, and another replica
  may hold it already) keeps its gradient apart ("held") until the step's commit decides.
  A microbatch already in the buffer or held adds nothing more: its input gradient is
  recomputed and returned, nothing else.
- A non-finite loss or input gradient, or parameter gradients that are non-finite or out
  of bounds (`bounds.param_grads`), are refused (RemoteError REFUSED, not retryable) before
  anything is added, so one bad microbatch cannot poison the step. `bounds` also holds the
  streams the serving side checks incoming tensors against (`train.bounds`).
- The commit: `report()` says what the buffer and the held copies hold; `fold(step, fresh,
  take)` checks the buffer holds exactly `fresh`, closes the step (later passes add
  nothing) and adds the held copies named in `take`; `apply_step(step, total)` writes the
  replicas' summed gradients (or keeps the local ones) and steps the optimizer, refusing a
  step whose gradients or result would not be finite and leaving the replica as it was.
- A score pass (`score_forward`, `score_last`) runs the stage forward only, in eval mode
  under no_grad, on the parameters of exactly the step it names (WRONG_STEP, not retryable,
  otherwise): it keeps nothing and touches no gradient, counter or step.
- Policy versions: `step` is also the parameters' version; once someone asked for weights,
  `apply_step` first copies the outgoing version into `versions` (`train.versions`), and
  `import_state` and `relabel` forget what it held.
- Mixed precision (`compute_dtype` bf16 or fp16): forward and backward run under autocast,
  while parameters, their gradients and the optimizer state stay float32 (the master copy).
  fp16 backward passes are loss-scaled by the stage itself (`train.loss_scale`): an overflow
  runs that microbatch's backward again at half the scale. What the runner hands out keeps
  the stage's declared dtype (float32 activations and gradients; the serving side may send
  them in the compute dtype, `StageContext.codec_for`), so peers computing in different
  dtypes serve one run, and replicas stay bit-identical: each applies the same summed
  total, whatever it computed its share in.
All methods run on the caller's thread; the shell calls them from one worker thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from swarmtrain.errors import BadFrameError, Cause, RemoteError
from swarmtrain.model import StageModule
from swarmtrain.model.losses import name_mismatch
from swarmtrain.train.bounds import SQUARE_SAFE, BoundsConfig, StageBounds, tensor_norm
from swarmtrain.train.loss_scale import LossScale
from swarmtrain.train.optim import StepGuard, lr_at, make_optimizer, set_lr
from swarmtrain.train.versions import PolicyVersions, VersionsConfig
from swarmtrain.wire.frames import all_finite
from swarmtrain.wire.records import OptimizerConfig

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""What a runner may compute in (`compute_dtype`), and the autocast dtype of each."""


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape (batch dim free up to `max_batch`) and dtype of a boundary tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    max_batch: int

    def check(self, name: str, t: Tensor) -> None:
        """Raise BadFrameError unless `t` fits this spec."""
        if t.dtype != self.dtype:
            raise BadFrameError(f"tensor {name!r} has dtype {t.dtype}, this stage expects {self.dtype}")
        if t.dim() != len(self.shape) or tuple(t.shape[1:]) != self.shape[1:]:
            want = ("B", *self.shape[1:])
            raise BadFrameError(f"tensor {name!r} has shape {tuple(t.shape)}, this stage expects {want}")
        if not 1 <= t.shape[0] <= self.max_batch:
            raise BadFrameError(
                f"tensor {name!r} has batch {t.shape[0]}, this run allows 1..{self.max_batch}"
            )


class StageRunner:
    """A stage module, its optimizer, and the microbatches in flight through it."""

    def __init__(
        self,
        module: StageModule,
        optimizer: OptimizerConfig,
        *,
        microbatch_size: int,
        bounds: BoundsConfig | None = None,
        max_steps: int = 0,
        versions: VersionsConfig | None = None,
        compute_dtype: str = "fp32",
    ):
        """`max_steps`: the run's step count, which the learning-rate schedule decays over
        (`optim.lr_at`; 0: the run has none, and the schedule must not need one); `versions`:
        how many policy versions of the parameters to keep for weights requests;
        `compute_dtype`: 'fp32', 'bf16' or 'fp16' (autocast; see the module docstring)."""
        if compute_dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(AUTOCAST_DTYPES)}, got {compute_dtype!r}")
        self.module = module
        self.device = next(module.parameters()).device
        self.compute_dtype = compute_dtype
        self.loss_scale = LossScale() if compute_dtype == "fp16" else None
        """The scale of this stage's fp16 backward passes (None in fp32 and bf16)."""
        self.named_params = {
            f"{key}.{name}": p
            for key, part in module.parts()
            for name, p in part.named_parameters()
            if p.requires_grad
        }
        self.params = list(self.named_params.values())
        for p in self.params:  # persistent gradient buffers: replicas average them in place
            p.grad = torch.zeros_like(p)
        self.optimizer = make_optimizer(self.params, optimizer)
        self.optimizer_config = optimizer
        self.max_steps = max_steps
        self._guard = StepGuard(self.optimizer)
        shape, dtype = module.input_spec(microbatch_size)
        self.input_spec = TensorSpec(tuple(shape), dtype, microbatch_size)
        self.loss_input_specs = {
            name: TensorSpec(tuple(shape), dtype, microbatch_size)
            for name, (shape, dtype) in module.loss_input_specs(microbatch_size).items()
        }
        """What each named loss input of a microbatch must look like (every stage checks them)."""
        shape, dtype = module.output_spec(microbatch_size)
        self.output_spec = TensorSpec(tuple(shape), dtype, microbatch_size)
        self.bounds = StageBounds(bounds)
        """Running norm bounds of the tensors this replica takes in and computes."""
        self.step = 0
        """The optimizer step this replica is at, which is also its policy version (`versions`)."""
        self.versions = PolicyVersions(versions)
        """The parameters by policy version: snapshots taken at commits once someone asks."""
        self.steps_applied = 0
        self._pending: dict[str, tuple[Tensor, Tensor]] = {}
        self._committed: set[str] = set()
        self._held: dict[str, list[Tensor | None]] = {}
        self._closed = False
        self.from_seed = True
        """Still the run-seed initialisation (never stepped, never took a replica's state):
        only such a runner may adopt the run's step as its own."""

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_committed(self) -> int:
        """Microbatches of this step in the gradient buffer."""
        return len(self._committed)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def has_gradients(self) -> bool:
        """Whether this step's gradients (buffered or held) would be lost if the peer left now."""
        return bool(self._committed or self._held)

    def check_inputs(self, x: Tensor, loss_inputs: Mapping[str, Tensor]) -> None:
        """Raise BadFrameError unless a microbatch fits this run.

        `x` must fit this stage's input; `loss_inputs` must name exactly the inputs the run's
        loss takes, each of its dtype and per-sample shape, with x's batch, and finite.
        """
        self.input_spec.check("x", x)
        problem = name_mismatch(loss_inputs, self.loss_input_specs, self.module.loss_fn.name)
        if problem is not None:
            raise BadFrameError(
                f"{problem}; give each microbatch as (inputs, {{name: tensor}}) with these names"
            )
        for name, spec in self.loss_input_specs.items():
            t = loss_inputs[name]
            if not isinstance(t, Tensor):
                raise BadFrameError(f"loss input {name!r} is a {type(t).__name__}, not a tensor")
            spec.check(name, t)
            if t.shape[0] != x.shape[0]:
                raise BadFrameError(
                    f"loss input {name!r} has batch {t.shape[0]} but x has batch {x.shape[0]}"
                )
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise BadFrameError(f"loss input {name!r} holds NaN or inf values")

    def _input(self, x: Tensor) -> Tensor:
        x = x.to(self.device)
        if x.is_floating_point() and not self.module.is_first:  # nobody upstream needs stage 0's input grad
            x.requires_grad_(True)
        return x

    def forward(self, mb_id: str, x: Tensor) -> Tensor:
        """Run the stage on `x`, keep what backward needs, return the detached output (on the
        stage's device: a codec compresses it there and only its bytes cross to the host)."""
        x = self._input(x)
        with torch.enable_grad():
            with self._autocast():
                out = self.module(x)
            out = out.to(self.output_spec.dtype)  # the boundary keeps the stage's declared dtype
        self._pending[mb_id] = (x, out)
        return out.detach()

    def backward(self, mb_id: str, grad_out: Tensor, *, replay: bool = False) -> Tensor | None:
        """Backpropagate `grad_out` through `mb_id`'s forward; return the input's gradient."""
        if mb_id not in self._pending:
            raise RemoteError(f"no forward state for microbatch {mb_id} (it was dropped or never ran)")
        x, out = self._pending.pop(mb_id)
        self.output_spec.check("grad", grad_out)
        if tuple(grad_out.shape) != tuple(out.shape):
            raise BadFrameError(
                f"gradient has shape {tuple(grad_out.shape)}, the output had {tuple(out.shape)}"
            )
        return self._backprop(mb_id, out, grad_out.to(self.device), x, replay)

    def forward_loss_backward(
        self,
        mb_id: str,
        x: Tensor,
        loss_inputs: Mapping[str, Tensor],
        loss_scale: float,
        *,
        replay: bool = False,
    ) -> tuple[float, Tensor | None]:
        """Last stage: forward, the run's loss against the named `loss_inputs` (checked by
        `check_inputs`), backward, in one go. Returns (unscaled loss, input grad)."""
        x = self._input(x)
        inputs = {name: t.to(self.device) for name, t in loss_inputs.items()}
        with torch.enable_grad():
            with self._autocast():
                loss = self.module.loss(self.module(x), inputs)
            loss = loss.float()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise RemoteError(f"microbatch {mb_id} has a non-finite loss ({value})", cause=Cause.REFUSED)
        grad_x = self._backprop(mb_id, loss * loss_scale, None, x, replay)
        return value, grad_x

    def score_forward(self, step: int, x: Tensor) -> Tensor:
        """A score pass through a stage that is not the last: the output (on the stage's device)
        of `x` on the parameters of `step` (see the module docstring)."""
        with self._scoring(step):
            return self.module(x.to(self.device))

    def score_last(self, step: int, x: Tensor, loss_inputs: Mapping[str, Tensor]) -> tuple[float, Tensor]:
        """A score pass through the last stage: (the loss, the loss's per-sample scores as float32
        CPU, shaped like 'targets'). RemoteError REFUSED when the run's loss has no score or
        either is not finite."""
        loss = self.module.loss_fn
        if loss.score is None:
            raise RemoteError(
                f"loss {loss.name!r} has no score: it takes no score passes", cause=Cause.REFUSED
            )
        with self._scoring(step):
            inputs = {name: t.to(self.device) for name, t in loss_inputs.items()}
            out = self.module(x.to(self.device))
            value = float(self.module.loss(out, inputs))
            scores = loss.score(out, inputs).float().cpu()
        if not math.isfinite(value) or not all_finite(scores):
            raise RemoteError("a score pass gave a non-finite loss or score", cause=Cause.REFUSED)
        return value, scores

    def _autocast(self):
        """Forward (and the backward autograd records for it) in the compute dtype."""
        dtype = AUTOCAST_DTYPES[self.compute_dtype]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    @contextlib.contextmanager
    def _scoring(self, step: int):
        if step != self.step:
            raise RemoteError(
                f"this stage is at step {self.step}, not {step}: it scores only on the parameters "
                "of the step it holds",
                cause=Cause.WRONG_STEP,
                retryable=False,
            )
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.module.train(was_training)

    def _backprop(
        self, mb_id: str, out: Tensor, grad_out: Tensor | None, x: Tensor, replay: bool
    ) -> Tensor | None:
        if mb_id in self._committed or mb_id in self._held or self._closed:
            # counted already (or the step is closed): only the input gradient is wanted
            if not x.requires_grad:
                return None
            (grad_x,) = self._grad(out, [x], grad_out)
            return self._checked(mb_id, grad_x.detach())
        wrt = ([x] if x.requires_grad else []) + self.params
        grads = self._grad(out, wrt, grad_out)
        grad_x = self._checked(mb_id, grads[0].detach()) if x.requires_grad else None
        param_grads = grads[len(wrt) - len(self.params) :]
        norm, numel = tensor_norm([g for g in param_grads if g is not None])
        refused = self.bounds.param_grads.admit(norm, numel)
        if refused is not None:
            raise RemoteError(
                f"microbatch {mb_id} gives this stage parameter gradients it refuses: {refused}",
                cause=Cause.REFUSED,
            )
        if replay:
            self._held[mb_id] = [None if g is None else g.detach().clone() for g in param_grads]
        else:
            self._committed.add(mb_id)
            for p, g in zip(self.params, param_grads):
                if g is not None:
                    p.grad.add_(g)
        return grad_x

    def _grad(self, out: Tensor, wrt: list[Tensor], grad_out: Tensor | None) -> list[Tensor | None]:
        """d out / d wrt (out a scalar loss when `grad_out` is None). In fp16: loss-scaled, run
        again at half the scale while a gradient overflows, and unscaled (see `train.loss_scale`);
        gradients that are not finite even at scale 1 are returned as they are, for the caller
        to refuse."""
        if self.loss_scale is None:
            return list(torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True))
        while True:
            scale = self.loss_scale.scale
            if grad_out is None:
                grads = torch.autograd.grad(out * scale, wrt, allow_unused=True, retain_graph=True)
            else:
                grads = torch.autograd.grad(
                    out, wrt, grad_outputs=grad_out * scale, allow_unused=True, retain_graph=True
                )
            flags = [torch.isfinite(g).all() for g in grads if g is not None]
            if not flags or bool(torch.stack(flags).all()):  # one device sync, not one per tensor
                self.loss_scale.passed()
                return [None if g is None else g / scale for g in grads]  # a power of two: exact
            if not self.loss_scale.backoff():
                return list(grads)

    @staticmethod
    def _checked(mb_id: str, grad_x: Tensor) -> Tensor:
        if not all_finite(grad_x):
            raise RemoteError(f"microbatch {mb_id} has a non-finite input gradient", cause=Cause.REFUSED)
        return grad_x

    def drop(self, mb_id: str) -> None:
        """Forget a microbatch whose downstream failed; its replay will run forward again."""
        self._pending.pop(mb_id, None)

    # the commit

    def report(self) -> tuple[frozenset[str], frozenset[str]]:
        """(microbatches in the gradient buffer, replayed microbatches held apart) of this step."""
        return frozenset(self._committed), frozenset(self._held)

    def reopen(self) -> None:
        """Accept gradients again (a commit attempt failed; replays may come before the next)."""
        self._closed = False

    def fold(self, step: int, *, fresh: set[str], take: list[str]) -> None:
        """Close `step` and add the held copies named in `take` to the buffer.

        Raises RemoteError (retryable) unless the buffer holds exactly `fresh`: something
        arrived since the replicas reported, and the commit must be planned again. Held
        copies not in `take` are discarded (another replica counts them).
        """
        if step != self.step:
            raise RemoteError(
                f"this stage is at step {self.step}, not {step}", cause=Cause.WRONG_STEP, retryable=False
            )
        if self._committed != fresh:
            raise RemoteError(
                f"this replica holds gradients of {len(self._committed)} microbatches of step {step}, "
                f"the plan expects {len(fresh)}: plan the commit again",
                retryable=True,
            )
        missing = [mb for mb in take if mb not in self._held]
        if missing:
            raise RemoteError(f"no held gradients of microbatches {missing}", retryable=True)
        self._closed = True
        for mb in sorted(take):
            for p, g in zip(self.params, self._held.pop(mb)):
                if g is not None:
                    p.grad.add_(g)
            self._committed.add(mb)
        self._held.clear()

    def grads(self) -> list[Tensor]:
        """The gradient buffers, in parameter order (replicas exchange these before stepping)."""
        return [p.grad for p in self.params]

    def apply_step(self, step: int, total: list[Tensor] | None = None, *, grad_scale: float = 1.0) -> int:
        """Step the optimizer for `step` (already folded); returns the new step.

        `total`: the summed gradients of every replica of the stage (None: this replica's
        own buffer is the total). `grad_scale` multiplies the gradients first (the trainer
        rescales a step that lost microbatches, and clips the whole model's gradient norm).
        The learning rate is the schedule's for `step` (`optim.lr_at`). A repeated call for the step just applied is
        answered without stepping again; another step raises RemoteError (not retryable).
        Raises RemoteError (REFUSED) when the scaled gradients are not finite or their squares
        would overflow fp32 (nothing is written), or when the step would leave a parameter or
        the optimizer state non-finite (parameters and state are restored bit for bit; the
        gradient buffer then holds the scaled total). The replica stays at `step`.
        """
        if step == self.step - 1 and self.steps_applied > 0 and not self.has_gradients:
            return self.step
        if step != self.step:
            raise RemoteError(
                f"this stage is at step {self.step}, not {step}", cause=Cause.WRONG_STEP, retryable=False
            )
        if not self._closed:
            raise RemoteError(f"step {step} was not folded before it was applied", retryable=True)
        norm, _ = tensor_norm(self.grads() if total is None else total)
        if not norm * abs(grad_scale) < SQUARE_SAFE:  # NaN fails too
            raise RemoteError(
                f"stage refuses to apply step {step}: its summed gradients have norm "
                f"{norm * abs(grad_scale):.3g}, beyond what the optimizer can square in fp32 "
                f"({SQUARE_SAFE:.3g}); parameters and optimizer state are unchanged",
                cause=Cause.REFUSED,
            )
        with torch.no_grad():
            if total is not None:
                for p, t in zip(self.params, total):
                    p.grad.copy_(t)
            if grad_scale != 1.0:
                for p in self.params:
                    p.grad.mul_(grad_scale)
        set_lr(self.optimizer, lr_at(self.optimizer_config, step, self.max_steps))
        self.versions.before_apply(step, self.named_params)
        refused = self._guard.step()
        if refused is not None:
            raise RemoteError(
                f"stage refuses to apply step {step}: {refused}; parameters and optimizer state "
                "are as they were",
                cause=Cause.REFUSED,
            )
        self.discard_step()
        self.from_seed = False
        self.step += 1
        self.steps_applied += 1
        return self.step

    def discard_step(self) -> None:
        """Forget this step's gradients and in-flight work, and accept gradients again."""
        for p in self.params:
            p.grad.zero_()
        self._committed.clear()
        self._pending.clear()
        self._held.clear()
        self._closed = False

    def relabel(self, step: int) -> None:
        """Go on from the state held as step `step` (a run-wide rollback: `swarmtrain.train.rollback`)."""
        self.discard_step()
        self.versions.reset()
        self.from_seed = False
        self.step = step

    def param_digest(self) -> str:
        """A hash of every parameter's bytes: replicas are bit-identical exactly when these match."""
        h = hashlib.blake2b(digest_size=16)
        for name, p in self.named_params.items():
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # state transfer between replicas

    def export_state(self) -> dict[str, Tensor]:
        """Parameters ('param.KEY') and optimizer state ('opt.I.NAME'), as CPU copies."""
        out = {f"param.{k}": p.detach().cpu().clone() for k, p in self.named_params.items()}
        for i, p in enumerate(self.params):
            for name, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    out[f"opt.{i}.{name}"] = value.detach().cpu().clone()
        return out

    def export_named_state(self) -> dict[str, Tensor]:
        """Parameters ('param.NAME') and optimizer state ('opt.NAME.STATE') by swarm name, as CPU
        copies: unlike `export_state`'s positions, the names mean the same block whatever span
        holds it, so stages of another layout can take exactly their blocks from them."""
        out = {f"param.{k}": p.detach().cpu().clone() for k, p in self.named_params.items()}
        for k, p in self.named_params.items():
            for name, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    out[f"opt.{k}.{name}"] = value.detach().cpu().clone()
        return out

    def import_named_state(self, state: dict[str, Tensor], step: int) -> None:
        """Take this stage's parameters and optimizer state at `step` out of `state`
        (`export_named_state`s of the stages of another layout, merged: names of other blocks
        are ignored); raises BadFrameError naming a parameter that is missing or does not fit."""
        missing = [k for k in self.named_params if f"param.{k}" not in state]
        if missing:
            raise BadFrameError(
                f"the states given lack {len(missing)} of this stage's parameters, e.g. {missing[0]!r}"
            )
        for k, p in self.named_params.items():
            value = state[f"param.{k}"]
            if value.shape != p.shape or value.dtype != p.dtype:
                raise BadFrameError(f"state {k!r} has shape {tuple(value.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            for k, p in self.named_params.items():
                p.copy_(state[f"param.{k}"])
        self.optimizer.state.clear()
        for k, p in self.named_params.items():
            prefix = f"opt.{k}."
            for key, value in state.items():
                if key.startswith(prefix) and "." not in key[len(prefix) :]:
                    self.optimizer.state[p][key[len(prefix) :]] = value.to(p.device).clone()
        self.discard_step()
        self.versions.reset()
        self.from_seed = False
        self.step = step

    def import_state(self, state: dict[str, Tensor], step: int) -> None:
        """Take over a live replica's `export_state()` at `step`; raises BadFrameError if it does not fit."""
        want = {f"param.{k}" for k in self.named_params}
        have = {k for k in state if k.startswith("param.")}
        if have != want:
            raise BadFrameError(
                f"replica state has parameters {len(have)}, this stage has {len(want)} (or other names)"
            )
        with torch.no_grad():
            for k, p in self.named_params.items():
                value = state[f"param.{k}"]
                if value.shape != p.shape or value.dtype != p.dtype:
                    raise BadFrameError(
                        f"replica state {k!r} has shape {tuple(value.shape)}, expected {tuple(p.shape)}"
                    )
                p.copy_(value)
        self.optimizer.state.clear()
        for key, value in state.items():
            if key.startswith("opt."):
                _, index, name = key.split(".", 2)
                p = self.params[int(index)]
                self.optimizer.state[p][name] = value.to(p.device).clone()
        self.discard_step()
        self.versions.reset()
        self.from_seed = False
        self.step = step
