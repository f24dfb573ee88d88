"""One stage's compute and optimizer state, without any networking.

The contract with the peer shell around it:
- `forward(mb_id, x)` runs the stage and keeps (input, output) until `backward(mb_id, ...)`
  (or `drop(mb_id)`); the last stage uses `forward_loss_backward` instead.
- Gradients are committed at most once per microbatch id and step: a replayed microbatch
  gets its input gradient recomputed but adds nothing more to the parameters' gradients.
- `apply_step(step, n)` steps the optimizer only when exactly `n` microbatches of `step`
  were committed, so a step never goes through on partial or doubled gradients.
All methods run on the caller's thread; the shell calls them from one worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from swarmtrain.errors import BadFrameError, RemoteError
from swarmtrain.model import StageModule
from swarmtrain.train.optim import make_optimizer
from swarmtrain.wire.records import OptimizerConfig


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

    def __init__(self, module: StageModule, optimizer: OptimizerConfig, *, microbatch_size: int):
        self.module = module
        self.device = next(module.parameters()).device
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
        shape, dtype = module.input_spec(microbatch_size)
        self.input_spec = TensorSpec(tuple(shape), dtype, microbatch_size)
        shape, dtype = module.target_spec(microbatch_size)
        self.target_spec = TensorSpec(tuple(shape), dtype, microbatch_size)
        shape, dtype = module.output_spec(microbatch_size)
        self.output_spec = TensorSpec(tuple(shape), dtype, microbatch_size)
        self.step = 0
        self.steps_applied = 0
        self._pending: dict[str, tuple[Tensor, Tensor]] = {}
        self._committed: set[str] = set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    def check_inputs(self, x: Tensor, targets: Tensor | None) -> None:
        self.input_spec.check("x", x)
        if targets is not None:
            self.target_spec.check("targets", targets)
            if targets.shape[0] != x.shape[0]:
                raise BadFrameError(f"targets have batch {targets.shape[0]} but x has batch {x.shape[0]}")

    def _input(self, x: Tensor) -> Tensor:
        x = x.to(self.device)
        if x.is_floating_point() and not self.module.is_first:  # nobody upstream needs stage 0's input grad
            x.requires_grad_(True)
        return x

    def forward(self, mb_id: str, x: Tensor) -> Tensor:
        """Run the stage on `x`, keep what backward needs, return the detached output (CPU)."""
        x = self._input(x)
        with torch.enable_grad():
            out = self.module(x)
        self._pending[mb_id] = (x, out)
        return out.detach().cpu()

    def backward(self, mb_id: str, grad_out: Tensor) -> Tensor | None:
        """Backpropagate `grad_out` through `mb_id`'s forward; return the input's gradient."""
        if mb_id not in self._pending:
            raise RemoteError(f"no forward state for microbatch {mb_id} (it was dropped or never ran)")
        x, out = self._pending.pop(mb_id)
        self.output_spec.check("grad", grad_out)
        if tuple(grad_out.shape) != tuple(out.shape):
            raise BadFrameError(
                f"gradient has shape {tuple(grad_out.shape)}, the output had {tuple(out.shape)}"
            )
        return self._backprop(mb_id, out, grad_out.to(self.device), x)

    def forward_loss_backward(
        self, mb_id: str, x: Tensor, targets: Tensor, loss_scale: float
    ) -> tuple[float, Tensor | None]:
        """Last stage: forward, loss, backward in one go. Returns (unscaled loss, input grad)."""
        x = self._input(x)
        with torch.enable_grad():
            loss = self.module.loss(self.module(x), targets.to(self.device))
        grad_x = self._backprop(mb_id, loss * loss_scale, None, x)
        return float(loss.detach()), grad_x

    def _backprop(self, mb_id: str, out: Tensor, grad_out: Tensor | None, x: Tensor) -> Tensor | None:
        wrt = ([x] if x.requires_grad else []) + self.params
        grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True)
        grad_x = grads[0].detach().cpu() if x.requires_grad else None
        if mb_id not in self._committed:
            self._committed.add(mb_id)
            for p, g in zip(self.params, grads[len(wrt) - len(self.params) :]):
                if g is not None:
                    p.grad.add_(g)
        return grad_x

    def drop(self, mb_id: str) -> None:
        """Forget a microbatch whose downstream failed; its replay will run forward again."""
        self._pending.pop(mb_id, None)

    def check_step(self, step: int, num_microbatches: int) -> bool:
        """Whether `step` still needs applying here (False: it is the step just applied).

        Raises RemoteError (not retryable) for another step, or when this replica does not
        hold the gradients of exactly `num_microbatches` microbatches of `step`.
        """
        if step == self.step - 1 and self.steps_applied > 0 and not self._committed:
            return False
        if step != self.step:
            raise RemoteError(f"this stage is at step {self.step}, not {step}", retryable=False)
        if len(self._committed) != num_microbatches:
            raise RemoteError(
                f"this stage holds gradients of {len(self._committed)} of {num_microbatches} microbatches "
                f"of step {step}: replay the missing ones before stepping",
                retryable=False,
            )
        return True

    def grads(self) -> list[Tensor]:
        """The gradient buffers, in parameter order (replicas average these before stepping)."""
        return [p.grad for p in self.params]

    def apply_step(self, step: int, num_microbatches: int) -> int:
        """Step the optimizer for `step` if all its microbatches are committed; returns the new step.

        A replica may hold 0 microbatches of a step: after averaging, its gradients are the
        group's. A repeated call for the step just applied is answered without stepping again.
        """
        if not self.check_step(step, num_microbatches):
            return self.step
        self.optimizer.step()
        for p in self.params:
            p.grad.zero_()
        self._committed.clear()
        self._pending.clear()
        self.step += 1
        self.steps_applied += 1
        return self.step

    def discard_step(self) -> None:
        """Forget this step's gradients and in-flight work (the trainer will replay the step)."""
        for p in self.params:
            p.grad.zero_()
        self._committed.clear()
        self._pending.clear()

    # state transfer between replicas

    def export_state(self) -> dict[str, Tensor]:
        """Parameters ('param.KEY') and optimizer state ('opt.I.NAME'), as CPU copies."""
        out = {f"param.{k}": p.detach().cpu().clone() for k, p in self.named_params.items()}
        for i, p in enumerate(self.params):
            for name, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    out[f"opt.{i}.{name}"] = value.detach().cpu().clone()
        return out

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
        self.step = step
