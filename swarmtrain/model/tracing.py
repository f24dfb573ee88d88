"""Tracing a real model: what each of its blocks costs a stage that holds it, measured from
the module itself (torch, meta device). The planner's analytic model of those costs is
`swarmtrain.plan.cost_model`; `swarmtrain.train.placement` feeds it these records.

`block_costs` traces every part of a registered model on the meta device (no memory, no
compute, any model size) for one microbatch, forward and backward:

- FLOPs: `torch.utils.flop_counter.FlopCounterMode` counts the matmuls (linear layers and
  attention); elementwise ops, norms and softmax count nothing, as in the usual formulas.
- activations: `saved_tensors_hooks` sees every tensor autograd keeps for backward; the
  bytes of their distinct storages, parameters excluded, are what the block holds per
  microbatch until its backward pass.

Attention is traced as the fused kernel peers run (flash attention on CPU and CUDA), which
keeps q, k, v, the output and a logsumexp, not the (T x T) scores; on meta tensors
`scaled_dot_product_attention` would otherwise take its math path and keep the scores.

The embedding's costs are added to block 0's record and the head's (with the loss) to the
last block's, so block i's record is everything a stage holding block i pays for it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from swarmtrain.errors import ConfigError
from swarmtrain.model.registry import build_model
from swarmtrain.model.swarm_model import EMBED_KEY, HEAD_KEY, SwarmModel, block_key, materialise_parts

TRACE_DTYPES = {4: torch.float32, 2: torch.bfloat16}
"""Parameter and activation dtype a model is traced in, by `dtype_bytes`."""
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}
"""fp32 state tensors per parameter: AdamW's two moments, SGD's momentum buffer."""


@dataclass(frozen=True, kw_only=True)
class BlockCostRecord:
    """What one block (with the embedding or head it carries) costs one replica of its stage."""

    index: int
    """The block's index in the model."""
    parts: tuple[str, ...]
    """Part keys whose costs are summed here: ('embed', 'block.0'), ('block.1',), ..., ('block.N-1', 'head')."""
    forward_flops_per_token: float
    """Matmul FLOPs of the forward pass per token."""
    backward_flops_per_token: float
    """Matmul FLOPs of the backward pass per token (gradients of inputs and of weights)."""
    param_count: int
    """Parameters of the parts."""
    weight_bytes: int
    """Bytes of the weights alone, `dtype_bytes` each (gradients are `grad_bytes`)."""
    grad_bytes: int
    """Bytes of the weights' gradients, `dtype_bytes` per trainable parameter."""
    optimizer_bytes: int
    """Optimizer state: fp32 moments (and an fp32 master copy when weights are narrower)."""
    activation_bytes_per_token: float
    """Bytes autograd keeps per token until the backward pass (saved tensors, parameters excluded)."""
    boundary_bytes_per_token: float
    """Bytes per token of the block's output: what crosses a stage boundary after this block, uncompressed."""

    @property
    def flops_per_token(self) -> float:
        """Forward + backward FLOPs per token."""
        return self.forward_flops_per_token + self.backward_flops_per_token

    @property
    def state_bytes(self) -> int:
        """Weights, gradients and optimizer state: the memory the block costs whatever the batch."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


# tracing


def _flash_cpu_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _flash_cpu_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


_ATTENTION_FLOPS = {
    # FlopCounterMode knows the CUDA fused kernels but not the CPU one we route attention to.
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward_flop,
}


class _FusedAttention(TorchFunctionMode):
    """Route `F.scaled_dot_product_attention` to the CPU flash kernel, which has meta kernels
    and autograd, so a meta trace keeps what a fused kernel keeps (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not kwargs.get("enable_gqa", False):
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            options = {**dict(zip(names, rest, strict=False)), **kwargs}
            out, _logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q,
                k,
                v,
                options.get("dropout_p", 0.0),
                options.get("is_causal", False),
                attn_mask=options.get("attn_mask"),
                scale=options.get("scale"),
            )
            return out
        return func(*args, **kwargs)


@dataclass(frozen=True)
class _Trace:
    forward_flops: int
    backward_flops: int
    saved_bytes: int


def _trace(run: Callable[[], Tensor], module: nn.Module) -> tuple[_Trace, Tensor]:
    """Count FLOPs and saved-tensor bytes of `run()` (forward) and its backward.

    `run` returns the part's output; backward starts from it with a gradient of ones (or
    from the scalar it returns). Returns the trace and the output, detached.
    """
    param_storages = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}  # storage id -> bytes; saved tensors keep their storages alive

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in param_storages:
            saved[storage._cdata] = storage.nbytes()
        return t

    with FlopCounterMode(display=False, custom_mapping=_ATTENTION_FLOPS) as counter:
        with _FusedAttention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        forward = counter.get_total_flops()
        out.backward(None if out.dim() == 0 else torch.ones_like(out))
        total = counter.get_total_flops()
    return _Trace(forward, total - forward, sum(saved.values())), out.detach()


def _tokens_per_sample(x: Tensor) -> int:
    """Positions per sample of a (B, *positions, features) activation: T for (B, T, C)."""
    if x.dim() < 2:
        raise ConfigError(f"a block output of shape {tuple(x.shape)} has no feature dim to count tokens by")
    return math.prod(x.shape[1:-1])


def _record(
    index: int,
    parts: list[tuple[str, nn.Module, _Trace]],
    *,
    tokens: int,
    boundary_bytes_per_token: float,
    dtype_bytes: int,
    optimizer: str,
) -> BlockCostRecord:
    params = [p for _key, module, _trace in parts for p in module.parameters()]
    count = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    states = OPTIMIZER_STATES[optimizer] + (1 if dtype_bytes < 4 else 0)  # + fp32 master weights
    return BlockCostRecord(
        index=index,
        parts=tuple(key for key, _module, _trace in parts),
        forward_flops_per_token=sum(t.forward_flops for *_, t in parts) / tokens,
        backward_flops_per_token=sum(t.backward_flops for *_, t in parts) / tokens,
        param_count=count,
        weight_bytes=dtype_bytes * count,
        grad_bytes=dtype_bytes * trainable,
        optimizer_bytes=4 * states * trainable,
        activation_bytes_per_token=sum(t.saved_bytes for *_, t in parts) / tokens,
        boundary_bytes_per_token=boundary_bytes_per_token,
    )


def _check_microbatch_size(microbatch_size: int) -> None:
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ConfigError(f"microbatch_size must be a positive integer, got {microbatch_size!r}")


def _check_args(microbatch_size: int, dtype_bytes: int, optimizer: str) -> None:
    _check_microbatch_size(microbatch_size)
    if dtype_bytes not in TRACE_DTYPES:
        raise ConfigError(f"dtype_bytes must be 4 (float32) or 2 (bfloat16/float16), got {dtype_bytes!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")


def _meta_model(model_ref: str, model_config: Mapping[str, Any], dtype: torch.dtype) -> SwarmModel:
    model = build_model(model_ref, model_config, device="meta")
    return model.to(dtype)


def _input(model: SwarmModel, microbatch_size: int) -> Tensor:
    return torch.empty((microbatch_size, *model.input_shape), dtype=model.input_dtype, device="meta")


def _leaf(x: Tensor) -> Tensor:
    """`x` as the input a stage receives: detached, and needing its gradient (to send it back)."""
    return x.detach().requires_grad_(x.is_floating_point())


def block_costs(
    model_ref: str,
    model_config: Mapping[str, Any],
    *,
    microbatch_size: int,
    dtype_bytes: int = 4,
    optimizer: str = "adamw",
) -> list[BlockCostRecord]:
    """One record per block of model `model_ref` with options `model_config`, in block order.

    Traced on the meta device for a microbatch of `microbatch_size` samples, in float32
    (`dtype_bytes=4`) or bfloat16 (`dtype_bytes=2`, which also adds fp32 master weights to
    the optimizer state); per-token values divide by microbatch_size x positions per sample
    (seq_len for a (B, T, C) activation). The embedding is folded into block 0's record and
    the head, loss included, into the last block's; a one-block model's record holds all
    three. Raises ConfigError for a model that does not build or bad arguments.
    """
    _check_args(microbatch_size, dtype_bytes, optimizer)
    model = _meta_model(model_ref, model_config, TRACE_DTYPES[dtype_bytes])
    x = _input(model, microbatch_size)
    embed_trace, x = _trace(lambda: model.embed(x), model.embed)
    tokens = microbatch_size * _tokens_per_sample(x)
    traced: list[list[tuple[str, nn.Module, _Trace]]] = []
    boundaries: list[float] = []
    for i, block in enumerate(model.blocks):
        inp = _leaf(x)
        trace, x = _trace(lambda b=block, inp=inp: b(inp), block)
        traced.append([(block_key(i), block, trace)])
        boundaries.append(x.numel() * x.element_size() / tokens)
    inp = _leaf(x)
    loss_inputs = {
        name: torch.empty((microbatch_size, *shape), dtype=dtype, device="meta")
        for name, (shape, dtype) in model.loss_input_specs().items()
    }
    head_trace, _loss = _trace(lambda: model.loss_fn(model.head(inp), loss_inputs), model.head)
    traced[0].insert(0, (EMBED_KEY, model.embed, embed_trace))
    traced[-1].append((HEAD_KEY, model.head, head_trace))
    return [
        _record(
            i,
            parts,
            tokens=tokens,
            boundary_bytes_per_token=boundaries[i],
            dtype_bytes=dtype_bytes,
            optimizer=optimizer,
        )
        for i, parts in enumerate(traced)
    ]


# checking the estimate against a clock


@dataclass(frozen=True, kw_only=True)
class BlockTiming:
    """A measured forward + backward of one block, beside its FLOP-based estimate."""

    seconds: float
    """Median wall time of one forward + backward of the block on one microbatch."""
    flops: float
    """Matmul FLOPs of that forward + backward, as `block_costs` counts them."""
    achieved_flops_per_s: float
    """flops / seconds."""
    estimated_seconds: float | None
    """flops / the given flops_per_s (e.g. the probe's matmul rate); None if none was given."""
    ratio: float | None
    """seconds / estimated_seconds: 1 means the matmul rate predicts the block; > 1 it runs slower."""


def measure_block_seconds(
    model_ref: str,
    model_config: Mapping[str, Any],
    *,
    microbatch_size: int,
    block_index: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    flops_per_s: float | None = None,
    repeats: int = 5,
    warmup: int = 2,
) -> BlockTiming:
    """Time forward + backward of block `block_index` alone on `device` in `dtype`.

    Materialises only that block (initialised as in a run with seed 0), feeds it a random
    input shaped like its real one, and takes the median of `repeats` timed passes after
    `warmup` untimed ones, synchronizing CUDA around each. Give `flops_per_s` (e.g.
    `Capacity.matmul_flops_per_s`) to get the estimate's ratio to reality.
    """
    _check_microbatch_size(microbatch_size)
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    model = build_model(model_ref, model_config, device="meta")
    if not 0 <= block_index < model.num_blocks:
        raise ConfigError(f"block_index {block_index} is not in [0, {model.num_blocks})")
    # The input shape and FLOPs come from a meta run up to the block.
    x = _input(model, microbatch_size)
    with torch.no_grad():
        x = model.embed(x)
        for block in model.blocks[:block_index]:
            x = block(x)
    block = model.blocks[block_index]
    trace, _out = _trace(lambda: block(_leaf(x)), block)
    flops = float(trace.forward_flops + trace.backward_flops)

    materialise_parts([(block_key(block_index), block)], 0, init_weights=model.init_weights)
    block.to(device=device, dtype=dtype)
    inp = torch.randn(x.shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(x.shape, device=device, dtype=dtype)
    is_cuda = torch.device(device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if is_cuda else (lambda: None)

    def step() -> None:
        block.zero_grad(set_to_none=True)
        inp.grad = None
        block(inp).backward(grad)

    times = []
    for i in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    estimated = None if flops_per_s is None else flops / flops_per_s
    return BlockTiming(
        seconds=seconds,
        flops=flops,
        achieved_flops_per_s=flops / seconds,
        estimated_seconds=estimated,
        ratio=None if estimated is None else seconds / estimated,
    )
