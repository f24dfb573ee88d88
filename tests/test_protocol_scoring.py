"""Score passes through an in-process swarm: forward only, on the parameters of exactly the step
they name, answered with the loss's per-sample scores (GRPO: per-token log-probs), counted in no
step. Compared against the whole model run in one process on the same parameters."""

import asyncio

import pytest
import torch

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.model import build_model
from swarmtrain.rl.grpo import token_logprobs
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.train.reference import stage_state_dict
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest
from tests.conftest import TINY_GPT

B, T, V = 4, TINY_GPT["seq_len"], TINY_GPT["vocab_size"]
M = 2


def manifest(loss: str = "grpo") -> RunManifest:
    return RunManifest(
        run_id="scoring",
        model="tiny-gpt",
        model_config=TINY_GPT,
        num_blocks=TINY_GPT["n_layer"],
        stage_bounds=(0, 1, 3, 4),
        loss=loss,
        optimizer=OptimizerConfig(name="adamw", lr=1e-2),
        batch=BatchConfig(microbatch_size=B, microbatches_per_step=M, max_in_flight=2),
    )


def grpo_microbatch(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Random tokens with GRPO's inputs: a completion on the second half of each row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)  # (B, T)
    mask = torch.zeros(B, T)
    mask[:, T // 2 :] = 1.0
    return x, {
        "targets": torch.randint(0, V, (B, T), generator=g),
        "behaviour_logprobs": -torch.rand(B, T, generator=g) * 5 * mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, T) * mask,
        "mask": mask,
    }


def whole_model_logprobs(swarm: InProcessSwarm, x, targets) -> torch.Tensor:
    """The whole model on the parameters the swarm's first replicas hold, in one process."""
    state = {}
    for k in range(swarm.manifest.num_stages):
        state.update(stage_state_dict(swarm.replicas[swarm.live(k)[0]].runner.module))
    net = build_model("tiny-gpt", TINY_GPT, device="meta")
    net.materialise(0)
    for key, part in net.parts():
        part.load_state_dict({n: state[f"{key}.{n}"] for n in part.state_dict()})
    net.eval()
    with torch.no_grad():
        return token_logprobs(net(x), targets, temperature=1.0)  # (B, T)


def snapshot(swarm: InProcessSwarm) -> dict:
    """What a score pass must leave as it was on every replica."""
    return {
        name: (
            r.runner.param_digest(),
            r.runner.step,
            r.runner.report(),
            r.runner.num_pending,
            r.scheduler.tasks_run,
            len(r.started),  # what fault injection (`kill_on_task`, `--inject-fault`) counts
            r.service.counters.served,
            float(sum(p.grad.abs().sum() for p in r.runner.params)),
        )
        for name, r in swarm.replicas.items()
    }


def test_a_score_pass_gives_the_whole_models_logprobs_at_that_step_and_changes_nothing():
    async def scenario():
        config = InProcessConfig(manifest=manifest(), replicas=(1, 2, 1))
        async with InProcessSwarm(config) as swarm:
            x, named = grpo_microbatch(0)
            before = snapshot(swarm)
            at_0 = await swarm.score(x, named)
            assert snapshot(swarm) == before
            expected_0 = whole_model_logprobs(swarm, x, named["targets"])

            await swarm.step([grpo_microbatch(1), grpo_microbatch(2)])
            before = snapshot(swarm)
            at_1 = await swarm.score(x, named)
            after = snapshot(swarm)
            expected_1 = whole_model_logprobs(swarm, x, named["targets"])
            scored = {n: r.service.counters.scored for n, r in swarm.replicas.items()}
            with pytest.raises(RemoteError) as refused:
                await swarm.score(x, named, step=0)  # the stages hold step 1's parameters now
            return at_0, expected_0, at_1, expected_1, before, after, scored, refused.value

    at_0, expected_0, at_1, expected_1, before, after, scored, refused = asyncio.run(scenario())
    assert at_0.shape == (B, T) and at_0.dtype == torch.float32
    torch.testing.assert_close(at_0, expected_0, rtol=0, atol=1e-5)
    torch.testing.assert_close(at_1, expected_1, rtol=0, atol=1e-5)
    assert (at_1 - at_0).abs().max() > 1e-3  # the step moved the policy, and the scores with it
    assert after == before  # weights, step, gradients, tasks run and microbatches served
    assert scored["s0r0"] == 2 and scored["s2r0"] == 2  # one stage-1 replica took each pass
    assert scored["s1r0"] + scored["s1r1"] == 2
    assert refused.cause == Cause.WRONG_STEP and not refused.retryable


def test_a_score_pass_during_a_step_leaves_the_step_as_it_would_be():
    mbs = [grpo_microbatch(1), grpo_microbatch(2)]

    async def scenario(with_scores: bool):
        async with InProcessSwarm(InProcessConfig(manifest=manifest(), replicas=(1, 1, 1))) as swarm:
            jobs = [swarm.step(mbs)]
            if with_scores:
                jobs += [swarm.score(*grpo_microbatch(n)) for n in range(3)]
            result, *scores = await asyncio.gather(*jobs, return_exceptions=True)
            # a pass that reached a stage after the step was applied there is refused, never mixed in
            assert all(
                isinstance(s, torch.Tensor) or (isinstance(s, RemoteError) and s.cause == Cause.WRONG_STEP)
                for s in scores
            ), scores
            return result, {n: r.runner.param_digest() for n, r in swarm.replicas.items()}

    plain, plain_params = asyncio.run(scenario(False))
    scored, scored_params = asyncio.run(scenario(True))
    assert scored.completed == plain.completed == M and scored.replays == 0
    assert scored.loss == plain.loss
    assert scored_params == plain_params


def test_a_loss_without_a_score_refuses_score_passes():
    async def scenario():
        async with InProcessSwarm(
            InProcessConfig(manifest=manifest("cross_entropy"), replicas=(1, 1, 1))
        ) as swarm:
            x = torch.randint(0, V, (B, T))
            with pytest.raises(RemoteError) as refused:
                await swarm.score(x, {"targets": torch.randint(0, V, (B, T))})
            return refused.value

    refused = asyncio.run(scenario())
    assert refused.cause == Cause.REFUSED and not refused.retryable
    assert "has no score" in str(refused)
