"""A live swarm under fuzzed input from an outsider: random bytes, mutated frames, lying
prefixes, broken headers, well-framed requests of every kind with a wrong field, and headers
promising payloads that never come (the attempts: tests/fuzz_cases.py).

Every attempt must be answered with a refusal (an error reply with a cause the caller can act
on; never 'own_failure', which is what an unexpected exception in a handler becomes) within
the peer's read timeout plus a margin; the peers stay alive, answer pings, log no traceback,
and afterwards the swarm trains to the same losses as single-process training of the same seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from hivemind.p2p import PeerID
from hypothesis import HealthCheck, example, given, settings

from swarmtrain.errors import Cause
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.wire.frames import PREFIX, Frame, read_frame
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, assert_trains_like_the_reference
from tests.fuzz_cases import (
    MICROBATCH_SIZE,
    NUM_STAGES,
    REGRESSIONS,
    RUN,
    STRATEGIES,
    Attempt,
    B,
    T,
    encoded,
)

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

SEED = 3
STEPS = 3
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=MICROBATCH_SIZE, microbatches_per_step=2, max_in_flight=2)

READ_TIMEOUT_S = 1.0
"""The fuzzed peers' --read-timeout: a request must arrive whole this soon."""
ANSWER_TIMEOUT_S = READ_TIMEOUT_S + 15.0
"""An attempt unanswered after this long has hung the peer."""
EXAMPLES = 30
"""Examples per strategy: ~10 strategies x 30 attempts keep the module near a minute on 2 cores."""

REFUSALS = {
    Cause.BAD_FRAME,
    Cause.WRONG_RUN,
    Cause.WRONG_STAGE,
    Cause.WRONG_STEP,
    Cause.UNREACHABLE,
    Cause.UNAUTHORIZED,
}
"""Causes an outsider's bad input may earn (UNREACHABLE: the request did not arrive in time;
UNAUTHORIZED: a well-formed request the run does not let an outsider make)."""

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# the swarm and the outsider


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig

    # Strikes would ban the outsider after three attempts and hide every later check behind
    # the ban; the ban itself is tested in test_bad_frames.
    limits = ("--max-strikes", "1000000", "--read-timeout", str(READ_TIMEOUT_S), "--max-frame-mb", "1")
    config = LocalSwarmConfig(
        run_id=RUN,
        model_config=TINY_GPT,
        num_stages=NUM_STAGES,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        stage_args={k: limits for k in range(NUM_STAGES)},
        log_dir=str(tmp_path_factory.mktemp("fuzz")),
    )
    with LocalSwarm(config) as swarm:
        names = sorted(n for n in swarm.procs if n.startswith("stage"))
        swarm.stage_names = names
        swarm.peer_ids = [swarm.wait_ready(name) for name in names]
        yield swarm


class Outsider:
    """A P2P identity that is no part of the run, on an event loop of its own thread, so that
    each hypothesis example (plain synchronous code) can run one attempt on it."""

    def __init__(self, address: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node = SwarmNode(NodeConfig(initial_peers=(address,)))
        self.p2p = self.run(self.node.p2p(), timeout_s=60)
        self.transport = TensorTransport(self.p2p)

    def run(self, coro, *, timeout_s: float = ANSWER_TIMEOUT_S + 5):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.node.close_p2p(), timeout_s=30)
        self.node.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def outsider(swarm):
    outsider = Outsider(swarm.address)
    yield outsider
    outsider.close()


@dataclass(frozen=True)
class Outcome:
    reply: Frame | None
    """The peer's answer; None: it closed the stream without one."""
    seconds: float


async def open_stream(outsider: Outsider, peer: str):
    _, reader, writer = await outsider.p2p.call_binary_stream_handler(
        PeerID.from_base58(peer), handler_name(RUN)
    )
    return reader, writer


async def send(outsider: Outsider, peer: str, data: bytes) -> Outcome:
    """Write `data` and read what comes back, keeping our side of the stream open: the
    daemon takes a half-close for a close, which would cut the peer's answer off."""
    started = time.monotonic()
    reader, writer = await open_stream(outsider, peer)
    try:
        writer.write(data)
        await writer.drain()
        try:
            reply = await asyncio.wait_for(read_frame(reader), ANSWER_TIMEOUT_S)
        except asyncio.IncompleteReadError as e:
            assert e.partial == b"", f"the peer sent {len(e.partial)} bytes of a frame, then closed"
            reply = None
    finally:
        writer.close()
    return Outcome(reply, time.monotonic() - started)


def attempt(outsider: Outsider, swarm, a: Attempt) -> None:
    """Send one attempt and check that it is refused (or pinged, where `a.may_pong`) in time.

    The peer reads a request until it is whole or its read timeout passes, and answers either
    way: a stream closed on us unanswered would be no refusal anyone could act on.
    """
    try:
        outcome = outsider.run(send(outsider, swarm.peer_ids[a.stage], a.data))
    except (TimeoutError, asyncio.TimeoutError):
        pytest.fail(f"stage {a.stage} did not answer within {ANSWER_TIMEOUT_S} s: {a.data[:96]!r}")
    assert outcome.seconds < ANSWER_TIMEOUT_S
    reply = outcome.reply
    assert reply is not None, f"stage {a.stage} closed the stream unanswered: {a.data[:96]!r}"
    if reply.kind == "pong" and a.may_pong:
        return
    assert reply.kind == "error", f"{reply.kind} reply to {a.data[:96]!r}"
    assert reply.error_cause() in REFUSALS, f"{reply.error_cause()}: {reply.error_text()} for {a.data[:96]!r}"


def ping(outsider: Outsider, swarm, stage: int) -> Frame:
    frame = Frame(kind="ping", run_id=RUN, stage=stage)
    return outsider.run(
        outsider.transport.call(swarm.peer_ids[stage], handler_name(RUN), frame, timeout_s=10)
    )


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_attempt_is_refused_and_the_peers_live_on(swarm, outsider, name):
    tried = []

    @FUZZ
    @given(a=STRATEGIES[name])
    def fuzz(a: Attempt) -> None:
        attempt(outsider, swarm, a)
        tried.append(a)

    for known in REGRESSIONS.get(name, ()):  # what this fuzzing found once, tried every run
        fuzz = example(a=known)(fuzz)
    fuzz()
    assert len(tried) >= EXAMPLES
    for stage, proc_name in enumerate(swarm.stage_names):
        assert swarm.procs[proc_name].poll() is None, swarm.log_tail(proc_name)
        assert ping(outsider, swarm, stage).kind == "pong"


def test_a_payload_that_never_comes_costs_a_read_timeout_not_the_peer(swarm, outsider):
    """Streams whose headers promise payloads that never (wholly) arrive: while they hang,
    both peers answer pings; each hanging stream is refused once the read timeout passes."""

    async def promise(stage: int, sent: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        frame = encoded(Frame(kind="state_data", run_id=RUN, stage=stage, tensors={"w": torch.zeros(2**16)}))
        header_end = PREFIX.size + PREFIX.unpack(frame[: PREFIX.size])[1]
        reader, writer = await open_stream(outsider, swarm.peer_ids[stage])
        writer.write(frame[: header_end + sent])  # the header promises 256 KiB; `sent` bytes come
        await writer.drain()
        return reader, writer

    async def scenario():
        streams = [await promise(stage, sent) for stage in range(NUM_STAGES) for sent in (0, 1000)]
        started = time.monotonic()
        pongs = [
            await outsider.transport.call(
                swarm.peer_ids[k], handler_name(RUN), Frame(kind="ping", run_id=RUN, stage=k), timeout_s=5
            )
            for k in range(NUM_STAGES)
        ]
        replies = [await asyncio.wait_for(read_frame(r), ANSWER_TIMEOUT_S) for r, _ in streams]
        waited = time.monotonic() - started
        for _, w in streams:
            w.close()
        return pongs, replies, waited

    pongs, replies, waited = outsider.run(scenario(), timeout_s=ANSWER_TIMEOUT_S + 10)
    assert [p.kind for p in pongs] == ["pong"] * NUM_STAGES
    for reply in replies:  # the header came, the payload did not: a stall mid-frame (a strike)
        assert reply.kind == "error" and reply.error_cause() == Cause.UNREACHABLE, reply.meta
        assert f"arrived, then none for {READ_TIMEOUT_S} s" in reply.error_text(), reply.error_text()
    assert waited < ANSWER_TIMEOUT_S


def test_after_the_attack_no_traceback_and_the_swarm_trains_as_without_it(swarm, outsider):
    for stage, name in enumerate(swarm.stage_names):
        assert swarm.procs[name].poll() is None, swarm.log_tail(name)
        assert ping(outsider, swarm, stage).kind == "pong"
        log = (swarm.log_dir / f"{name}.log").read_text(errors="replace")
        assert "bad frame from" in log, log[-4000:]  # this is where the peer logs the attack
        assert "Traceback" not in log, log[-4000:]
        assert "internal error" not in log and "handler failed" not in log, log[-4000:]

    def batches():
        return TokenBatches(stdlib_text(2**20), seq_len=T, microbatch_size=B, seed=SEED)

    results = assert_trains_like_the_reference(
        swarm,
        batches,
        steps=STEPS,
        seed=SEED,
        optimizer=OPTIMIZER,
        microbatches_per_step=BATCH.microbatches_per_step,
    )
    assert [r.step for r in results] == list(range(STEPS))
    assert all(r.replays == 0 and r.dropped == 0 for r in results), results
