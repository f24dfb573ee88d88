"""Calls reuse their streams: a stream goes back to a pool after its reply and carries the next
call to the same peer and handler; calls in flight at once never share one; a call that fails
or times out closes its stream; the served side answers a stream's requests in turn and
still strikes and bans per request. Two real libp2p daemons on loopback, in-process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.errors import Cause, PeerUnreachableError, RemoteError
from swarmtrain.transport import TensorTransport, TransportConfig, handler_name
from swarmtrain.transport import streams as streams_module
from swarmtrain.trust.swarmkey import generate_swarm_key
from swarmtrain.wire.frames import MAGIC, PREFIX, Frame, error_frame
from tests.conftest import p2p_pair

pytestmark = pytest.mark.swarm

NAME = handler_name("run-1")


def request(i: int, *, numel: int = 4) -> Frame:
    return Frame(
        kind="forward", run_id="run-1", mb_id=f"mb{i}", tensors={"x": torch.full((numel,), float(i))}
    )


class Echo:
    """Answers each request with its tensor; counts requests; can hold one back or refuse one."""

    def __init__(self):
        self.requests = 0
        self.hold: asyncio.Event | None = None
        self.hold_mb: str | None = None

    async def __call__(self, frame: Frame, caller: str) -> Frame:
        self.requests += 1
        if frame.mb_id == self.hold_mb:
            await self.hold.wait()
        if frame.mb_id == "refuse":
            return error_frame(frame.run_id, "refused on purpose", cause=Cause.DRAINING)
        return Frame(kind="result", run_id=frame.run_id, mb_id=frame.mb_id, tensors=dict(frame.tensors))


def run(scenario, *, server_config=None, client_config=None, key=None):
    async def go():
        async with p2p_pair() as (server, client):
            served = TensorTransport(server, server_config, swarm_key=key)
            echo = Echo()
            await served.serve(NAME, echo)
            caller = TensorTransport(client, client_config, swarm_key=key)
            return await scenario(served, caller, echo, server.peer_id.to_base58())

    return asyncio.run(go())


def test_sequential_calls_share_one_stream_and_each_gets_its_own_reply():
    async def scenario(served, caller, echo, peer):
        replies = [await caller.call(peer, NAME, request(i), timeout_s=10) for i in range(6)]
        return replies, caller.streams_opened, echo.requests

    replies, opened, served = run(scenario)
    assert [r.mb_id for r in replies] == [f"mb{i}" for i in range(6)]
    assert [r.tensors["x"][0].item() for r in replies] == [float(i) for i in range(6)]
    assert (opened, served) == (1, 6)


def test_without_reuse_every_call_opens_a_stream():
    async def scenario(served, caller, echo, peer):
        for i in range(4):
            await caller.call(peer, NAME, request(i), timeout_s=10)
        return caller.streams_opened

    assert run(scenario, client_config=TransportConfig(reuse_streams=False)) == 4


def test_calls_in_flight_at_once_take_a_stream_each_then_reuse_them():
    async def scenario(served, caller, echo, peer):
        first = await asyncio.gather(*(caller.call(peer, NAME, request(i), timeout_s=10) for i in range(5)))
        opened_first = caller.streams_opened
        second = await asyncio.gather(
            *(caller.call(peer, NAME, request(10 + i), timeout_s=10) for i in range(5))
        )
        return first, second, opened_first, caller.streams_opened

    first, second, opened_first, opened = run(scenario)
    assert [r.mb_id for r in first] == [f"mb{i}" for i in range(5)]
    assert [r.mb_id for r in second] == [f"mb{10 + i}" for i in range(5)]
    assert opened_first == 5 and opened == 5  # the second round opened none


def test_a_call_that_times_out_closes_its_stream_and_its_late_reply_reaches_no_one():
    async def scenario(served, caller, echo, peer):
        echo.hold, echo.hold_mb = asyncio.Event(), "mb0"
        with pytest.raises(PeerUnreachableError, match="did not answer within"):
            await caller.call(peer, NAME, request(0), timeout_s=0.5)
        echo.hold.set()  # the held reply goes out now, into a stream the caller closed
        replies = [await caller.call(peer, NAME, request(i), timeout_s=10) for i in (1, 2)]
        return replies, caller.streams_opened

    replies, opened = run(scenario)
    assert [r.mb_id for r in replies] == ["mb1", "mb2"]
    assert opened == 2  # the timed-out stream was not reused


def test_an_error_reply_is_raised_and_its_stream_is_not_reused():
    async def scenario(served, caller, echo, peer):
        await caller.call(peer, NAME, request(0), timeout_s=10)
        with pytest.raises(RemoteError, match="refused on purpose"):
            await caller.call(peer, NAME, Frame(kind="forward", run_id="run-1", mb_id="refuse"), timeout_s=10)
        reply = await caller.call(peer, NAME, request(1), timeout_s=10)
        return reply, caller.streams_opened

    reply, opened = run(scenario)
    assert reply.mb_id == "mb1" and opened == 2


def test_a_stream_the_server_closed_while_idle_is_replaced_without_an_error(monkeypatch):
    server_config = TransportConfig()
    monkeypatch.setattr(streams_module, "SERVED_IDLE_S", 0.3)  # the server closes idle streams soon

    async def scenario(served, caller, echo, peer):
        await caller.call(peer, NAME, request(0), timeout_s=10)
        (stream,) = caller._idle[(peer, NAME)]
        await asyncio.wait_for(stream.reader.read(1), 10)  # the server closes it: EOF here
        reply = await caller.call(peer, NAME, request(1), timeout_s=10)
        return reply, caller.streams_opened

    reply, opened = run(
        scenario, server_config=server_config, client_config=TransportConfig(idle_stream_s=0.2)
    )
    assert reply.mb_id == "mb1" and opened == 2


def test_an_idle_stream_older_than_idle_stream_s_is_closed_not_reused():
    async def scenario(served, caller, echo, peer):
        await caller.call(peer, NAME, request(0), timeout_s=10)
        (stream,) = caller._idle[(peer, NAME)]
        stream.idle_since -= 31.0  # as if it had waited past the default idle_stream_s (30 s)
        await caller.call(peer, NAME, request(1), timeout_s=10)
        return stream.writer.is_closing(), caller.streams_opened

    closed, opened = run(scenario)
    assert closed and opened == 2


def test_a_private_swarm_handshakes_once_per_stream_not_once_per_call(tmp_path):
    key = generate_swarm_key(tmp_path / "swarm.key")

    async def scenario(served, caller, echo, peer):
        replies = [await caller.call(peer, NAME, request(i), timeout_s=10) for i in range(4)]
        return replies, caller.streams_opened

    replies, opened = run(scenario, key=key)
    assert [r.mb_id for r in replies] == [f"mb{i}" for i in range(4)] and opened == 1


def test_a_bad_frame_on_a_reused_stream_is_a_strike_and_the_server_drops_that_stream():
    async def scenario(served, caller, echo, peer):
        await caller.call(peer, NAME, request(0), timeout_s=10)
        (stream,) = caller._idle.pop((peer, NAME))
        # the same stream, now carrying garbage with a frame's magic: a malformed header
        stream.writer.write(PREFIX.pack(MAGIC, 3, 0) + b"\xff\xff\xff")
        await stream.writer.drain()
        from swarmtrain.wire.frames import read_frame

        refusal = await asyncio.wait_for(read_frame(stream.reader), 10)
        stream.writer.close()
        after = await caller.call(peer, NAME, request(1), timeout_s=10)
        return refusal, served.strikes(caller.peer_id), after

    refusal, strikes, after = run(scenario)
    assert refusal.kind == "error" and refusal.error_cause() == Cause.BAD_FRAME, refusal.meta
    assert strikes == 1 and after.mb_id == "mb1"


def test_a_peer_banned_mid_stream_is_refused_on_its_next_request_over_the_same_stream():
    async def scenario(served, caller, echo, peer):
        await caller.call(peer, NAME, request(0), timeout_s=10)
        for _ in range(served.config.max_strikes):
            served.strike(caller.peer_id, "test")
        with pytest.raises(RemoteError, match="bans you") as refused:
            await caller.call(peer, NAME, request(1), timeout_s=10)
        return refused.value.cause, caller.streams_opened, echo.requests

    cause, opened, served_requests = run(scenario)
    assert cause == Cause.BANNED and opened == 1 and served_requests == 1


def test_idle_stream_s_must_be_shorter_than_the_served_idle_time():
    with pytest.raises(ValueError, match="invalid transport limits"):
        TransportConfig(idle_stream_s=streams_module.SERVED_IDLE_S)
    with pytest.raises(ValueError, match="invalid transport limits"):
        TransportConfig(idle_stream_s=0)
