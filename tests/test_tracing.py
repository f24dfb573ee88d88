"""Tracing a model's per-block costs, against hand-derived formulas for tiny-gpt.

Per token, with width d, sequence length T, H heads and vocabulary V, a tiny-gpt block's
matmuls are: c_attn 3d^2, c_proj d^2, c_fc 4d^2 and the MLP's c_proj 4d^2 multiply-adds
(12 d^2, so 24 d^2 FLOPs), plus attention's Q K^T and A V, T d multiply-adds each (4 T d
FLOPs; the count is of the full T x T product, causal or not). Biases, norms, GELU and
softmax count nothing. So forward = 24 d^2 + 4 T d. Backward computes the gradients of
inputs and weights of every matmul (twice the forward) and, as a fused attention kernel
does, recomputes Q K^T once more: backward = 48 d^2 + 10 T d.
"""

import dataclasses
import math

import pytest

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.model.tracing import block_costs, measure_block_seconds

CONFIG = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32}
D, T, H, V = 64, 32, 4, 256
MICROBATCH = 2


@pytest.fixture(scope="module")
def records():
    return block_costs("tiny-gpt", CONFIG, microbatch_size=MICROBATCH)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-gpt", CONFIG)


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_block_flops_match_the_analytic_formula(records):
    forward = 24 * D * D + 4 * T * D
    backward = 48 * D * D + 10 * T * D
    for r in records[1:-1]:
        assert r.forward_flops_per_token == pytest.approx(forward, rel=0.01)
        assert r.backward_flops_per_token == pytest.approx(backward, rel=0.01)
        assert r.flops_per_token == pytest.approx(72 * D * D + 14 * T * D, rel=0.01)
        assert r.backward_flops_per_token / r.forward_flops_per_token == pytest.approx(2, rel=0.1)


def test_embedding_is_folded_into_block_0_and_the_head_into_the_last(records, model):
    first, middle, last = records[0], records[1], records[-1]
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert (
        first.parts == ("embed", "block.0")
        and middle.parts == ("block.1",)
        and last.parts == ("block.3", "head")
    )
    # a lookup costs no matmul FLOPs; the head's projection d x V does
    assert first.flops_per_token == middle.flops_per_token
    assert last.forward_flops_per_token - middle.forward_flops_per_token == pytest.approx(2 * D * V)
    assert last.backward_flops_per_token - middle.backward_flops_per_token == pytest.approx(4 * D * V)
    assert first.param_count == numel(model.embed) + numel(model.blocks[0])
    assert last.param_count == numel(model.blocks[3]) + numel(model.head)
    # the head keeps its logits (or their softmax) for the loss's backward: V floats per token at least
    assert last.activation_bytes_per_token >= middle.activation_bytes_per_token + 4 * V


def test_state_bytes(records, model):
    block = numel(model.blocks[1])
    assert block == 12 * D * D + 13 * D  # weights, biases and two LayerNorms
    r = records[1]
    assert r.param_count == block
    assert r.weight_bytes == 4 * block and r.grad_bytes == 4 * block
    assert r.optimizer_bytes == 8 * block  # AdamW: two fp32 moments
    assert r.state_bytes == 16 * block
    sgd = block_costs("tiny-gpt", CONFIG, microbatch_size=1, optimizer="sgd")[1]
    assert sgd.optimizer_bytes == 4 * block  # one momentum buffer
    bf16 = block_costs("tiny-gpt", CONFIG, microbatch_size=1, dtype_bytes=2)[1]
    assert bf16.weight_bytes == 2 * block and bf16.grad_bytes == 2 * block
    assert bf16.optimizer_bytes == 12 * block  # + fp32 master weights
    assert bf16.boundary_bytes_per_token == 2 * D


def test_boundary_bytes_are_the_block_output(records):
    assert [r.boundary_bytes_per_token for r in records] == [4 * D] * 4


def test_activation_bytes(records):
    # Kept per token (floats): the block input and its LayerNorm stats (d + 2), the LN output
    # for c_attn (d), q, k, v in one buffer (3d), attention's output, which c_proj reads (d),
    # its logsumexp (H), the residual and stats (d + 2), the LN output (d), the MLP's c_fc
    # output and GELU output (4d + 4d): 16 d + H + 4 floats.
    expected = 4 * (16 * D + H + 4)
    for r in records[1:-1]:
        assert r.activation_bytes_per_token == pytest.approx(expected, rel=0.1)
    # what a microbatch keeps grows with the sequence; the fused attention keeps no T x T scores
    per_sample = []
    for seq_len in (32, 64, 128):
        r = block_costs("tiny-gpt", {**CONFIG, "seq_len": seq_len}, microbatch_size=MICROBATCH)[1]
        per_sample.append(r.activation_bytes_per_token * seq_len)
    assert per_sample[0] < per_sample[1] < per_sample[2]
    assert per_sample[2] / per_sample[0] == pytest.approx(4, rel=0.05)


def test_per_token_costs_do_not_depend_on_the_microbatch_size(records):
    bigger = block_costs("tiny-gpt", CONFIG, microbatch_size=3)
    for a, b in zip(records, bigger, strict=True):
        # the embedding keeps its position ids once per microbatch, not per sample
        assert a.activation_bytes_per_token == pytest.approx(b.activation_bytes_per_token, rel=0.01)
        assert dataclasses.replace(a, activation_bytes_per_token=0) == dataclasses.replace(
            b, activation_bytes_per_token=0
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"microbatch_size": 0}, "microbatch_size must be a positive integer"),
        ({"microbatch_size": 1, "dtype_bytes": 8}, "dtype_bytes must be 4"),
        ({"microbatch_size": 1, "optimizer": "lion"}, "optimizer must be one of adamw, sgd"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        block_costs("tiny-gpt", CONFIG, **kwargs)


def test_measured_block_time_against_the_estimate(records):
    timing = measure_block_seconds(
        "tiny-gpt", CONFIG, microbatch_size=MICROBATCH, block_index=1, flops_per_s=1e9, repeats=3, warmup=1
    )
    assert timing.flops == pytest.approx(records[1].flops_per_token * MICROBATCH * T)
    assert timing.seconds > 0 and math.isfinite(timing.achieved_flops_per_s)
    assert timing.estimated_seconds == pytest.approx(timing.flops / 1e9)
    assert timing.ratio == pytest.approx(timing.seconds / timing.estimated_seconds)
    untimed = measure_block_seconds("tiny-gpt", CONFIG, microbatch_size=1, repeats=1, warmup=0)
    assert untimed.estimated_seconds is None and untimed.ratio is None
    with pytest.raises(ConfigError, match=r"block_index 4 is not in \[0, 4\)"):
        measure_block_seconds("tiny-gpt", CONFIG, microbatch_size=1, block_index=4)
