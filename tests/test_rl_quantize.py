"""Quantized rollout copies (bitsandbytes 8-bit and 4-bit, on the CPU here): the weights shrink,
the logits stay close to full precision, a new policy version loads quantized, a quantized
worker answers requests, and the swap an update costs stays far under a second."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.rl.quantize import check_mode, load_policy, parameter_bytes, quantize_model, quantized_layers
from swarmtrain.rl.registry import build_task
from swarmtrain.rl.worker import RolloutWorker
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.rollout_messages import RolloutRequest, decode_reply, encode_prompts

MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 16}
TASK = build_task("add")
TOKENS = torch.tensor([TASK.tokenizer.encode("12+34=46\n1+2=3\n")[:16]] * 2)


def policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("tiny-gpt", MODEL, device="cpu")


def logprobs(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(tokens).float(), dim=-1)


# bytes each Linear weight element takes (int8, or two NF4 values a byte) and the largest
# per-token log-prob error on the demo model's shape
LIMITS = {"8bit": (1.0, 0.05), "4bit": (0.5, 0.5)}


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_a_quantized_copy_is_smaller_and_close_to_full_precision(mode):
    full = policy(0)
    quant = quantize_model(policy(0), mode)
    linears = [m for m in full.modules() if isinstance(m, torch.nn.Linear)]
    assert len(quantized_layers(quant)) == len(linears) > 0
    linear_elements = sum(m.weight.numel() for m in linears)
    per_element, max_error = LIMITS[mode]
    saved = parameter_bytes(full) - parameter_bytes(quant)
    # fp32 -> int8 saves 3 bytes an element, -> NF4 3.5 (less the small absmax blocks)
    assert saved >= linear_elements * (4 - per_element) * 0.95
    error = (logprobs(quant) - logprobs(full)).abs().max().item()
    assert 0 < error < max_error
    assert not any(p.requires_grad for p in quant.parameters())


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_a_new_version_loads_into_a_quantized_copy(mode):
    quant = quantize_model(policy(0), mode)
    new = policy(1)
    before = (logprobs(quant) - logprobs(new)).abs().max().item()
    load_policy(quant, new.state_dict(), mode)
    after = (logprobs(quant) - logprobs(new)).abs().max().item()
    assert after < LIMITS[mode][1] < before
    assert len(quantized_layers(quant)) > 0  # still quantized


def test_a_policy_weight_of_the_wrong_shape_is_refused():
    quant = quantize_model(policy(0), "8bit")
    name = next(iter(quantized_layers(quant)))
    with pytest.raises(ConfigError, match=rf"policy weight '{name}.weight' has shape \(3, 3\)"):
        load_policy(quant, {f"{name}.weight": torch.zeros(3, 3)}, "8bit")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="--quantize takes 8bit or 4bit, got '2bit'"):
        check_mode("2bit")


def test_a_quantized_worker_samples_and_swaps_versions_quickly():
    worker = RolloutWorker(
        run_id="rl",
        model=quantize_model(policy(0), "8bit"),
        spare=quantize_model(policy(0), "8bit"),
        task=TASK,
        temperature=1.0,
        authorized=lambda peer: True,
        quantize="8bit",
    )
    meta = RolloutRequest(samples_per_prompt=4, max_new_tokens=TASK.max_new_tokens, seed=3).to_meta()
    frame = Frame(
        kind="rollout",
        run_id="rl",
        tensors=encode_prompts([TASK.tokenizer.encode(p) for p in ("12+34=", "7+8=")]),
        meta=meta,
    )
    for version in (1, 2, 3):
        worker.install(policy(version).state_dict(), version)
        reply = asyncio.run(worker.handle(frame, "trainer"))
        got = decode_reply(
            reply.meta,
            reply.tensors,
            rows=8,
            max_new_tokens=TASK.max_new_tokens,
            vocab_size=TASK.tokenizer.vocab_size,
            newest_version=version,
        )
        assert got.version == version
        assert all(all(lp <= 0 for lp in row) for row in got.logprobs)
    assert worker.stats.versions_taken == 3
    assert worker.stats.longest_pause_s < 1.0  # the swap itself; loading is off the sampling path


def test_slowdown_stretches_sampling(monkeypatch):
    import time

    import swarmtrain.rl.worker as worker_module

    spent = []

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        out = worker_module_generate(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return out

    worker_module_generate = worker_module.generate
    monkeypatch.setattr(worker_module, "generate", timed_generate)
    worker = RolloutWorker(
        run_id="rl",
        model=policy(0),
        spare=policy(0),
        task=TASK,
        temperature=1.0,
        authorized=lambda peer: True,
        slowdown=lambda: 5.0,
    )
    meta = RolloutRequest(samples_per_prompt=4, max_new_tokens=TASK.max_new_tokens, seed=3).to_meta()
    frame = Frame(
        kind="rollout", run_id="rl", tensors=encode_prompts([TASK.tokenizer.encode("12+34=")]), meta=meta
    )
    t0 = time.perf_counter()
    asyncio.run(worker.handle(frame, "t"))
    wall = time.perf_counter() - t0
    # sampling took 5x as long as the model's work, and the peer's rate says so
    assert len(spent) == 1 and worker.stats.samples == 4
    assert worker.stats.sample_seconds >= 5 * spent[0]
    assert wall >= 4.9 * spent[0]
