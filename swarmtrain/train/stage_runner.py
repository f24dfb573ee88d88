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
        self.params = [p for p in module.parameters() if p.requires_grad]
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
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.add_(g)
        return grad_x

    def drop(self, mb_id: str) -> None:
        """Forget a microbatch whose downstream failed; its replay will run forward again."""
        self._pending.pop(mb_id, None)

    def apply_step(self, step: int, num_microbatches: int) -> int:
        """Step the optimizer for `step` if all its microbatches are committed; returns the new step.

        A repeated call for the step just applied is answered without stepping again.
        Raises RemoteError (not retryable) when gradients are missing.
        """
        if step == self.step - 1 and self.steps_applied > 0 and not self._committed:
            return self.step
        if step != self.step:
            raise RemoteError(f"this stage is at step {self.step}, not {step}", retryable=False)
        if len(self._committed) != num_microbatches:
            raise RemoteError(
                f"this stage holds gradients of {len(self._committed)} of {num_microbatches} microbatches "
                f"of step {step}: replay the missing ones before stepping",
                retryable=False,
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._committed.clear()
        self._pending.clear()
        self.step += 1
        self.steps_applied += 1
        return self.step
