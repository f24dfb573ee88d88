"""A rollout peer's work: answer trainers' rollout requests with sampled, scored completions.

The worker holds two copies of the whole policy: the active one samples, the spare one takes
the next policy version (`install`, from `swarmtrain.rl.weights.fetch_version`) while the
active one keeps sampling; then they swap. Generation never waits for a download: the pause
an update costs a rollout request is the swap itself (and, when a request still samples with
the spare copy, the wait for it to finish before the spare is overwritten falls on the
update, not on generation). `stats` counts versions taken, their bytes and seconds, and the
longest pause.

A request is refused (a typed error frame, no compute) when it names another run, comes from
a peer the run does not let drive it (`authorized`), is malformed (the caller is struck), or
asks for a policy version newer than the worker holds (`min_version`: its completions would
arrive too stale; cause WRONG_STEP, so the trainer asks another peer or waits).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarmtrain.errors import BadFrameError, Cause
from swarmtrain.model.swarm_model import SwarmModel
from swarmtrain.rl.generate import SamplingConfig, generate
from swarmtrain.rl.quantize import load_policy
from swarmtrain.rl.tasks import Task
from swarmtrain.wire.frames import Frame, error_frame
from swarmtrain.wire.rollout_messages import (
    RolloutReply,
    RolloutRequest,
    decode_prompts,
    encode_completions,
)


@dataclass
class WorkerStats:
    """What a rollout worker did, for its peer record and the dashboard."""

    requests: int = 0
    samples: int = 0
    """Completions sampled and sent."""
    sample_seconds: float = 0.0
    """Seconds spent sampling (samples / sample_seconds is its rate)."""
    refused: int = 0
    versions_taken: int = 0
    update_bytes: int = 0
    """Bytes on the wire of the policy versions taken."""
    update_seconds: float = 0.0
    """Seconds spent fetching and loading them (in the background)."""
    longest_pause_s: float = 0.0
    """The longest time a policy swap held up sampling."""
    recent_rates: list[float] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.sample_seconds if self.sample_seconds else 0.0


class RolloutWorker:
    """Sample completions for trainers (see the module docstring)."""

    def __init__(
        self,
        *,
        run_id: str,
        model: SwarmModel,
        spare: SwarmModel,
        task: Task,
        temperature: float,
        authorized: Callable[[str], bool],
        strike: Callable[[str, str], None] = lambda peer, why: None,
        version: int = 0,
        quantize: str | None = None,
        slowdown: Callable[[], float] = lambda: 1.0,
    ):
        self.run_id = run_id
        self.task = task
        self.temperature = temperature
        self.authorized = authorized
        self.strike = strike
        self._active, self._spare = model, spare
        self._locks = {id(model): threading.Lock(), id(spare): threading.Lock()}
        self._swap = threading.Lock()
        self.version = version
        self.quantize = quantize
        """'8bit' or '4bit' when the copies are quantized (`swarmtrain.rl.quantize`), else None."""
        self.slowdown = slowdown
        """Sampling takes this many times longer (emulates a slower GPU, as a stage's --slowdown)."""
        self.stats = WorkerStats()
        self.vocab_size = task.tokenizer.vocab_size
        self.max_len = model.input_shape[0]
        self.reward = task.reward
        """What this peer claims a completion earns (the task's reward; trainers check it)."""
        self.claim_logprobs: Callable[[list[tuple[float, ...]]], list] = list
        """What this peer claims as each completion's behaviour log-probs, from its sampler's
        (as they are; trainers check a sample of replies through the pipeline)."""
        self.wanted = -1
        """The newest version a trainer asked for or said the stages hold: it exists, though the
        DHT may not say so yet."""
        self.on_wanted: Callable[[], None] = lambda: None
        """Called (on the event loop) when `wanted` grows: the peer fetches it now."""

    # policy versions

    def install(
        self, state: dict[str, torch.Tensor], version: int, *, wire_bytes: int = 0, seconds: float = 0.0
    ) -> None:
        """Load policy `version` into the spare copy, then make it the active one (blocking: call
        it off the event loop)."""
        t0 = time.perf_counter()
        spare = self._spare
        with self._locks[id(spare)]:  # a request still sampling with it finishes first
            load_policy(spare, state, self.quantize)
        paused = time.perf_counter()
        with self._swap:
            self._active, self._spare = spare, self._active
            self.version = version
        pause = time.perf_counter() - paused
        s = self.stats
        s.versions_taken += 1
        s.update_bytes += wire_bytes
        s.update_seconds += seconds + (time.perf_counter() - t0)
        s.longest_pause_s = max(s.longest_pause_s, pause)

    def _sample(self, prompts: list[list[int]], request: RolloutRequest) -> tuple[int, dict]:
        with self._swap:
            model, version = self._active, self.version
            lock = self._locks[id(model)]
            lock.acquire()
        try:
            t0 = time.perf_counter()
            cfg = SamplingConfig(
                samples_per_prompt=request.samples_per_prompt,
                temperature=self.temperature,
                max_new_tokens=request.max_new_tokens,
            )
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(request.seed)
            trajectories = generate(
                model,
                prompts,
                cfg,
                stop_id=self.task.tokenizer.end_id,
                generator=generator,
                policy_version=version,
            )
            seconds = time.perf_counter() - t0
            factor = self.slowdown()
            if factor > 1:
                time.sleep((factor - 1) * seconds)
                seconds *= factor
        finally:
            lock.release()
        decode = self.task.tokenizer.decode
        rewards = [
            self.reward(decode(list(t.prompt_ids)), decode(list(t.completion_ids))) for t in trajectories
        ]
        tensors = encode_completions(
            [t.completion_ids for t in trajectories],
            self.claim_logprobs([t.behaviour_logprobs for t in trajectories]),
            rewards,
            request.max_new_tokens,
        )
        self.stats.samples += len(trajectories)
        self.stats.sample_seconds += seconds
        return version, tensors

    # serving

    def _refuse(self, message: str, cause: Cause) -> Frame:
        self.stats.refused += 1
        return error_frame(self.run_id, message, cause=cause)

    async def handle(self, frame: Frame, caller: str) -> Frame:
        """Answer one request (the transport's handler)."""
        if frame.run_id != self.run_id:
            return self._refuse(
                f"this rollout peer serves run {self.run_id!r}, not {frame.run_id!r}", Cause.WRONG_RUN
            )
        if frame.kind == "ping":
            return Frame(kind="pong", run_id=self.run_id, step=self.version)
        if frame.kind != "rollout":
            return self._refuse(
                f"a rollout peer answers rollout requests, not {frame.kind!r}", Cause.BAD_FRAME
            )
        if not self.authorized(caller):
            return self._refuse(f"run {self.run_id!r} does not let {caller} drive it", Cause.UNAUTHORIZED)
        try:
            request = RolloutRequest.from_meta(frame.meta)
            if request.max_new_tokens > self.task.max_new_tokens:
                raise BadFrameError(
                    f"rollout request: max_new_tokens {request.max_new_tokens} is more than the task's "
                    f"{self.task.max_new_tokens}"
                )
            prompts = decode_prompts(
                frame.tensors, self.vocab_size, self.max_len - request.max_new_tokens + 1
            )
        except BadFrameError as e:
            self.strike(caller, str(e))
            return self._refuse(f"rollout peer rejected the request: {e}", Cause.BAD_FRAME)
        if max(request.min_version, request.latest_version) > self.wanted:
            self.wanted = max(request.min_version, request.latest_version)
            self.on_wanted()
        if self.version < request.min_version:
            return self._refuse(
                f"this rollout peer holds policy version {self.version}, behind the {request.min_version} "
                "asked for (its completions would arrive too stale); it is fetching a newer one",
                Cause.WRONG_STEP,
            )
        self.stats.requests += 1
        version, tensors = await asyncio.get_running_loop().run_in_executor(
            None, self._sample, prompts, request
        )
        return Frame(
            kind="rollout_data",
            run_id=self.run_id,
            step=version,
            tensors=tensors,
            meta=RolloutReply(version=version).to_meta(),
        )
