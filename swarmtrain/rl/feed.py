"""A trainer's data in an RL run: GRPO microbatches made of rollout peers' completions.

`RolloutFeed(trainer)` is an iterable of microbatches for `Trainer.train`. On the trainer's
event loop it keeps rollout requests in flight at the run's rollout peers (records with role
'rollout'): a few prompts each, drawn from the task's train split. Each reply is checked
(`rollout_messages.decode_reply`) and every reward recomputed from the text by the task: a
rollout peer whose reply is malformed or whose claimed rewards are not the task's is banned
for the run (`banned`), and its prompts go to another peer. A peer that fails or dies costs
only the samples it had not sent: its prompts go back to the front of the queue.

Staleness. A completion sampled by policy version v trains step s only if s - v <=
`max_staleness`; older ones are dropped (`stale`) and their prompts asked again. Admission
control keeps work from going stale before it starts: a request asks for a version at least
s + 1 - max_staleness (s the trainer's step; the completion trains at s + 1 at the latest, since the
feed buffers at most what the next steps take), and a rollout peer further behind refuses
it before sampling; the feed asks for no more than `ahead_steps` steps' worth of
completions beyond what is buffered; and it sizes each request to what the peer can sample
before its completions would go stale: from each peer's measured seconds per prompt and the
run's seconds per step, a request's completions must be in, behind what is buffered, within
max_staleness steps (less half a step). A slow peer gets fewer prompts, never none.

On-policy turns (`on_policy=True`): the feed asks for a step's completions only once the step
before it committed, from the policy that step trains (min_version is the step), and hands
the trainer none of them until all are in; so generation and training take turns, as on a
colocated system where every GPU generates, then trains. It is the baseline
`benchmarks/rl.py` compares the asynchronous split with.

Verification. Rewards are recomputed for every reply; behaviour log-probs, which only the
policy can recompute, for a sample: each reply is drawn with probability
`RLConfig.verify_fraction`, and if it was sampled by the version the stages hold now, a
microbatch of its completions is scored through the pipeline (`Trainer.score_async`, a
forward-only pass counted in no step) on the trainer's loop, beside training. A mean gap
between claimed and recomputed log-probs above `RLConfig.logprob_tolerance` bans the peer
(`swarmtrain.rl.verify`) and drops its completions still buffered; those already trained on
stay trained. A drawn reply of an older version is not checked (`verify_skipped`), nor is one
whose score pass failed (a stage moved on, a replica died): that is no proof of a lie.

Advantages are normalised within each prompt's group of G completions, all from one reply
(one policy version). Each step's rewards, accuracy and counts are in `step_stats`;
`rl_point(step, seconds)` is what the trainer publishes of them (`TrainerPoint.rl`), and a
trainer driven by the feed lists the peers it banned in its own peer record.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import threading
import time

import torch

from swarmtrain.errors import BadFrameError, Cause, ConfigError, PeerUnreachableError, RemoteError
from swarmtrain.model import build_model
from swarmtrain.rl.feed_counts import FeedCounts, StepStats
from swarmtrain.rl.generate import Trajectory
from swarmtrain.rl.grpo import group_advantages, grpo_config, grpo_microbatch
from swarmtrain.rl.registry import TaskSources, build_task
from swarmtrain.rl.verify import check_microbatch, logprob_gap
from swarmtrain.train.step import StepFailedError
from swarmtrain.transport import handler_name
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.metrics import RLPoint
from swarmtrain.wire.rollout_messages import RolloutRequest, decode_reply, encode_prompts

logger = logging.getLogger(__name__)

WAIT_FOR_ROLLOUTS_S = 180.0
"""Longest a step waits for completions before it fails, saying what is missing."""


class RolloutFeed:
    """An RL run's data: GRPO microbatches of rollout peers' completions (the module docstring
    says how they are asked for and checked).

        feed = RolloutFeed(trainer)
        for result in trainer.train(feed, steps=N):
            print(result.step, feed.report(result.step)["reward"])

    `trainer` must be connected to an RL run (its manifest names a task: ConfigError otherwise);
    the feed asks nothing of anyone until the first microbatch is drawn. A step with no
    completions for WAIT_FOR_ROLLOUTS_S fails with StepFailedError saying what is missing.
    `close()` stops asking (the trainer's `close` stops it too); the feed keeps its counts.
    """

    def __init__(
        self,
        trainer,
        *,
        seed: int = 0,
        sources: TaskSources = TaskSources(),
        ahead_steps: int = 1,
        on_policy: bool = False,
    ):
        manifest = trainer.manifest
        if manifest.rl is None:
            raise ConfigError(
                f"run {manifest.run_id!r} is not an RL run: it names no task (coordinator --task)"
            )
        self.trainer = trainer
        self.rl = rl = manifest.rl
        self.task = build_task(rl.task, rl.task_options, sources)
        self.temperature = grpo_config(manifest.loss).temperature
        self.G = rl.samples_per_prompt
        batch = manifest.batch
        self.microbatch_size = batch.microbatch_size
        self.samples_per_step = batch.microbatch_size * batch.microbatches_per_step
        self.prompts_per_step = rl.prompts_per_step(self.samples_per_step)
        model = build_model(manifest.model, manifest.model_config, device="meta")
        self.seq_len = model.input_shape[0]
        self.vocab_size = self.task.tokenizer.vocab_size
        self.max_new_tokens = self.task.max_new_tokens
        self.ahead_steps = ahead_steps
        self.on_policy = on_policy
        self._generated_step = -1
        """On-policy turns: the last step whose completions all came in."""
        self.rng = random.Random(f"{manifest.seed}:{seed}:{trainer.node.peer_id}")
        self.counts = FeedCounts()
        self.banned: dict[str, str] = {}
        self.step_stats: dict[int, StepStats] = collections.defaultdict(StepStats)
        self._lock = threading.Condition()
        self._ready: collections.deque[tuple[Trajectory, float, str]] = collections.deque()
        """Checked completions not trained yet: (trajectory, advantage, the peer that sent it)."""
        self._verify_rng = random.Random(f"verify:{manifest.seed}:{seed}:{trainer.node.peer_id}")
        self._checks: set[asyncio.Task] = set()
        self._retry: collections.deque[str] = collections.deque()
        self._in_flight = 0  # prompts asked for and not answered
        self._busy: set[str] = set()
        self._resting: dict[str, float] = {}  # peer -> monotonic time it may be asked again
        self._seconds_per_prompt: dict[str, float] = {}  # peer -> measured (moving average)
        self._step_s: float | None = None  # the run's seconds per step (moving average)
        self._step_seen: tuple[int, float] | None = None
        self._pump: asyncio.Future | None = None
        self._closed = False

    # the trainer's side: microbatches

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self._pump is None:
            self._pump = self.trainer.submit(self._run())
        deadline = time.monotonic() + WAIT_FOR_ROLLOUTS_S
        taken: list[tuple[Trajectory, float]] = []
        with self._lock:
            while self.on_policy and self._generated_step < self.trainer.step:
                if self._pump.done():
                    self._pump.result()
                if time.monotonic() > deadline:
                    raise StepFailedError(self._starved())
                self._lock.wait(0.05)
            while len(taken) < self.microbatch_size:
                step = self.trainer.step
                while self._ready and len(taken) < self.microbatch_size:
                    t, a, _ = self._ready.popleft()
                    if step - t.policy_version > self.rl.max_staleness:
                        self.counts.stale += 1
                        if t.group_id >= 0:  # a group's first completion asks its prompt again
                            self._retry.append(self.task.tokenizer.decode(list(t.prompt_ids)))
                        continue
                    taken.append((t, a))
                if len(taken) < self.microbatch_size:
                    if self._pump.done():
                        self._pump.result()  # its error, if it failed
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StepFailedError(self._starved())
                    self._lock.notify_all()
                    self._lock.wait(min(left, 1.0))
            stats = self.step_stats[self.trainer.step]
            for t, _ in taken:
                stats.samples += 1
                stats.reward_sum += t.reward
                stats.correct += self.task.is_correct(t.reward)
                stats.versions.append(t.policy_version)
        trajectories, advantages = zip(*taken, strict=True)
        return grpo_microbatch(
            list(trajectories), list(advantages), seq_len=self.seq_len, temperature=self.temperature
        )

    def _starved(self) -> str:
        return (
            f"no completions for {WAIT_FOR_ROLLOUTS_S:.0f} s: run {self.trainer.manifest.run_id!r} needs rollout peers "
            f"(`swarmtrain join --initial-peers ADDR --role rollout`); banned: {len(self.banned)}, "
            f"stale: {self.counts.stale}, refused: {self.counts.refused}"
        )

    def report(self, step: int) -> dict:
        """What step `step` trained on and what the feed counted so far, as JSON-ready numbers:
        'reward' (the mean reward of the step's completions: with a task's binary rewards, the
        share it answered right; NaN for a step the feed did not feed), 'policy_lag' (mean
        versions between the policy that sampled them and the step), and the feed's counts
        (`FeedCounts`: samples, stale, rejected, lost, banned, verified, ...)."""
        stats = self.step_stats.get(step, StepStats())
        c = self.counts
        return {
            "reward": stats.reward,
            "accuracy": stats.accuracy,
            "policy_lag": stats.policy_lag(step),
            "samples": c.samples,
            "stale": c.stale,
            "rejected": c.rejected,
            "lost": c.lost,
            "banned": len(self.banned),
            "verified": c.verified,
            "verify_failed": c.verify_failed,
            "verify_skipped": c.verify_skipped,
            "logprob_gap": c.logprob_gap,
            "max_logprob_gap": c.max_logprob_gap,
        }

    def rl_point(self, step: int, seconds: float) -> RLPoint:
        """What step `step`, which took `seconds`, trained on and what the feed counted so far,
        as the trainer publishes it (`TrainerPoint.rl`)."""
        stats = self.step_stats.get(step, StepStats())
        with self._lock:
            c = self.counts
            counts = {"stale": c.stale, "rejected": c.rejected, "lost": c.lost, "banned": len(self.banned)}
            checks = {"verified": c.verified, "verify_failed": c.verify_failed}
        return RLPoint(
            samples=stats.samples,
            reward=stats.reward,
            accuracy=stats.accuracy,
            policy_lag=stats.policy_lag(step),
            samples_per_s=stats.samples / seconds if seconds > 0 else 0.0,
            **counts,
            **checks,
        )

    def close(self) -> None:
        """Stop asking for completions; requests still out are cancelled."""
        self._closed = True
        if self._pump is not None:
            self._pump.cancel()

    # the event loop's side: requests

    async def _run(self) -> None:
        tasks: set[asyncio.Task] = set()
        peers: list[str] = []
        read_at = -1.0
        try:
            while not self._closed:
                if time.monotonic() - read_at > 1.0:
                    records = await self.trainer.node.peers_async(self.trainer.manifest.run_id)
                    peers = sorted(
                        r.peer_id
                        for r in records
                        if r.role == "rollout" and r.state == "serving" and r.peer_id not in self.banned
                    )
                    read_at = time.monotonic()
                if self.on_policy:
                    self._check_generated()
                now = time.monotonic()
                free = [  # a peer banned since the last read is asked nothing more
                    p
                    for p in peers
                    if p not in self._busy and p not in self.banned and self._resting.get(p, 0) <= now
                ]
                self._watch_steps()
                for peer in free:
                    count = self._prompts_wanted(len(peers))
                    if count <= 0:
                        break
                    count = self._admitted(peer, count)
                    self._busy.add(peer)
                    self._in_flight += count
                    task = asyncio.create_task(self._ask(peer, count))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(0.05)
        finally:  # close() or a failure: requests and checks still out are not waited for
            for task in [*tasks, *self._checks]:
                task.cancel()

    def _watch_steps(self) -> None:
        step, now = self.trainer.step, time.monotonic()
        if self._step_seen is None or step < self._step_seen[0]:
            self._step_seen = (step, now)
        elif step > self._step_seen[0]:
            seconds = (now - self._step_seen[1]) / (step - self._step_seen[0])
            self._step_s = seconds if self._step_s is None else 0.7 * self._step_s + 0.3 * seconds
            self._step_seen = (step, now)

    def _admitted(self, peer: str, count: int) -> int:
        """Admission: at most the prompts `peer` can sample before they would arrive too stale
        (see the module docstring); at least 1."""
        per_prompt = self._seconds_per_prompt.get(peer)
        if self.on_policy or per_prompt is None or self._step_s is None:
            return count
        with self._lock:
            queued_steps = len(self._ready) / self.samples_per_step
        budget_s = (self.rl.max_staleness - 0.5 - queued_steps) * self._step_s
        return max(1, min(count, int(budget_s / per_prompt)))

    def _check_generated(self) -> None:
        """On-policy turns: once all of this step's completions are in, it is the trainer's turn."""
        with self._lock:
            step = self.trainer.step
            if (
                self._generated_step < step
                and self._in_flight == 0
                and len(self._ready) >= self.prompts_per_step * self.G
            ):
                self._generated_step = step
                self._lock.notify_all()

    def _prompts_wanted(self, peers: int) -> int:
        """Prompts to ask one more peer for now: what the next `ahead_steps` steps take beyond
        what is buffered or asked for, a fair share of a step each."""
        with self._lock:
            buffered = len(self._ready) // self.G + self._in_flight
            if self.on_policy:
                if self._generated_step >= self.trainer.step:
                    return 0  # this step's completions are in: the trainer's turn
                return min(self.prompts_per_step - buffered, -(-self.prompts_per_step // max(peers, 1)))
        want = self.prompts_per_step * (1 + self.ahead_steps) - buffered
        share = max(1, -(-self.prompts_per_step // max(peers, 1)))
        return min(want, share)

    async def _ask(self, peer: str, count: int) -> None:
        prompts = []
        with self._lock:
            while self._retry and len(prompts) < count:
                prompts.append(self._retry.popleft())
        prompts += [self.task.train_prompt(self.rng) for _ in range(count - len(prompts))]
        min_version = (
            self.trainer.step if self.on_policy else max(0, self.trainer.step + 1 - self.rl.max_staleness)
        )
        request = RolloutRequest(
            samples_per_prompt=self.G,
            max_new_tokens=self.max_new_tokens,
            min_version=min_version,
            latest_version=max(self.trainer.step, 0),
            seed=self.rng.getrandbits(63),
        )
        encode = self.task.tokenizer.encode
        frame = Frame(
            kind="rollout",
            run_id=self.trainer.manifest.run_id,
            tensors=encode_prompts([encode(p) for p in prompts]),
            meta=request.to_meta(),
        )
        asked_at = time.monotonic()
        try:
            reply = await self.trainer.transport.call(
                peer,
                handler_name(self.trainer.manifest.run_id),
                frame,
                timeout_s=self.trainer.config.microbatch_timeout_s,
            )
            taken = self._check(peer, prompts, reply)
        except (BadFrameError, _Lied) as e:
            self._ban(peer, str(e))
            self._give_back(prompts, rejected=count * self.G)
        except RemoteError as e:
            behind = 0.1 if self.on_policy else 0.5  # on-policy turns wait for this very version
            self._resting[peer] = time.monotonic() + (behind if e.cause == Cause.WRONG_STEP else 5.0)
            self.counts.refused += 1
            logger.debug("rollout peer %s refused: %s", peer[-8:], e)
            self._give_back(prompts)
        except PeerUnreachableError as e:
            self._resting[peer] = time.monotonic() + 10.0
            logger.warning(
                "rollout peer %s failed (%s): its %d prompts go to another", peer[-8:], e, len(prompts)
            )
            self._give_back(prompts, lost=count * self.G)
        except asyncio.CancelledError:
            self._give_back(prompts)
            raise
        except Exception as e:  # anything else the call raised: its prompts must not be lost
            self._resting[peer] = time.monotonic() + 10.0
            logger.warning("rollout request to %s failed (%r): its prompts go to another", peer[-8:], e)
            self._give_back(prompts, lost=count * self.G)
        else:
            per_prompt = (time.monotonic() - asked_at) / count
            old = self._seconds_per_prompt.get(peer)
            self._seconds_per_prompt[peer] = per_prompt if old is None else 0.5 * old + 0.5 * per_prompt
            banned = peer in self.banned  # banned while this reply was on its way
            if taken and not banned:
                self._maybe_verify(peer, [t for t, _ in taken])
            with self._lock:
                self._in_flight -= count
                if banned:
                    self.counts.rejected += len(taken)
                else:
                    self._ready.extend((t, a, peer) for t, a in taken)
                    self.counts.samples += len(taken)
                self._lock.notify_all()
        finally:
            self._busy.discard(peer)

    def _maybe_verify(self, peer: str, trajectories: list[Trajectory]) -> None:
        """Draw whether to check this reply's log-probs; check it beside training if it is of the
        version the stages hold (see Verification in the module docstring)."""
        if self._verify_rng.random() >= self.rl.verify_fraction:
            return
        version = trajectories[0].policy_version
        if version != self.trainer.step:
            with self._lock:
                self.counts.verify_skipped += 1
            return
        x, named = check_microbatch(
            trajectories,
            self._verify_rng,
            microbatch_size=self.microbatch_size,
            seq_len=self.seq_len,
            temperature=self.temperature,
        )
        task = asyncio.create_task(self._verify(peer, version, x, named))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _verify(self, peer: str, version: int, x: torch.Tensor, named: dict) -> None:
        try:
            recomputed = await self.trainer.score_async(x, named, step=version)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a stage moved on, a replica died: no proof of anything
            logger.info("log-probs of rollout peer %s not checked: %s", peer[-8:], e)
            with self._lock:
                self.counts.verify_skipped += 1
                self._lock.notify_all()
            return
        gap = logprob_gap(recomputed, named)
        held = gap <= self.rl.logprob_tolerance
        if not held:
            self._ban(
                peer,
                f"its behaviour log-probs of version {version} are {gap:.3f} nats from the policy's on "
                f"average over {int(named['mask'].sum())} completion tokens (tolerance "
                f"{self.rl.logprob_tolerance} nats)",
            )
        with self._lock:  # the counts and the dropping of the liar's completions seen at once
            c = self.counts
            c.logprob_gap = gap
            c.max_logprob_gap = gap if math.isnan(c.max_logprob_gap) else max(c.max_logprob_gap, gap)
            c.verified += held
            c.verify_failed += not held
            if not held:  # its completions not trained yet go
                kept = collections.deque(item for item in self._ready if item[2] != peer)
                c.rejected += len(self._ready) - len(kept)
                self._ready = kept
            self._lock.notify_all()

    def _give_back(self, prompts: list[str], *, rejected: int = 0, lost: int = 0) -> None:
        with self._lock:
            self._retry.extendleft(reversed(prompts))
            self._in_flight -= len(prompts)
            self.counts.rejected += rejected
            self.counts.lost += lost

    def _ban(self, peer: str, why: str) -> None:
        if peer in self.banned:  # another of its replies, already in flight
            return
        self.banned[peer] = why
        self.trainer.transport.strike(peer, why)
        logger.warning("rollout peer %s banned from the run: %s", peer[-8:], why)

    def _check(self, peer: str, prompts: list[str], reply: Frame) -> list[tuple[Trajectory, float]]:
        """The reply's completions with their advantages; BadFrameError or _Lied if it does not hold."""
        if reply.kind != "rollout_data":
            raise BadFrameError(f"a rollout request was answered with a {reply.kind!r} frame")
        newest = max(self.trainer.step, 0) + 1
        got = decode_reply(
            reply.meta,
            reply.tensors,
            rows=len(prompts) * self.G,
            max_new_tokens=self.max_new_tokens,
            vocab_size=self.vocab_size,
            newest_version=newest,
        )
        encode, decode = self.task.tokenizer.encode, self.task.tokenizer.decode
        out = []
        for g, prompt in enumerate(prompts):
            rows = range(g * self.G, (g + 1) * self.G)
            rewards = []
            for i in rows:
                reward = self.task.reward(prompt, decode(list(got.tokens[i])))
                if reward != got.rewards[i]:
                    raise _Lied(
                        f"it claimed reward {got.rewards[i]} for {decode(list(got.tokens[i]))!r} after "
                        f"{prompt!r}; the task gives {reward}"
                    )
                rewards.append(reward)
            advantages = group_advantages(torch.tensor(rewards), self.G).tolist()
            for j, i in enumerate(rows):
                t = Trajectory(
                    prompt_ids=tuple(encode(prompt)),
                    completion_ids=got.tokens[i],
                    behaviour_logprobs=got.logprobs[i],
                    temperature=self.temperature,
                    policy_version=got.version,
                    group_id=g if j == 0 else -1,
                    reward=rewards[j],
                )
                out.append((t, advantages[j]))
        return out


class _Lied(Exception):
    """A rollout peer's reply is well-formed but not true."""
