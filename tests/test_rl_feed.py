"""A trainer's rollout feed against rollout workers in one process: GRPO microbatches, a lying peer
banned, a dead peer's prompts asked again, stale completions dropped, admission by version.

The feed sees a stub trainer (the attributes it reads: manifest, step, event loop, node,
transport, config) whose transport is a real `MemoryTransport`; the rollout workers are real,
each serving its `handle` on the same in-memory network. Tests wait on conditions (the feed's,
notified as completions arrive; the swarm's, notified as workers answer and peers are struck),
never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import random
import threading
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import swarmtrain.rl.feed as feed_module
from swarmtrain.errors import Cause, RemoteError
from swarmtrain.rl.feed import RolloutFeed
from swarmtrain.rl.feed_counts import StepStats
from swarmtrain.rl.grpo import token_logprobs
from swarmtrain.rl.registry import build_task
from swarmtrain.rl.verify import lie_about_logprobs
from swarmtrain.rl.worker import RolloutWorker
from swarmtrain.transport import handler_name
from swarmtrain.transport.memory import MemoryNetwork
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.records import BatchConfig, PeerRecord, RunManifest
from swarmtrain.wire.rl_config import RLConfig
from swarmtrain.wire.rollout_messages import RolloutRequest, decode_prompts
from tests.test_rl_rollout import MODEL, always, policy

RUN = "rl"
TRAINER = "trainer"
G = 4
B = 8  # completions per microbatch: two prompts' groups
TASK = build_task("add")
MANIFEST = RunManifest(
    run_id=RUN,
    model="tiny-gpt",
    model_config=MODEL,
    num_blocks=MODEL["n_layer"],
    stage_bounds=(0, MODEL["n_layer"]),
    loss="grpo",
    batch=BatchConfig(microbatch_size=B, microbatches_per_step=2, max_in_flight=2),
    rl=RLConfig(task="add", samples_per_prompt=G, max_staleness=2),
)  # 4 prompts a step; the feed keeps 2 steps' worth (8 prompts, 32 completions) asked for
WAIT_S = 20.0
"""Longest any wait here may take before the test fails (everything takes well under a second)."""


@dataclass(frozen=True)
class Asked:
    """One rollout request a worker answered."""

    request: RolloutRequest
    prompts: tuple[str, ...]
    reply: Frame


class StubNode:
    def __init__(self, records: list[PeerRecord]):
        self.peer_id = TRAINER
        self.records = records

    async def peers_async(self, run_id: str) -> list[PeerRecord]:
        assert run_id == RUN
        return list(self.records)


class Swarm:
    """Rollout workers and a stub trainer on one in-memory network; its event loop runs on a thread.

    The stub trainer's score passes run the whole untrained policy (the one every worker starts
    from) in one process: the stages' parameters at any step here. `score_gate`, while clear,
    holds them; `score_error`, when set, is what they raise."""

    def __init__(self, workers: dict[str, dict], manifest: RunManifest = MANIFEST):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.network = MemoryNetwork()
        self.changed = threading.Condition()
        """Notified whenever a worker answers a request or the trainer strikes a peer."""
        self.asked: dict[str, list[Asked]] = defaultdict(list)
        self.struck: dict[str, list[str]] = defaultdict(list)
        self.workers: dict[str, RolloutWorker] = {}
        for name, options in workers.items():
            self.workers[name] = worker = rollout_worker(**options)
            self.network.transport(name).handlers[handler_name(RUN)] = self._recording(name, worker.handle)
        transport = self.network.transport(TRAINER)
        strike = transport.strike

        def striking(peer: str, why: str) -> None:
            strike(peer, why)
            with self.changed:
                self.struck[peer].append(why)
                self.changed.notify_all()

        transport.strike = striking
        self.scorer = policy().eval()
        self.scored: list[int] = []
        """The step of each score pass the feed asked for."""
        self.score_gate = asyncio.Event()
        self.score_gate.set()
        self.score_error: Exception | None = None
        self.trainer = SimpleNamespace(
            score_async=self._score,
            manifest=manifest,
            step=0,
            submit=lambda coro: asyncio.run_coroutine_threadsafe(coro, self.loop),
            node=StubNode([PeerRecord(peer_id=name, role="rollout") for name in workers]),
            transport=transport,
            config=SimpleNamespace(microbatch_timeout_s=10.0),
        )

    async def _score(self, x: torch.Tensor, named: dict, *, step: int) -> torch.Tensor:
        with self.changed:
            self.scored.append(step)
            self.changed.notify_all()
        await self.score_gate.wait()
        if self.score_error is not None:
            raise self.score_error
        with torch.no_grad():
            return token_logprobs(self.scorer(x), named["targets"], temperature=1.0)

    def open_gate(self) -> None:
        self.loop.call_soon_threadsafe(self.score_gate.set)

    def _recording(self, name: str, handle):
        async def handler(frame: Frame, caller: str) -> Frame:
            reply = await handle(frame, caller)
            prompts = decode_prompts(frame.tensors, TASK.tokenizer.vocab_size, MODEL["seq_len"])
            asked = Asked(
                RolloutRequest.from_meta(frame.meta),
                tuple(TASK.tokenizer.decode(p) for p in prompts),
                reply,
            )
            with self.changed:
                self.asked[name].append(asked)
                self.changed.notify_all()
            return reply

        return handler

    def wait(self, condition, what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(condition, WAIT_S):
                pytest.fail(f"timed out waiting for {what}")

    def settle(self) -> None:
        """Let the event loop finish what it is running now (the rest of a callback under way)."""
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result(WAIT_S)

    def close(self) -> None:
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_default_executor()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT_S)
        self.loop.close()


def rollout_worker(
    *, version: int = 0, state: dict | None = None, liar: bool = False, lie_logprobs: bool = False
) -> RolloutWorker:
    model, spare = policy(), policy()
    if state is not None:
        model.load_state_dict(state)
        spare.load_state_dict(state)
    worker = RolloutWorker(
        run_id=RUN,
        model=model,
        spare=spare,
        task=TASK,
        temperature=1.0,
        authorized=lambda peer: peer == TRAINER,
        version=version,
    )
    if liar:
        worker.reward = lambda prompt, completion: 1.0
    if lie_logprobs:
        rng = random.Random(0)
        worker.claim_logprobs = lambda logprobs: lie_about_logprobs(logprobs, rng)
    return worker


@pytest.fixture
def swarm_of(monkeypatch):
    """Factory for Swarms (closed at teardown, with their feeds)."""
    monkeypatch.setattr(feed_module, "WAIT_FOR_ROLLOUTS_S", WAIT_S)
    made: list[tuple[Swarm, RolloutFeed]] = []

    def make(
        feed_options: dict | None = None, manifest: RunManifest = MANIFEST, **workers
    ) -> tuple[Swarm, RolloutFeed]:
        swarm = Swarm({name.replace("_", "-"): options for name, options in workers.items()}, manifest)
        feed = RolloutFeed(swarm.trainer, **(feed_options or {}))
        made.append((swarm, feed))
        return swarm, feed

    yield make
    for swarm, feed in made:
        feed.close()
        swarm.close()


def wait_for_feed(feed: RolloutFeed, condition, what: str) -> None:
    """Wait on the feed's own condition, notified whenever a reply's completions arrive."""
    with feed._lock:
        if not feed._lock.wait_for(condition, WAIT_S):
            pytest.fail(f"timed out waiting for {what}")


def completions_of(named: dict[str, torch.Tensor]) -> list[str]:
    """Each row's completion text: its targets where the mask is 1."""
    return [
        TASK.tokenizer.decode(row[m.bool()].tolist())
        for row, m in zip(named["targets"], named["mask"], strict=True)
    ]


def prompts_of(x: torch.Tensor, named: dict[str, torch.Tensor]) -> list[str]:
    """Each row's prompt text: its tokens before the first masked position (+ that one)."""
    out = []
    for row, m in zip(x, named["mask"], strict=True):
        first = int(m.nonzero()[0])  # the position whose target is the first completion token
        out.append(TASK.tokenizer.decode(row[: first + 1].tolist()))
    return out


def asked_prompts(asked: list[Asked]) -> set[str]:
    return {p for a in asked for p in a.prompts}


def test_microbatches_are_grpo_inputs_of_checked_completions(swarm_of):
    swarm, feed = swarm_of(rollout_a={}, rollout_b={})
    microbatches = [next(feed) for _ in range(4)]  # two steps' worth
    for x, named in microbatches:
        assert x.shape == (B, MODEL["seq_len"]) and x.dtype == torch.int64
        assert set(named) == {"targets", "behaviour_logprobs", "advantages", "mask"}
        assert named["targets"].shape == x.shape and named["targets"].dtype == torch.int64
        for name in ("behaviour_logprobs", "advantages", "mask"):
            assert named[name].shape == x.shape and named[name].dtype == torch.float32
        mask = named["mask"]
        assert ((mask == 0) | (mask == 1)).all()
        assert ((mask.sum(dim=1) >= 1) & (mask.sum(dim=1) <= TASK.max_new_tokens)).all()
        assert (named["behaviour_logprobs"] <= 0).all()
        assert (named["behaviour_logprobs"][mask == 0] == 0).all()
        assert (named["advantages"][mask == 0] == 0).all()
        prompts = prompts_of(x, named)
        # whole groups, in order: each prompt's G completions are consecutive rows
        assert all(len(set(prompts[g : g + G])) == 1 for g in range(0, B, G))
        assert set(prompts) <= asked_prompts(swarm.asked["rollout-a"] + swarm.asked["rollout-b"])
        for prompt, completion in zip(prompts, completions_of(named), strict=True):
            assert TASK.reward(prompt, completion) == 0.0  # an untrained policy: rewards recomputed
    assert feed.step_stats[0].samples == 4 * B and feed.step_stats[0].versions == [0] * (4 * B)
    report = feed.report(0)
    assert report["samples"] >= 4 * B and report["banned"] == 0 and report["policy_lag"] == 0
    assert feed.counts.stale == feed.counts.lost == feed.counts.rejected == feed.counts.refused == 0
    point = feed.rl_point(0, seconds=2.0)  # what the trainer publishes of step 0
    assert (point.samples, point.reward, point.accuracy, point.policy_lag) == (4 * B, 0.0, 0.0, 0.0)
    assert point.samples_per_s == 2 * B and (point.stale, point.rejected, point.banned) == (0, 0, 0)
    assert feed.report(0)["accuracy"] == 0.0
    nothing = feed.rl_point(5, seconds=1.0)  # a step the feed fed nothing into
    assert nothing.samples == 0 and math.isnan(nothing.reward) and nothing.samples_per_s == 0


def test_step_stats_count_the_right_answers_and_the_policy_lag():
    stats = StepStats()
    for reward, version in [(1.0, 3), (0.0, 3), (1.0, 1), (0.0, 2)]:
        stats.samples += 1
        stats.reward_sum += reward
        stats.correct += TASK.is_correct(reward)
        stats.versions.append(version)
    assert (stats.reward, stats.accuracy, stats.policy_lag(3)) == (0.5, 0.5, 0.75)
    assert TASK.is_correct(1.0) and not TASK.is_correct(0.0)
    assert math.isnan(StepStats().accuracy) and math.isnan(StepStats().policy_lag(3))


def test_a_peer_lying_about_rewards_is_banned_and_none_of_its_completions_train(swarm_of):
    # the liar's policy writes 'ZZZZ' whatever the prompt (the honest ones, untrained, never do)
    swarm, feed = swarm_of(
        rollout_a={}, rollout_b={}, rollout_c={"state": always("Z", policy()), "liar": True}
    )
    microbatches = [next(feed)]
    swarm.wait(lambda: "rollout-c" in swarm.struck, "the liar to be struck")
    swarm.settle()
    microbatches += [next(feed) for _ in range(5)]

    assert set(feed.banned) == {"rollout-c"}
    assert "it claimed reward 1.0 for 'ZZZZ'" in feed.banned["rollout-c"]
    assert "the task gives 0.0" in feed.banned["rollout-c"]
    assert swarm.struck == {"rollout-c": [feed.banned["rollout-c"]]}
    assert swarm.trainer.transport.strikes("rollout-c") == 1
    # its whole reply went, and it was not asked again once banned
    [asked] = swarm.asked["rollout-c"]
    assert feed.counts.rejected == len(asked.prompts) * G
    point = feed.rl_point(0, seconds=1.0)
    assert (point.banned, point.rejected) == (1, len(asked.prompts) * G)
    for _, named in microbatches:
        assert "ZZZZ" not in completions_of(named)


def test_a_dead_peer_costs_only_its_prompts_which_are_asked_again(swarm_of):
    swarm, feed = swarm_of(rollout_a={}, rollout_b={})
    lost: list[tuple[str, ...]] = []

    def to_a(_sender, receiver, frame):
        if receiver != "rollout-a":
            return False
        lost.append(
            tuple(
                TASK.tokenizer.decode(p)
                for p in decode_prompts(frame.tensors, TASK.tokenizer.vocab_size, MODEL["seq_len"])
            )
        )
        return True

    # rollout-a dies as the feed's first request reaches it
    swarm.network.on_delivery(to_a, lambda: swarm.network.kill("rollout-a"))
    microbatches = [next(feed) for _ in range(4)]

    [prompts] = lost
    assert feed.counts.lost == len(prompts) * G
    assert swarm.asked["rollout-a"] == []  # it never answered
    assert set(prompts) <= asked_prompts(swarm.asked["rollout-b"])
    trained = {p for x, named in microbatches for p in prompts_of(x, named)}
    assert set(prompts) <= trained
    assert feed.banned == {} and feed.counts.rejected == 0


def test_completions_staler_than_max_staleness_are_dropped_and_their_prompts_asked_again(swarm_of):
    swarm, feed = swarm_of(rollout_a={}, rollout_b={})
    next(feed)
    # the feed keeps 8 prompts asked beyond what it yielded: 10 replies' groups, then it waits
    wait_for_feed(feed, lambda: feed.counts.samples == 10 * G, "the feed's buffer to fill")
    buffered = feed.counts.samples - B
    at_version_0 = asked_prompts(swarm.asked["rollout-a"] + swarm.asked["rollout-b"])

    # the trainer moves on to step 5 while the buffer holds version 0's completions (5 - 0 > 2)
    swarm.trainer.step = 5
    for worker in swarm.workers.values():
        worker.install(policy().state_dict(), 5)
    next(feed)

    assert feed.counts.stale == buffered
    assert feed.step_stats[5].versions == [5] * B  # nothing staler trained
    later = [a for name in ("rollout-a", "rollout-b") for a in swarm.asked[name] if a.request.min_version > 0]
    assert later and all(a.request.min_version == 5 + 1 - 2 for a in later)
    assert asked_prompts(later) <= at_version_0  # the dropped groups' prompts, asked again
    assert feed.report(5)["policy_lag"] == 0 and feed.report(5)["stale"] == buffered


def test_a_peer_behind_the_version_asked_for_refuses_until_it_takes_a_newer_one(swarm_of):
    swarm, feed = swarm_of(rollout_a={"version": 0})
    swarm.trainer.step = 5  # with max_staleness 2, completions must come from version 4 or later
    worker = swarm.workers["rollout-a"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        microbatch = pool.submit(next, feed)
        swarm.wait(lambda: swarm.asked["rollout-a"], "the rollout peer to be asked")
        [refused] = swarm.asked["rollout-a"]
        assert refused.request.min_version == 4
        assert refused.reply.kind == "error" and "behind the 4" in refused.reply.error_text()
        assert worker.stats.samples == 0 and not microbatch.done()

        worker.install(policy().state_dict(), 4)
        x, _ = microbatch.result(WAIT_S)
    assert x.shape == (B, MODEL["seq_len"])
    assert feed.counts.refused >= 1 and worker.stats.refused == feed.counts.refused
    assert feed.step_stats[5].versions == [4] * B
    # the refused prompts were the first asked again
    assert set(refused.prompts) <= asked_prompts(swarm.asked["rollout-a"][1:])


def test_on_policy_turns_generate_a_whole_step_from_its_own_version_then_train_it(swarm_of):
    swarm, feed = swarm_of({"on_policy": True}, rollout_a={}, rollout_b={})
    step_prompts = 4  # 2 microbatches of 2 groups

    def asked(version: int) -> list[Asked]:
        return [
            a for n in ("rollout-a", "rollout-b") for a in swarm.asked[n] if a.request.min_version == version
        ]

    first = next(feed)
    # the trainer got nothing until the whole step was in, all of it from version 0
    assert feed.counts.samples == step_prompts * G
    assert sum(len(a.prompts) for a in asked(0)) == step_prompts
    second = next(feed)
    assert feed.step_stats[0].versions == [0] * (2 * B)
    for x, _named in (first, second):
        assert x.shape == (B, MODEL["seq_len"])

    # the next step's completions come from the version it trains, once the workers hold it
    swarm.trainer.step = 1
    for worker in swarm.workers.values():
        worker.install(policy().state_dict(), 1)
    next(feed)
    assert sum(len(a.prompts) for a in asked(1)) == step_prompts
    assert feed.counts.samples == 2 * step_prompts * G  # nothing asked beyond each step
    assert feed.step_stats[1].versions == [1] * B and feed.report(1)["policy_lag"] == 0


def checking_all(**rl) -> RunManifest:
    """MANIFEST with every rollout reply drawn for a log-prob check."""
    return dataclasses.replace(MANIFEST, rl=dataclasses.replace(MANIFEST.rl, verify_fraction=1.0, **rl))


def test_a_peer_lying_about_logprobs_is_banned_and_its_buffered_completions_dropped(swarm_of):
    swarm, feed = swarm_of(manifest=checking_all(), rollout_a={}, rollout_b={"lie_logprobs": True})
    swarm.loop.call_soon_threadsafe(swarm.score_gate.clear)
    swarm.settle()
    next(feed)
    # the checks are held while the feed fills its buffer (10 replies' groups), then it waits
    wait_for_feed(
        feed, lambda: feed.counts.samples == 10 * G and feed._in_flight == 0, "the feed's buffer to fill"
    )
    with feed._lock:
        buffered_from_liar = sum(peer == "rollout-b" for *_, peer in feed._ready)
    liar_replies = len(swarm.asked["rollout-b"])
    assert buffered_from_liar > 0 and liar_replies > 0
    assert feed.banned == {} and feed.counts.verify_skipped == 0

    swarm.open_gate()
    swarm.wait(lambda: "rollout-b" in swarm.struck, "the liar to be struck")
    # until the feed is full and idle again (it asked the honest peer for more once the liar's
    # completions went) and every reply's check ended
    wait_for_feed(
        feed,
        lambda: (
            feed._in_flight == 0
            and len(feed._ready) // G >= 8
            and feed.counts.verified + feed.counts.verify_failed
            == len(swarm.asked["rollout-a"]) + liar_replies
        ),
        "the feed to refill and every check to end",
    )
    assert set(feed.banned) == {"rollout-b"}
    why = feed.banned["rollout-b"]
    assert "behaviour log-probs of version 0 are" in why and "tolerance 0.1 nats" in why
    with feed._lock:
        assert all(peer == "rollout-a" for *_, peer in feed._ready)
    assert feed.counts.rejected == buffered_from_liar  # none of them left to train
    # every reply was checked at the version the stages hold: the honest one's held, the liar's not
    assert swarm.scored == [0] * (len(swarm.asked["rollout-a"]) + liar_replies)
    assert feed.counts.verified == len(swarm.asked["rollout-a"]) and feed.counts.verify_failed == liar_replies
    report = feed.report(0)
    assert report["max_logprob_gap"] >= 1.0  # shifted by a nat, and shuffled
    assert report["verified"] == feed.counts.verified and report["verify_failed"] == liar_replies
    # training goes on from the honest peer alone, which is never asked to wait for the liar
    asked_before = liar_replies
    for _ in range(3):
        next(feed)
    assert len(swarm.asked["rollout-b"]) == asked_before and "rollout-a" not in feed.banned


def test_honest_log_probs_pass_their_check_within_a_hundredth_of_a_nat(swarm_of):
    swarm, feed = swarm_of(manifest=checking_all(logprob_tolerance=0.01), rollout_a={}, rollout_b={})
    for _ in range(4):
        next(feed)
    wait_for_feed(feed, lambda: feed.counts.verified >= 4, "four replies to be checked")
    assert feed.banned == {} and feed.counts.verify_failed == 0
    assert 0 <= feed.counts.max_logprob_gap < 1e-3  # the same arithmetic, another batch shape


def test_replies_of_older_versions_and_failed_score_passes_are_skipped_not_banned(swarm_of):
    swarm, feed = swarm_of(manifest=checking_all(), rollout_a={"lie_logprobs": True})
    swarm.trainer.step = 1  # the worker samples with version 0: within max_staleness, not checkable
    next(feed)
    assert swarm.scored == [] and feed.counts.verify_skipped >= 1

    swarm.score_error = RemoteError("stage 1 is at step 2, not 1", cause=Cause.WRONG_STEP, retryable=False)
    swarm.trainer.step = 0
    skipped = feed.counts.verify_skipped
    for _ in range(2):
        next(feed)
    wait_for_feed(feed, lambda: feed.counts.verify_skipped > skipped, "a failed check to be skipped")
    assert feed.banned == {} and feed.counts.verified == feed.counts.verify_failed == 0
    assert math.isnan(feed.report(0)["logprob_gap"])
