"""Memory a peer's requests hold on the served side: committed as bytes arrive (never on a
header's promise), charged to the sender's budget, freed once answered; a frame that stalls
half-sent is a strike, a sender over its budget is refused."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID

from swarmtrain.errors import BadFrameError, Cause, RemoteError
from swarmtrain.transport import TensorTransport, TransportConfig, handler_name
from swarmtrain.transport.budget import PeerBudget
from swarmtrain.wire.frames import MAGIC, MAX_HEADER_BYTES, PREFIX, Frame, read_frame
from tests.conftest import p2p_pair

NAME = handler_name("run-1")
MiB = 2**20

# pure: the budget and its config


def test_budget_charges_per_peer_refuses_past_the_limit_and_releases():
    budget = PeerBudget(100)
    a, b = budget.hold("a"), budget.hold("b")
    a.charge(60)
    b.charge(100)  # another peer's bytes count against its own limit only
    with pytest.raises(BadFrameError, match="would hold 101 bytes, over the limit of 100 bytes per peer"):
        a2 = budget.hold("a")
        a2.charge(41)
    assert (budget.held("a"), a2.nbytes, budget.total_bytes) == (
        60,
        0,
        160,
    )  # the refused charge counts nothing
    a2.charge(40)
    with a:
        pass
    assert budget.held("a") == 40 and a.nbytes == 0
    a2.release()
    b.release()
    assert (budget.held("a"), budget.held("b"), budget.total_bytes, budget.peak_bytes) == (0, 0, 0, 200)


def test_the_default_budget_holds_four_of_the_largest_frames_and_a_smaller_one_is_refused():
    largest = MiB + PREFIX.size + MAX_HEADER_BYTES
    assert TransportConfig(max_frame_bytes=MiB).max_peer_bytes_in_flight == 4 * largest
    assert (
        TransportConfig(max_frame_bytes=MiB, max_peer_bytes_in_flight=largest).max_peer_bytes_in_flight
        == largest
    )
    with pytest.raises(ValueError, match=f"less than one of the largest frames \\({largest} bytes"):
        TransportConfig(max_frame_bytes=MiB, max_peer_bytes_in_flight=largest - 1)


# real streams


async def echo(frame: Frame, _peer: str) -> Frame:
    return Frame(kind="result", run_id=frame.run_id, tensors={"n": torch.tensor([frame.wire_nbytes])})


def promise(payload_bytes: int) -> bytes:
    """A valid prefix and header for a frame of one uint8 tensor of `payload_bytes` bytes."""
    spec = ["x", "uint8", [payload_bytes], "none", payload_bytes]
    header = {
        "kind": "forward",
        "run": "run-1",
        "mb": "",
        "stage": -1,
        "step": -1,
        "tensors": [spec],
        "meta": {},
    }
    raw = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, len(raw), payload_bytes) + raw


async def open_raw(client: P2P, server: P2P):
    _info, reader, writer = await client.call_binary_stream_handler(
        PeerID.from_base58(server.peer_id.to_base58()), NAME
    )
    return reader, writer


POLL_S = 0.01
"""How often `until` looks again."""


async def until(condition, *, what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` on the event loop until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_S)


@pytest.mark.swarm
def test_a_header_promising_200_mib_commits_only_what_arrives_and_its_stall_is_a_strike():
    promised, sent = 200 * MiB, 3 * MiB
    head = promise(promised)

    async def go():
        async with p2p_pair() as (server, client):
            served = TensorTransport(server, TransportConfig(read_timeout_s=3.0))
            await served.serve(NAME, echo)
            tracemalloc.start()
            try:
                silent_reader, silent_writer = await open_raw(client, server)  # opens and sends nothing
                reader, writer = await open_raw(client, server)
                writer.write(head + bytes(sent))
                await writer.drain()
                replies = await asyncio.gather(
                    asyncio.wait_for(read_frame(reader), 30), asyncio.wait_for(read_frame(silent_reader), 30)
                )
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            writer.close()
            silent_writer.close()
            return served, replies, peak, client.peer_id.to_base58()

    served, (stalled, silent), peak, client_id = asyncio.run(go())
    # the served side held the header and the 3 MiB that came, never the 200 MiB promised
    assert served.budget.peak_bytes == len(head) + sent
    assert peak < 32 * MiB, f"{peak / MiB:.0f} MiB traced at the peak"
    assert served.budget.total_bytes == 0  # freed once answered
    assert stalled.error_cause() == Cause.UNREACHABLE
    assert (
        f"frame stalled: {len(head) + sent} bytes of it arrived, then none for 3.0 s" in stalled.error_text()
    )
    # a stream that never began a frame costs nothing and is no strike; the stalled frame is one
    assert "request did not arrive within 3.0 s" in silent.error_text()
    assert served.strikes(client_id) == 1


@pytest.mark.swarm
def test_a_peer_over_its_budget_is_refused_with_a_strike_until_its_requests_are_answered():
    largest = MiB + PREFIX.size + MAX_HEADER_BYTES
    config = TransportConfig(max_frame_bytes=MiB, max_peer_bytes_in_flight=largest, read_timeout_s=60)
    head, half = promise(MiB), MiB // 2
    x = torch.zeros(MiB, dtype=torch.uint8)

    async def go():
        async with p2p_pair() as (server, client):
            served = TensorTransport(server, config)
            await served.serve(NAME, echo)
            caller, client_id = TensorTransport(client), client.peer_id.to_base58()
            # one request half sent holds half a frame of the budget...
            reader, writer = await open_raw(client, server)
            writer.write(head + bytes(half))
            await writer.drain()
            await until(lambda: served.budget.held(client_id) == len(head) + half, what="the half frame")
            # ... so a whole frame more is refused as it arrives
            with pytest.raises(RemoteError) as refused:
                await caller.call(
                    served.peer_id,
                    NAME,
                    Frame(kind="forward", run_id="run-1", tensors={"x": x}),
                    timeout_s=30,
                )
            strikes = served.strikes(client_id)
            writer.close()  # the half-sent request ends (its stream breaks) and frees its bytes
            await until(lambda: served.budget.held(client_id) == 0, what="the budget's release")
            reply = await caller.call(
                served.peer_id, NAME, Frame(kind="forward", run_id="run-1", tensors={"x": x}), timeout_s=30
            )
            return served, refused.value, strikes, reply, client_id

    served, refused, strikes, reply, client_id = asyncio.run(go())
    assert refused.cause == Cause.BAD_FRAME and refused.retryable is False
    assert f"over the limit of {largest} bytes per peer" in str(refused)
    assert strikes == 1
    assert reply.tensors["n"].item() == MiB  # once the first request is gone, a whole frame fits
    assert served.budget.peak_bytes <= largest and served.budget.total_bytes == 0
