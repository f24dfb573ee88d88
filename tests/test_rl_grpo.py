"""The GRPO loss against an independent per-token loop, its clipping on both sides, linearity
over microbatches, its registered variants, the microbatch layout, and the local loop."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model, get_loss
from swarmtrain.rl.generate import SamplingConfig, generate
from swarmtrain.rl.grpo import (
    GRPOConfig,
    group_advantages,
    grpo_config,
    grpo_loss_fn,
    grpo_microbatch,
    register_grpo_loss,
    token_logprobs,
)
from swarmtrain.rl.local import LocalConfig, grpo_step, main, run_local, warmup
from swarmtrain.rl.registry import build_task
from tests.conftest import TINY_GPT

EPS, CAP = 0.2, 3.0


def reference_loss(logits, inputs, cfg: GRPOConfig) -> float:
    """The loss written out token by token in plain Python floats."""
    B, T, V = logits.shape
    total = 0.0
    for b in range(B):
        for t in range(T):
            m = float(inputs["mask"][b, t])
            if m == 0:
                continue
            z = [float(v) / cfg.temperature for v in logits[b, t]]
            lse = math.log(sum(math.exp(v) for v in z))
            logp = z[int(inputs["targets"][b, t])] - lse
            A = float(inputs["advantages"][b, t])
            c = min(math.exp(logp - float(inputs["behaviour_logprobs"][b, t])), cfg.ratio_cap)
            clipped = min(max(c, 1 - cfg.clip_eps), 1 + cfg.clip_eps)
            loss = max(-c * A, -clipped * A)
            if cfg.kl_coef:
                d = float(inputs["ref_logprobs"][b, t]) - logp
                loss += cfg.kl_coef * (math.exp(d) - d - 1)
            if cfg.entropy_coef:
                loss -= cfg.entropy_coef * -sum(math.exp(v - lse) * (v - lse) for v in z)
            total += m * loss
    return total / (B * T)


def case(ratios, advantages, *, temperature=1.0, seed=0):
    """Random logits (1, T, 5) and inputs whose behaviour log-probs give exactly `ratios`."""
    T = len(ratios)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, T, 5, generator=gen, dtype=torch.float64).float()
    targets = torch.randint(0, 5, (1, T), generator=gen)
    logp = token_logprobs(logits, targets, temperature)
    inputs = {
        "targets": targets,
        "behaviour_logprobs": logp - torch.tensor(ratios).log()[None],
        "advantages": torch.tensor(advantages)[None],
        "mask": torch.ones(1, T),
    }
    return logits, inputs


def test_a_hand_computed_case():
    # uniform logits: logp = -ln 4; behaviour -ln 8 -> ratio 2, clipped to 1.2 for A = 1
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    inputs = {
        "targets": torch.tensor([[1, 2]]),
        "behaviour_logprobs": torch.full((1, 2), -math.log(8.0)),
        "advantages": torch.tensor([[1.0, 0.0]]),
        "mask": torch.tensor([[1.0, 0.0]]),
    }
    loss = grpo_loss_fn(GRPOConfig())(logits, inputs)
    assert loss.item() == pytest.approx(-1.2 / 2)  # one token's -1.2 over B * T = 2 positions
    loss.backward()
    assert logits.grad.abs().max() == 0  # clipped: no gradient


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_matches_the_per_token_loop_on_both_sides_of_the_clip(temperature):
    # A > 0: ratio above 1+eps (clipped), inside, below 1-eps (unclipped)
    # A < 0: below 1-eps (clipped), inside, between 1+eps and the cap (unclipped), above the cap
    ratios = [1.5, 1.05, 0.5, 0.5, 0.95, 2.0, 5.0]
    advantages = [1.0, 0.7, 1.3, -1.0, -0.4, -1.5, -2.0]
    cfg = GRPOConfig(clip_eps=EPS, ratio_cap=CAP, temperature=temperature)
    logits, inputs = case(ratios, advantages, temperature=temperature)
    logits.requires_grad_(True)
    loss = grpo_loss_fn(cfg)(logits, inputs)
    assert loss.item() == pytest.approx(reference_loss(logits.detach(), inputs, cfg), rel=1e-5)
    loss.backward()
    has_grad = (logits.grad[0].abs().sum(-1) > 0).tolist()  # per position
    assert has_grad == [False, True, True, False, True, True, False]


def test_the_cap_bounds_negative_advantages():
    cfg = GRPOConfig(clip_eps=EPS, ratio_cap=CAP)
    big, huge = (grpo_loss_fn(cfg)(*case([r], [-1.0])) for r in (10.0, 1000.0))
    assert big.item() == pytest.approx(huge.item()) == pytest.approx(CAP)  # -min(r, cap) * A over T = 1
    plain_ppo = GRPOConfig(clip_eps=EPS, ratio_cap=1e9)
    assert grpo_loss_fn(plain_ppo)(*case([1000.0], [-1.0])).item() == pytest.approx(1000.0, rel=1e-4)


def test_kl_and_entropy_terms_match_the_loop():
    cfg = GRPOConfig(clip_eps=EPS, ratio_cap=CAP, kl_coef=0.1, entropy_coef=0.05, temperature=0.8)
    logits, inputs = case([1.1, 0.7, 3.5], [0.5, -1.0, -0.3], temperature=0.8)
    inputs["ref_logprobs"] = inputs["behaviour_logprobs"] - 0.3
    inputs["mask"] = torch.tensor([[1.0, 0.5, 1.0]])
    assert grpo_loss_fn(cfg)(logits, inputs).item() == pytest.approx(
        reference_loss(logits, inputs, cfg), rel=1e-5
    )


def test_zero_advantages_give_zero_policy_gradient():
    logits, inputs = case([0.3, 1.0, 1.1, 7.0], [0.0, 0.0, 0.0, 0.0])
    logits.requires_grad_(True)
    loss = grpo_loss_fn(GRPOConfig())(logits, inputs)
    loss.backward()
    assert loss.item() == 0 and logits.grad.abs().max() == 0


def test_the_loss_is_linear_over_microbatches():
    gen = torch.Generator().manual_seed(3)
    B, T, V = 6, 5, 7
    logits = torch.randn(B, T, V, generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.4).float()  # completions of different lengths
    inputs = {
        "targets": targets,
        "behaviour_logprobs": token_logprobs(logits, targets, 1.0) + 0.3 * torch.randn(B, T, generator=gen),
        "advantages": torch.randn(B, 1, generator=gen).expand(B, T) * mask,
        "mask": mask,
    }
    fn = get_loss("grpo")

    def loss_and_grad(rows):
        x = logits[rows].clone().requires_grad_(True)
        loss = fn(x, {k: v[rows] for k, v in inputs.items()})
        loss.backward()
        return loss.detach(), x.grad

    whole, g_whole = loss_and_grad(slice(0, B))
    first, g_first = loss_and_grad(slice(0, 3))
    second, g_second = loss_and_grad(slice(3, B))
    # the swarm backpropagates loss / microbatches for each microbatch and sums
    assert torch.isclose(whole, (first + second) / 2, atol=1e-7)
    assert torch.allclose(g_whole, torch.cat((g_first, g_second)) / 2, atol=1e-7)


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(rewards, 4)
    std = math.sqrt(0.25 * 0.75)
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0, 0, 0, 0]
    assert a.tolist() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(rewards, 3)


def test_registered_variants_and_their_inputs():
    out = ((16, 256), torch.float32)
    per_token = ((16,), torch.float32)
    assert get_loss("grpo").input_specs(out) == {
        "targets": ((16,), torch.int64),
        "behaviour_logprobs": per_token,
        "advantages": per_token,
        "mask": per_token,
    }
    assert set(get_loss("grpo_kl").input_specs(out)) == {
        "targets", "behaviour_logprobs", "advantages", "mask", "ref_logprobs",
    }  # fmt: skip
    assert grpo_config("grpo").temperature == 1.0 and grpo_config("grpo_kl").kl_coef > 0
    _, inputs = case([1.0], [1.0])
    with pytest.raises(ValueError, match="missing loss input 'ref_logprobs'"):
        get_loss("grpo_kl")(torch.zeros(1, 1, 5), inputs)
    register_grpo_loss("grpo-t0.5-test", GRPOConfig(temperature=0.5))
    register_grpo_loss("grpo-t0.5-test", GRPOConfig(temperature=0.5))  # the same again: fine
    with pytest.raises(ConfigError, match="already registered"):
        register_grpo_loss("grpo-t0.5-test", GRPOConfig(temperature=0.6))
    with pytest.raises(ConfigError, match="ratio_cap must exceed 1 \\+ clip_eps = 1.2"):
        GRPOConfig(ratio_cap=1.1)
    with pytest.raises(ConfigError, match="'cross_entropy' is not a GRPO loss"):
        grpo_config("cross_entropy")


def test_microbatch_layout_and_ratio_one_at_the_sampling_policy():
    model = build_model("tiny-gpt", TINY_GPT)
    model.materialise(0)
    cfg = SamplingConfig(samples_per_prompt=2, temperature=0.7, max_new_tokens=5)
    prompts = [[49, 43, 50, 61], [55, 61]]
    trajectories = generate(model, prompts, cfg, stop_id=10, generator=torch.Generator().manual_seed(0))
    x, inputs = grpo_microbatch(trajectories, [0.5, -0.5, 1.0, -1.0], seq_len=16, temperature=0.7)
    for b, t in enumerate(trajectories):
        P, C = len(t.prompt_ids), len(t.completion_ids)
        seq = [*t.prompt_ids, *t.completion_ids]
        assert (
            x[b, : P + C - 1].tolist() == seq[:-1] and inputs["targets"][b, : P + C - 1].tolist() == seq[1:]
        )
        assert inputs["mask"][b].nonzero()[:, 0].tolist() == list(range(P - 1, P - 1 + C))
        assert inputs["advantages"][b].sum().item() == pytest.approx([0.5, -0.5, 1.0, -1.0][b] * C)
    with torch.no_grad():
        logp = token_logprobs(model(x), inputs["targets"], 0.7)  # the trainer's recomputation
    m = inputs["mask"].bool()
    assert torch.allclose(logp[m], inputs["behaviour_logprobs"][m], atol=1e-5)  # ratio 1
    with pytest.raises(
        ConfigError, match="sampled at temperature 0.7 cannot train a GRPO loss at temperature 1.0"
    ):
        grpo_microbatch(trajectories, [0.0] * 4, seq_len=16, temperature=1.0)


def test_grpo_steps_change_the_weights_from_rewards_the_task_computes():
    task = build_task("add", {"digits": 1})
    cfg = LocalConfig(
        model=TINY_GPT,
        warmup_steps=60,
        warmup_target=1.0,
        warmup_batch_size=32,
        warmup_lr=3e-3,
        prompts_per_step=8,
        samples_per_prompt=4,
    )
    model = build_model("tiny-gpt", TINY_GPT)
    model.materialise(0)
    rng = random.Random(0)
    warmup(model, task, cfg, rng)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no decay, no momentum: moves only with a gradient
    gen = torch.Generator().manual_seed(0)
    results = [grpo_step(model, opt, task, cfg, rng, gen, step) for step in range(3)]
    rewards = [r for r, _ in results]
    assert all(math.isfinite(loss) for _, loss in results)
    assert 0 < sum(rewards) / 3 < 1  # some right, some wrong: the advantages are not all zero
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_run_local_and_its_json(capsys):
    cfg = LocalConfig(
        model=TINY_GPT,
        warmup_steps=5,
        grpo_steps=2,
        prompts_per_step=2,
        samples_per_prompt=2,
        eval_prompts=10,
    )
    result = run_local(cfg)
    assert 0 <= result.warmup_accuracy <= 1 and 0 <= result.final_accuracy <= 1
    assert len(result.losses) == 2 and all(math.isfinite(v) for v in result.losses)
    main(
        [
            "--json",
            "--model",
            json.dumps(TINY_GPT),
            "--warmup-steps",
            "2",
            "--grpo-steps",
            "1",
            "--eval-prompts",
            "5",
        ]
    )
    printed = json.loads(capsys.readouterr().out)
    assert {"warmup_accuracy", "final_accuracy", "seconds"} <= set(printed)
    assert printed["config"]["grpo_steps"] == 1
