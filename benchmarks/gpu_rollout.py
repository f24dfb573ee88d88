"""Rollout copies on a CUDA GPU: memory, decode rate, log-prob drift and update time of a full,
8-bit and 4-bit (bitsandbytes) policy copy, side by side in one run.

    python benchmarks/gpu_rollout.py [--device cuda] [--seconds 1.0]

What a rollout peer started with `join --role rollout --gpu cuda [--quantize 8bit|4bit]` holds
and does, measured without a swarm (the peer's own functions: `quantize_model`, `load_policy`,
`generate`, `measure_decode`), for two tiny-gpt sizes: the RL demo's and a wider, deeper one.
Per copy: its parameter bytes and the CUDA memory it took; decode tokens/s at G=8 for 16 and
64 prompts at once (`measure_decode`'s count: every sample at the task's whole completion
budget); the mean and max |behaviour log-prob - full-precision log-prob| over completion
tokens it samples (temperature 1, teacher-forced through the full-precision copy: what the
trainer's score pass checks against `--logprob-tolerance`); and the seconds `load_policy`
takes to load the next version into it (the quantization included), which happens in the
background while the other copy samples. One JSON object; ratios are against the full copy.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time

import torch

from swarmtrain.model import build_model
from swarmtrain.rl.generate import SamplingConfig, generate, measure_decode
from swarmtrain.rl.quantize import load_policy, parameter_bytes, quantize_model
from swarmtrain.rl.registry import build_task
from swarmtrain.rl.tasks import PAD_ID

MODELS = {
    "demo": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 16},
    "wide": {"n_layer": 8, "d_model": 1024, "n_head": 16, "seq_len": 32},
}
G = 8


def full_logprobs(model, trajectories, seq_len: int, device) -> list[list[float]]:
    """log_softmax(logits)[token] of each completion token under `model`, teacher-forced."""
    rows = [list(t.prompt_ids) + list(t.completion_ids) for t in trajectories]
    ids = torch.full((len(rows), seq_len), PAD_ID, dtype=torch.int64)  # (B, T) right-padded
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids.to(device)).float(), dim=-1)  # (B, T, V)
    out = []
    for b, t in enumerate(trajectories):
        start = len(t.prompt_ids) - 1  # position whose logits predict the first completion token
        positions = torch.arange(start, start + len(t.completion_ids), device=device)
        tokens = torch.tensor(t.completion_ids, device=device)
        out.append(logp[b, positions, tokens].tolist())
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measure_copy(full, mode: str | None, task, config: dict, device, seconds: float) -> dict:
    _sync(device)
    before = _allocated(device)
    policy = copy.deepcopy(full) if mode is None else quantize_model(copy.deepcopy(full), mode)
    _sync(device)
    taken = _allocated(device) - before
    rates = {
        f"decode_tokens_per_s_{p}_prompts": round(
            measure_decode(policy, task, samples_per_prompt=G, prompts=p, seconds=seconds)
        )
        for p in (16, 64)
    }
    generator = torch.Generator(device=device).manual_seed(0)
    prompts = [task.tokenizer.encode(task.train_prompt(random.Random(i))) for i in range(16)]
    cfg = SamplingConfig(samples_per_prompt=G, temperature=1.0, max_new_tokens=task.max_new_tokens)
    sampled = generate(policy, prompts, cfg, stop_id=task.tokenizer.end_id, generator=generator)
    truth = full_logprobs(full, sampled, config["seq_len"], device)
    gaps = [
        abs(a - b)
        for t, row in zip(sampled, truth, strict=True)
        for a, b in zip(t.behaviour_logprobs, row, strict=True)
    ]
    state = {k: v.detach().clone() for k, v in full.state_dict().items()}
    _sync(device)
    t0 = time.perf_counter()
    load_policy(policy, state, mode)
    _sync(device)
    return {
        "parameter_bytes": parameter_bytes(policy),
        "cuda_bytes": int(taken),
        **rates,
        "mean_logprob_gap": round(sum(gaps) / len(gaps), 5),
        "max_logprob_gap": round(max(gaps), 5),
        "update_seconds": round(time.perf_counter() - t0, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--models", default=",".join(MODELS), help="which of: " + ", ".join(MODELS))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA device: this benchmark measures rollout copies on a GPU (--device cpu for a dry run)"
        )
    task = build_task("add", {"digits": 2})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "models": {}}
    try:
        import bitsandbytes

        report["bitsandbytes"] = bitsandbytes.__version__
    except ImportError as e:
        report["bitsandbytes"] = f"not importable: {e}"
    for name, config in ((m, MODELS[m]) for m in args.models.split(",")):
        torch.manual_seed(0)
        full = build_model("tiny-gpt", config, device=str(device))
        copies = {}
        for mode in (None, "8bit", "4bit"):
            key = mode or "full"
            try:
                copies[key] = measure_copy(full, mode, task, config, device, args.seconds)
            except Exception as e:  # report what failed and go on with the other copies
                copies[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps({name: {key: copies[key]}}), flush=True)
        base = copies["full"]
        for key in ("8bit", "4bit"):
            if "error" not in copies[key] and "error" not in base:
                copies[key]["bytes_vs_full"] = round(
                    copies[key]["parameter_bytes"] / base["parameter_bytes"], 3
                )
                copies[key]["decode_vs_full_64_prompts"] = round(
                    copies[key]["decode_tokens_per_s_64_prompts"] / base["decode_tokens_per_s_64_prompts"], 3
                )
        report["models"][name] = {"config": config, "copies": copies}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
