"""KV-cached decoding and sampling: cached logits equal the uncached training forward's (tiny-gpt
and Hugging Face GPT-2, Llama, Qwen2 with left-padded prompts of different lengths), behaviour
log-probs are the temperature-scaled policy's, and rewards come from the text."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.rl.decoding import decoder_for, hf_model_of
from swarmtrain.rl.generate import SamplingConfig, Trajectory, generate, rollout, score
from swarmtrain.rl.registry import build_task
from swarmtrain.rl.tasks import PAD_ID
from tests.conftest import TINY_GPT

PROMPT_LENGTHS = (3, 6, 4)
STEPS = 5


def tiny_gpt(seed: int = 0):
    model = build_model("tiny-gpt", TINY_GPT)
    model.materialise(seed)
    return model


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import CONFIGS

    root = tmp_path_factory.mktemp("hf")
    folders = {}
    for i, name in enumerate(("gpt2-tied", "llama", "qwen2")):
        torch.manual_seed(i)
        transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


def hf_model(folder):
    return build_model("hf-causal-lm", {"path": folder, "seq_len": 16}, device="cpu")


def max_cached_error(model) -> float:
    """Largest |cached - full forward| logit over left-padded prompts and teacher-forced steps."""
    V = model.head.lm_head.out_features
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, V, (n,), generator=gen) for n in PROMPT_LENGTHS]
    continuation = torch.randint(1, V, (len(prompts), STEPS), generator=gen)  # (B, S)
    P = max(PROMPT_LENGTHS)
    ids = torch.full((len(prompts), P), PAD_ID)
    mask = torch.zeros(len(prompts), P, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :], mask[b, P - len(p) :] = p, 1
    model.eval()
    with torch.no_grad():
        decoder = decoder_for(model)
        prefill = decoder.prefill(ids, mask)  # (B, P, V)
        steps = [prefill[:, -1]] + [decoder.step(continuation[:, s]) for s in range(STEPS)]
        err = 0.0
        for b, p in enumerate(prompts):
            n = len(p)
            full = model(torch.cat((p, continuation[b]))[None])[0]  # (n + S, V), positions from 0
            err = max(err, (prefill[b, P - n :] - full[:n]).abs().max().item())
            for s, logits in enumerate(steps):
                err = max(err, (logits[b] - full[n - 1 + s]).abs().max().item())
    return err


def test_tiny_gpt_cached_logits_equal_the_training_forward():
    assert max_cached_error(tiny_gpt()) < 1e-5


@pytest.mark.parametrize("family", ["gpt2-tied", "llama", "qwen2"])
def test_hf_cached_logits_equal_the_swarm_forward(hf_folders, family):
    # qwen2's sliding window (6) is shorter than the 11 positions decoded
    assert max_cached_error(hf_model(hf_folders[family])) < 1e-5


def test_hf_view_shares_the_swarm_parameters(hf_folders):
    model = hf_model(hf_folders["gpt2-tied"])
    view = hf_model_of(model)
    assert hf_model_of(model) is view
    with torch.no_grad():
        model.head.lm_head.weight.add_(1.0)  # an optimizer step on the swarm model...
    assert view.lm_head.weight.data_ptr() == model.head.lm_head.weight.data_ptr()  # ...is the view's
    assert view.transformer.wte.weight.data_ptr() != view.lm_head.weight.data_ptr()  # untied


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_the_temperature_scaled_policys(temperature):
    model = tiny_gpt()
    prompts = [[49, 50, 43], [57, 43, 56, 55, 61]]
    cfg = SamplingConfig(samples_per_prompt=3, temperature=temperature, max_new_tokens=6)
    gen = torch.Generator().manual_seed(1)
    out = generate(model, prompts, cfg, stop_id=10, generator=gen, policy_version=4, first_group_id=10)
    assert [t.group_id for t in out] == [10, 10, 10, 11, 11, 11]
    assert all(t.policy_version == 4 and t.temperature == temperature for t in out)
    with torch.no_grad():
        for t in out:
            seq = torch.tensor([*t.prompt_ids, *t.completion_ids])
            logits = model(seq[None])[0] / temperature  # (L, V)
            P = len(t.prompt_ids)
            expected = F.log_softmax(logits[P - 1 : -1], dim=-1).gather(1, seq[P:, None])[:, 0]
            assert torch.allclose(torch.tensor(t.behaviour_logprobs), expected, atol=1e-5)
            assert 10 not in t.completion_ids[:-1]  # it stops at the first stop token
            assert len(t.completion_ids) == 6 or t.completion_ids[-1] == 10


def test_sampling_is_reproducible_and_greedy_is_the_argmax():
    model = tiny_gpt()
    cfg = SamplingConfig(samples_per_prompt=4, temperature=1.0, max_new_tokens=5)
    a = generate(model, [[1, 2, 3]], cfg, stop_id=10, generator=torch.Generator().manual_seed(5))
    b = generate(model, [[1, 2, 3]], cfg, stop_id=10, generator=torch.Generator().manual_seed(5))
    assert a == b
    assert len({t.completion_ids for t in a}) > 1  # four samples of an untrained model differ
    greedy = generate(model, [[1, 2, 3]], dataclasses.replace(cfg, temperature=0.0), stop_id=10)
    seq = [1, 2, 3]
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert list(greedy[0].completion_ids) == seq[3 : 3 + len(greedy[0].completion_ids)]
    assert all(lp == 0.0 for lp in greedy[0].behaviour_logprobs)


def test_hf_generation_runs_on_the_reassembled_model(hf_folders):
    model = hf_model(hf_folders["llama"])
    cfg = SamplingConfig(samples_per_prompt=2, temperature=1.0, max_new_tokens=4)
    out = generate(model, [[5, 6, 7], [8]], cfg, stop_id=0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in out:
            seq = torch.tensor([*t.prompt_ids, *t.completion_ids])
            P = len(t.prompt_ids)
            expected = F.log_softmax(model(seq[None])[0, P - 1 : -1], dim=-1).gather(1, seq[P:, None])[:, 0]
            assert torch.allclose(torch.tensor(t.behaviour_logprobs), expected, atol=1e-5)


def test_a_prompt_that_does_not_fit_the_model_is_refused():
    cfg = SamplingConfig(samples_per_prompt=1, max_new_tokens=8)
    with pytest.raises(ConfigError, match="takes 17 positions, more than the model's input length 16"):
        generate(tiny_gpt(), [[1] * 10], cfg, stop_id=10)
    with pytest.raises(ConfigError, match="samples_per_prompt must be >= 1"):
        SamplingConfig(samples_per_prompt=0)


def test_rewards_are_recomputed_from_the_text():
    task = build_task("add")
    tok = task.tokenizer
    forged = Trajectory(
        prompt_ids=tuple(tok.encode("12+34=")),
        completion_ids=tuple(tok.encode("47\n")),
        behaviour_logprobs=(-1.0, -1.0, -1.0),
        temperature=1.0,
        policy_version=0,
        group_id=0,
        reward=1.0,  # claimed, wrongly
    )
    right = dataclasses.replace(forged, completion_ids=tuple(tok.encode("46\n")), reward=0.0)
    assert [t.reward for t in score(task, [forged, right])] == [0.0, 1.0]
    scored = rollout(tiny_gpt(), task, ["1+2="], SamplingConfig(samples_per_prompt=2, max_new_tokens=4))
    assert all(t.reward == task.reward("1+2=", tok.decode(list(t.completion_ids))) for t in scored)
