"""RL through a swarm: GRPO on 2-digit addition, rollouts sampled by peers that hold no stage.

    python examples/rl_add.py [--steps 20] [--warmup-steps 1000] [--rollout-peers 2]

A small GPT first learns the answer format in this process (a supervised warm-up that stops
once it is right on a fifth of train prompts: GRPO learns only from groups that hold both
rewards). A local swarm then starts from those weights: a coordinator naming the task, one
stage peer per stage and rollout peers, each a process of its own. The trainer runs here;
its data are the rollout peers' completions, each reward recomputed from the text.
"""

import argparse
import tempfile
from pathlib import Path

import swarmtrain as st
from swarmtrain.rl import LocalConfig, accuracy, build_task, warm_up

MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 16}  # tiny-gpt; '99+99=198\n' fits


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=positive, default=20, help="GRPO steps through the swarm (default 20)"
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=1000,
        help="most warm-up steps (default 1000; 0: start from the seed)",
    )
    parser.add_argument("--stages", type=positive, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--rollout-peers", type=positive, default=2, help="rollout peers (default 2)")
    parser.add_argument("--eval-prompts", type=positive, default=200, help="held-out prompts (default 200)")
    args = parser.parse_args(argv)

    rl = st.RLConfig(task="add", task_options={"digits": 2}, samples_per_prompt=8, max_staleness=2)
    task = build_task(rl.task, rl.task_options)
    policy, warmup_steps = warm_up(
        LocalConfig(task=rl.task, task_options=rl.task_options, model=MODEL, warmup_steps=args.warmup_steps)
    )
    before = accuracy(policy, task, args.eval_prompts)
    print(f"warm-up: {warmup_steps} steps, held-out accuracy {before:.3f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="rl-add-") as tmp:
        config = st.LocalSwarmConfig(
            run_id="rl-add",
            model_config=MODEL,
            num_stages=args.stages,
            rl=rl,  # the loss is GRPO's
            rollout_peers=args.rollout_peers,
            init_from=str(st.save_model(policy, Path(tmp) / "warm", builder="tiny-gpt", config=MODEL)),
            batch=st.BatchConfig(microbatch_size=16, microbatches_per_step=4),  # 8 prompts x 8 a step
            optimizer=st.OptimizerConfig(lr=3e-4, weight_decay=0.0, max_grad_norm=1.0),
        )
        with st.LocalSwarm(config) as swarm, swarm.trainer() as trainer:
            feed = st.RolloutFeed(trainer)
            for result in trainer.train(feed, steps=args.steps):
                report = feed.report(result.step)  # reward: the share of sampled answers that are right
                print(
                    f"step {result.step:3d}  loss {result.loss:+.4f}  reward {report['reward']:.3f}  "
                    f"policy lag {report['policy_lag']:.1f}",
                    flush=True,
                )
            policy = trainer.fetch_model()  # the trained policy, from the stages
    after = accuracy(policy, task, args.eval_prompts)
    print(f"held-out accuracy: {before:.3f} after the warm-up, {after:.3f} after {args.steps} GRPO steps")


if __name__ == "__main__":
    main()
