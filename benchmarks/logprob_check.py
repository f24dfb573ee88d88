"""How far a rollout peer's behaviour log-probs fall from the pipeline's, honest and lying:
what `RLConfig.logprob_tolerance` (0.1 nats) must separate.

    python benchmarks/logprob_check.py [--replies 16] [--warmup-steps 60]

A tiny-gpt policy (the RL swarm test's shape) is warmed up on the 'add' task until it is right
sometimes, then loaded into the stages of an in-process swarm (2 stages, the real protocol).
Rollout peers sample `--replies` replies (4 prompts x G=8 completions each, temperature 1)
from a copy of that policy as they would hold it:
- exact: the full-precision weights (`weights_codec none`);
- bf16 / int8_codec: the weights as the 'bf16' or 'int8' weights codec delivers them;
- quantize_8bit / quantize_4bit: the copy kept as bitsandbytes Linear8bitLt / Linear4bit
  (`join --role rollout --quantize`), on the CPU here;
and liars, who sample honestly and then claim other log-probs, rewards untouched:
- shifted_0.2: every log-prob 0.2 nats lower; shuffled: a completion's log-probs permuted
  among its tokens; uniform: -log(vocab) everywhere (no model run at all); lie_logprobs:
  shuffled and shifted by 1 nat (`--inject-fault lie-logprobs`).
Each reply is checked as the feed checks it: a microbatch (16) of its completions scored by a
score pass through the swarm, and the mean |claimed - recomputed| over completion tokens.

Prints one JSON object: per case, the gap's mean, min and max over the replies (nats) and the
share of replies the 0.1 tolerance would ban.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import random
import statistics

import torch

from swarmtrain.compress.codecs import get_codec
from swarmtrain.model import build_model
from swarmtrain.rl.generate import SamplingConfig, generate
from swarmtrain.rl.local import LocalConfig, warmup
from swarmtrain.rl.quantize import quantize_model
from swarmtrain.rl.registry import build_task
from swarmtrain.rl.verify import check_microbatch, lie_about_logprobs, logprob_gap
from swarmtrain.train.inprocess import InProcessConfig, InProcessSwarm
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, RunManifest

MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 16}
G = 8
PROMPTS_PER_REPLY = 4
MICROBATCH = 16
TOLERANCE = 0.1


def _through_codec(model, name: str):
    codec = get_codec(name)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            payload, meta = codec.encode(p.detach())
            p.copy_(codec.decode(payload, meta, tuple(p.shape), p.dtype))
    return out


def samplers(model) -> dict:
    return {
        "exact": model,
        "bf16": _through_codec(model, "bf16"),
        "int8_codec": _through_codec(model, "int8"),
        "quantize_8bit": quantize_model(copy.deepcopy(model), "8bit"),
        "quantize_4bit": quantize_model(copy.deepcopy(model), "4bit"),
    }


def liars(rng: random.Random, vocab: int) -> dict:
    def shuffled(rows):
        out = []
        for row in rows:
            row = list(row)
            rng.shuffle(row)
            out.append(row)
        return out

    return {
        "shifted_0.2": lambda rows: [[v - 0.2 for v in row] for row in rows],
        "shuffled": shuffled,
        "uniform": lambda rows: [[-math.log(vocab)] * len(row) for row in rows],
        "lie_logprobs": lambda rows: lie_about_logprobs(rows, rng),
    }


def manifest() -> RunManifest:
    return RunManifest(
        run_id="logprob-check",
        model="tiny-gpt",
        model_config=MODEL,
        num_blocks=MODEL["n_layer"],
        stage_bounds=(0, 1, 2),
        loss="grpo",
        optimizer=OptimizerConfig(name="adamw", lr=1e-3),
        batch=BatchConfig(microbatch_size=MICROBATCH, microbatches_per_step=1),
    )


async def measure(model, replies: int, seed: int) -> dict:
    task = build_task("add")
    rng = random.Random(seed)
    cfg = SamplingConfig(samples_per_prompt=G, temperature=1.0, max_new_tokens=task.max_new_tokens)
    parts = dict(model.parts())
    gaps: dict[str, list[float]] = {}
    async with InProcessSwarm(InProcessConfig(manifest=manifest(), replicas=(1, 1))) as swarm:
        for replica in swarm.replicas.values():  # the stages hold the warmed policy
            for key, part in replica.runner.module.parts():
                part.load_state_dict(parts[key].state_dict())
        honest = samplers(model)
        lying = liars(random.Random(seed), task.tokenizer.vocab_size)
        for n in range(replies):
            prompts = [task.tokenizer.encode(task.train_prompt(rng)) for _ in range(PROMPTS_PER_REPLY)]
            for name, sampler in honest.items():
                g = torch.Generator().manual_seed(seed * 1000 + n)
                trajectories = generate(sampler, prompts, cfg, stop_id=task.tokenizer.end_id, generator=g)
                cases = {name: trajectories}
                if name == "exact":
                    for liar, claim in lying.items():
                        claimed = claim([t.behaviour_logprobs for t in trajectories])
                        cases[liar] = [
                            dataclasses.replace(t, behaviour_logprobs=tuple(c))
                            for t, c in zip(trajectories, claimed, strict=True)
                        ]
                for case, ts in cases.items():
                    x, named = check_microbatch(
                        ts,
                        random.Random(n),
                        microbatch_size=MICROBATCH,
                        seq_len=MODEL["seq_len"],
                        temperature=1.0,
                    )
                    scores = await swarm.score(x, named)
                    gaps.setdefault(case, []).append(logprob_gap(scores, named))
    return {
        case: {
            "mean_gap": statistics.fmean(g),
            "min_gap": min(g),
            "max_gap": max(g),
            "banned_at_0.1": sum(v > TOLERANCE for v in g) / len(g),
        }
        for case, g in gaps.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = build_model("tiny-gpt", MODEL, device="cpu")
    cfg = LocalConfig(model=MODEL, warmup_steps=args.warmup_steps, warmup_batch_size=64, warmup_lr=3e-3)
    warmup(model, build_task("add"), cfg, random.Random(args.seed))
    model.eval()
    results = asyncio.run(measure(model, args.replies, args.seed))
    print(
        json.dumps(
            {
                "model": MODEL,
                "replies": args.replies,
                "completions_checked_per_reply": MICROBATCH,
                "tolerance_nats": TOLERANCE,
                "cases": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
