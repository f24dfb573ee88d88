"""The planner's cost model (pure, analytic): what a block costs, what a peer offers, and
what a stage replica achieves. The figures for a real model come from tracing it
(`swarmtrain.model.tracing`).

A stage is a contiguous span of blocks [i, j). For one replica of it on peer p:

    flops/token    F(i, j) = sum of the blocks' flops_per_token (forward + backward)
    memory         M(i, j) = sum of (weight_bytes + grad_bytes + optimizer_bytes)
                             + sum of activation_bytes_per_token * tokens_in_flight
    traffic/token  B(i, j) = 2 * (boundary bytes of block i-1, unless i == 0
                                  + boundary bytes of block j-1, unless j == num_blocks)
    token rate     r(p, i, j) = min(flops_per_s / F, bandwidth_bytes_per_s / B)

The factor 2 in B: a replica receives its input activation and sends its output activation
forward, then receives the output gradient and sends the input gradient backward, and the
gradients are as large as the activations. `bandwidth_bytes_per_s` is the peer's total
(both directions) rate. The first stage's input (token ids) and the last stage's output (a
loss) are negligible. A pipeline runs at the rate of its slowest stage.

A stage with R replicas of summed rate r_sum averages its gradients at every optimizer step
(an all-reduce among the replicas), so with `tokens_per_step` tokens per step:

    gradient bytes G(i, j) = sum of grad_bytes
    averaging      A = 0 if R == 1, else averaging_overhead_s + 2 G (R - 1) / R / bw_min
    step time      T = tokens_per_step / r_sum + A
    stage rate       = tokens_per_step / T = r_sum / (1 + r_sum A / tokens_per_step)

where bw_min is the smallest `bandwidth_bytes_per_s` among the replicas (a ring all-reduce
runs at its slowest link's pace). With `tokens_per_step` None the averaging is ignored and
a stage runs at r_sum. Not modelled: latency (hidden by keeping `tokens_in_flight` tokens in
the pipeline), averaging overlapping with compute, and averaging traffic competing with
activation traffic for a peer's bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarmtrain.errors import ConfigError


def _check_number(owner: str, name: str, value, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{owner}: {name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{owner}: {name} must be {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """What one model block costs a stage that hosts it, per replica."""

    flops_per_token: float
    """Forward + backward FLOPs the block spends per token."""
    weight_bytes: float
    """Bytes of the block's weights alone."""
    grad_bytes: float
    """Bytes of the block's gradients: what its replicas average at every optimizer step."""
    optimizer_bytes: float
    """Bytes of the block's optimizer state (e.g. fp32 master weights and Adam moments)."""
    activation_bytes_per_token: float
    """Bytes the block keeps per in-flight token until that token's backward pass."""
    boundary_bytes_per_token: float
    """Bytes of the block's output activation per token as sent on the wire (after compression)."""

    def __post_init__(self):
        _check_number("BlockCost", "flops_per_token", self.flops_per_token, positive=True)
        for name in (
            "weight_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "activation_bytes_per_token",
            "boundary_bytes_per_token",
        ):
            _check_number("BlockCost", name, getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class PeerCapacity:
    """What a peer measured about itself (the capacity probe of `--gpu auto`)."""

    peer_id: str
    """The peer's id in the swarm; plans are keyed and tie-broken by it."""
    flops_per_s: float
    """Measured matmul throughput in the run's dtype (achieved, not the datasheet peak)."""
    memory_bytes: float
    """Accelerator (or host, for a CPU-only peer) memory the run may use."""
    bandwidth_bytes_per_s: float
    """Measured bandwidth to the swarm, both directions together."""
    is_spot: bool = False
    """May be preempted at any time; a stage held by few replicas prefers a non-spot peer."""
    rtt_s: float = 0.0
    """Typical round-trip time to other peers; informational, the throughput model ignores it."""
    decode_tokens_per_s: float = 0.0
    """RL runs: tokens per second the peer decodes when it samples the run's policy (G completions
    of a few prompts at once, KV-cached), as its probe measured; 0 when it cannot sample (not
    measured, or two copies of the policy do not fit its memory). Sampling is memory-bandwidth
    bound, so this does not follow `flops_per_s` (`swarmtrain.plan.rl`)."""

    def __post_init__(self):
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise ConfigError(f"PeerCapacity: peer_id must be a non-empty string, got {self.peer_id!r}")
        owner = f"PeerCapacity({self.peer_id})"
        _check_number(owner, "flops_per_s", self.flops_per_s, positive=True)
        _check_number(owner, "memory_bytes", self.memory_bytes)
        _check_number(owner, "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True)
        _check_number(owner, "rtt_s", self.rtt_s)
        _check_number(owner, "decode_tokens_per_s", self.decode_tokens_per_s)


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How the planner models the run and how hard it searches."""

    tokens_in_flight: int
    """Tokens whose activations a stage holds at once: microbatch tokens x in-flight microbatches."""
    max_stages: int | None = None
    """Most pipeline stages a plan may have; None: as many as there are blocks (and peers)."""
    min_stages: int = 1
    """Fewest pipeline stages a plan may have (while there are that many blocks and peers; with
    fewer, as many as there are). `min_stages == max_stages` fixes the count: the run's first
    layout keeps the stages its coordinator was given and plans where they cut."""
    memory_headroom: float = 0.1
    """Fraction of each peer's memory kept free (allocator slack, temporary buffers)."""
    max_rounds: int = 6
    """Most alternations of (re-cut boundaries, re-assign peers) per starting point."""
    refine_top: int = 8
    """First-pass candidates (over all stage counts and starting cuts) refined to convergence."""
    exhaustive_limit: int = 20_000
    """Largest (cuts x assignments) per stage count searched exhaustively (exact); 0: never."""
    tokens_per_step: int | None = None
    """Tokens of one optimizer step across the swarm (microbatch tokens x microbatches per
    step), over which a stage's replicas average their gradients once. None: ignore the
    averaging, so a stage runs at the sum of its replicas' rates."""
    averaging_overhead_s: float = 0.75
    """Fixed seconds per step of averaging among two or more replicas (matchmaking, latency;
    ~0.5-1.0 s measured with hivemind's DecentralizedAverager on loopback). Used only with
    `tokens_per_step`."""

    def __post_init__(self):
        if isinstance(self.tokens_in_flight, bool) or not isinstance(self.tokens_in_flight, int):
            raise ConfigError(
                f"PlanConfig: tokens_in_flight must be an integer, got {self.tokens_in_flight!r}"
            )
        if self.tokens_in_flight < 1:
            raise ConfigError(f"PlanConfig: tokens_in_flight must be >= 1, got {self.tokens_in_flight}")
        if self.max_stages is not None and (not isinstance(self.max_stages, int) or self.max_stages < 1):
            raise ConfigError(
                f"PlanConfig: max_stages must be None or an integer >= 1, got {self.max_stages!r}"
            )
        if isinstance(self.min_stages, bool) or not isinstance(self.min_stages, int) or self.min_stages < 1:
            raise ConfigError(f"PlanConfig: min_stages must be an integer >= 1, got {self.min_stages!r}")
        if self.max_stages is not None and self.min_stages > self.max_stages:
            raise ConfigError(
                f"PlanConfig: min_stages ({self.min_stages}) must not exceed max_stages ({self.max_stages})"
            )
        _check_number("PlanConfig", "memory_headroom", self.memory_headroom)
        if self.memory_headroom >= 1:
            raise ConfigError(f"PlanConfig: memory_headroom must be in [0, 1), got {self.memory_headroom}")
        for name, least in (("max_rounds", 1), ("refine_top", 1), ("exhaustive_limit", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"PlanConfig: {name} must be an integer >= {least}, got {value!r}")
        if self.tokens_per_step is not None and (
            isinstance(self.tokens_per_step, bool)
            or not isinstance(self.tokens_per_step, int)
            or self.tokens_per_step < 1
        ):
            raise ConfigError(
                f"PlanConfig: tokens_per_step must be None or an integer >= 1, got {self.tokens_per_step!r}"
            )
        _check_number("PlanConfig", "averaging_overhead_s", self.averaging_overhead_s)


def usable_memory(peer: PeerCapacity, config: PlanConfig) -> float:
    """Bytes of `peer`'s memory a plan may fill: memory_bytes * (1 - memory_headroom)."""
    return peer.memory_bytes * (1.0 - config.memory_headroom)


class CostModel:
    """Stage costs of one model under one config, from prefix sums over its blocks.

    Every method takes a span [start, stop) with 0 <= start < stop <= num_blocks.
    """

    def __init__(self, costs: list[BlockCost] | tuple[BlockCost, ...], config: PlanConfig):
        if not costs:
            raise ConfigError("the planner needs the cost of at least one block, got none")
        self.num_blocks = len(costs)
        self.tokens_in_flight = config.tokens_in_flight
        self.tokens_per_step = config.tokens_per_step
        self.averaging_overhead_s = float(config.averaging_overhead_s)
        self.flops = [0.0]
        self.memory = [0.0]
        self.grad = [0.0]
        for c in costs:
            self.flops.append(self.flops[-1] + c.flops_per_token)
            self.grad.append(self.grad[-1] + c.grad_bytes)
            state = c.weight_bytes + c.grad_bytes + c.optimizer_bytes
            self.memory.append(
                self.memory[-1] + state + c.activation_bytes_per_token * config.tokens_in_flight
            )
        self.boundary = [c.boundary_bytes_per_token for c in costs]

    def stage_flops(self, start: int, stop: int) -> float:
        """Forward + backward FLOPs per token of one replica of blocks [start, stop)."""
        return self.flops[stop] - self.flops[start]

    def stage_memory(self, start: int, stop: int) -> float:
        """Bytes one replica of blocks [start, stop) needs: state plus in-flight activations."""
        return self.memory[stop] - self.memory[start]

    def stage_traffic(self, start: int, stop: int) -> float:
        """Bytes a replica of blocks [start, stop) moves per token, both boundaries, both passes."""
        inbound = self.boundary[start - 1] if start > 0 else 0.0
        outbound = self.boundary[stop - 1] if stop < self.num_blocks else 0.0
        return 2.0 * (inbound + outbound)

    def stage_grad_bytes(self, start: int, stop: int) -> float:
        """Gradient bytes a replica of blocks [start, stop) averages: the sum of their grad_bytes."""
        return self.grad[stop] - self.grad[start]

    def replica_rate(self, peer: PeerCapacity, start: int, stop: int) -> float:
        """Tokens/s one replica on `peer` sustains: min(compute rate, network rate)."""
        compute = peer.flops_per_s / self.stage_flops(start, stop)
        traffic = self.stage_traffic(start, stop)
        return compute if traffic == 0 else min(compute, peer.bandwidth_bytes_per_s / traffic)

    @property
    def averages(self) -> bool:
        """Whether the model charges replicas for averaging (a `tokens_per_step` is set)."""
        return self.tokens_per_step is not None

    def averaging_s(self, start: int, stop: int, replicas: int, min_bandwidth: float) -> float:
        """Seconds per optimizer step that `replicas` replicas of [start, stop) spend averaging
        gradients: 0 for one replica (or without `tokens_per_step`), else the fixed overhead
        plus 2 G (R - 1) / R over the slowest replica's bandwidth."""
        if self.tokens_per_step is None or replicas < 2:
            return 0.0
        grad = self.stage_grad_bytes(start, stop)
        return self.averaging_overhead_s + 2.0 * grad * (replicas - 1) / replicas / min_bandwidth

    def stage_rate(
        self, rate_sum: float, replicas: int, min_bandwidth: float, start: int, stop: int
    ) -> float:
        """Tokens/s of a stage over [start, stop) whose `replicas` replicas sum to `rate_sum`
        tokens/s and whose slowest link is `min_bandwidth`: r_sum / (1 + r_sum A / tokens_per_step),
        i.e. tokens_per_step over (compute time + averaging time A) of one step."""
        if replicas == 0:
            return 0.0
        averaging = self.averaging_s(start, stop, replicas, min_bandwidth)
        if averaging == 0:
            return rate_sum
        return rate_sum / (1.0 + rate_sum * averaging / self.tokens_per_step)


def transformer_block_cost(
    *,
    d_model: int,
    seq_len: int,
    bytes_per_param: float = 2.0,
    optimizer_bytes_per_param: float = 12.0,
    activation_bytes_per_token: float | None = None,
    wire_bytes_per_element: float = 1.0,
) -> BlockCost:
    """Cost of one GPT block (pre-LN attention + 4x MLP) from the usual formulas.

    - parameters: 12 d^2 (4 d^2 attention projections, 8 d^2 MLP; biases and norms ignored)
    - FLOPs/token, forward + backward: 3 x (2 x 12 d^2 + 2 T d) = 72 d^2 + 6 T d
      (Kaplan et al. 2020: forward 2N + 2 n_ctx d per layer; backward twice the forward)
    - weight_bytes, grad_bytes: `bytes_per_param` each per parameter (2 for bf16)
    - optimizer_bytes: `optimizer_bytes_per_param` (12: fp32 master weights + Adam m, v)
    - activations kept for backward: 34 d bytes/token by default (Korthikanti et al. 2022,
      16-bit, flash attention so no T x T scores stored, no recomputation)
    - boundary: d elements per token at `wire_bytes_per_element` (1: 8-bit activations)
    """
    params = 12.0 * d_model * d_model
    return BlockCost(
        flops_per_token=72.0 * d_model * d_model + 6.0 * seq_len * d_model,
        weight_bytes=bytes_per_param * params,
        grad_bytes=bytes_per_param * params,
        optimizer_bytes=optimizer_bytes_per_param * params,
        activation_bytes_per_token=34.0 * d_model
        if activation_bytes_per_token is None
        else activation_bytes_per_token,
        boundary_bytes_per_token=wire_bytes_per_element * d_model,
    )
