"""A private swarm's streams over real hivemind P2P on 127.0.0.1: peers holding the same key
talk; a peer without it, or with another key, is refused with a clear error before the
served side reads any frame; a wrong proof is a strike, and repeated ones a ban."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch
from hivemind.p2p import P2P, PeerID

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.transport import TensorTransport, TransportConfig, handler_name
from swarmtrain.transport.handshake import CHALLENGE, HELLO, MAGIC_BYTES, NONCE_BYTES, TAG_BYTES
from swarmtrain.trust.swarmkey import SwarmKey
from swarmtrain.wire.frames import Frame, encode_frame, read_frame
from tests.conftest import p2p_pair

pytestmark = pytest.mark.swarm

NAME = handler_name("run-1")
KEY, OTHER_KEY = SwarmKey(secrets.token_bytes(32)), SwarmKey(secrets.token_bytes(32))


class Doubler:
    """A served handler that answers x with 2x and remembers what it was asked."""

    def __init__(self):
        self.requests: list[Frame] = []

    async def __call__(self, frame: Frame, peer: str) -> Frame:
        self.requests.append(frame)
        return Frame(kind="result", run_id=frame.run_id, tensors={"y": frame.tensors["x"] * 2})


def request(x: torch.Tensor) -> Frame:
    return Frame(kind="forward", run_id="run-1", mb_id="t:0:0", tensors={"x": x})


async def serve(server: P2P, key: SwarmKey | None, config: TransportConfig | None = None):
    served, handler = TensorTransport(server, config, swarm_key=key), Doubler()
    await served.serve(NAME, handler)
    return served, handler


def test_peers_with_the_same_key_exchange_frames():
    xs = [torch.randn(4, 8), torch.randn(64, 1024)]  # a small frame and a 256 KiB one

    async def go():
        async with p2p_pair() as (server, client):
            served, handler = await serve(server, KEY)
            caller = TensorTransport(client, swarm_key=KEY)
            replies = [
                await caller.call(server.peer_id.to_base58(), NAME, request(x), timeout_s=30) for x in xs
            ]
            return served, handler, caller, replies

    served, handler, caller, replies = asyncio.run(go())
    assert [r.kind for r in replies] == ["result", "result"]
    for x, reply in zip(xs, replies, strict=True):
        assert torch.equal(reply.tensors["y"], x * 2)
    assert len(handler.requests) == 2 and caller.strikes(served.peer_id) == 0
    assert served.strikes(caller.peer_id) == 0
    assert served.bytes_received == caller.bytes_sent == sum(x.nbytes for x in xs)
    assert served.budget.total_bytes == 0 and served.budget.peak_bytes >= xs[1].nbytes


def test_a_peer_without_the_key_is_told_to_start_with_it():
    async def go():
        async with p2p_pair() as (server, client):
            served, handler = await serve(server, KEY)
            with pytest.raises(RemoteError) as info:
                await TensorTransport(client).call(
                    server.peer_id.to_base58(), NAME, request(torch.randn(2, 3)), timeout_s=30
                )
            return served, handler, info.value, client.peer_id.to_base58()

    served, handler, error, client_id = asyncio.run(go())
    assert error.cause == Cause.UNAUTHORIZED and error.retryable is False
    assert "belongs to a private swarm" in str(error)
    assert "--swarm-key FILE, the same file every peer of the swarm uses" in str(error)
    # refused on the frame's magic: nothing of the request was read, nor counted as a strike
    assert handler.requests == [] and served.bytes_received == 0 and served.budget.peak_bytes == 0
    assert served.strikes(client_id) == 0


def test_a_keyed_peer_calling_an_open_peer_learns_it_is_not_in_the_private_swarm():
    async def go():
        async with p2p_pair() as (server, client):
            served, handler = await serve(server, None)
            with pytest.raises(RemoteError) as info:
                await TensorTransport(client, swarm_key=KEY).call(
                    server.peer_id.to_base58(), NAME, request(torch.randn(2, 3)), timeout_s=30
                )
            return served, handler, info.value

    served, handler, error = asyncio.run(go())
    assert error.cause == Cause.UNAUTHORIZED
    assert "is not in your private swarm: it runs without --swarm-key" in str(error)
    assert handler.requests == [] and served.bytes_received == 0


def test_a_wrong_key_is_refused_with_a_strike_and_three_are_a_ban():
    async def go():
        async with p2p_pair() as (server, client):
            served, handler = await serve(server, KEY, TransportConfig(max_strikes=3, ban_s=60))
            caller, peer = TensorTransport(client, swarm_key=OTHER_KEY), server.peer_id.to_base58()
            errors, strikes = [], []
            for _ in range(3):
                with pytest.raises(RemoteError) as info:
                    await caller.call(peer, NAME, request(torch.randn(2, 3)), timeout_s=30)
                errors.append(info.value)
                strikes.append(served.strikes(caller.peer_id))
            with pytest.raises(RemoteError) as banned:
                await caller.call(peer, NAME, request(torch.randn(2, 3)), timeout_s=30)
            return served, handler, caller, errors, strikes, banned.value

    served, handler, caller, errors, strikes, banned = asyncio.run(go())
    for error in errors:  # the caller finds out first: the served side fails to prove our key
        assert error.cause == Cause.UNAUTHORIZED
        assert "is not in your private swarm: it does not hold your swarm key" in str(error)
        assert f"(fingerprint {OTHER_KEY.fingerprint})" in str(error)
    assert strikes == [1, 2, 0]  # the third strike bans, and starts the count again
    assert served.is_banned(caller.peer_id)
    assert banned.cause == Cause.BANNED and "bans you for another" in str(banned)
    assert handler.requests == [] and served.bytes_received == 0 and served.budget.peak_bytes == 0


async def raw_stream(client: P2P, server: P2P):
    _info, reader, writer = await client.call_binary_stream_handler(
        PeerID.from_base58(server.peer_id.to_base58()), NAME
    )
    return reader, writer


def test_garbage_in_place_of_a_hello_is_refused_before_any_frame_is_read():
    async def go():
        async with p2p_pair() as (server, client):
            served, handler = await serve(server, KEY)
            reader, writer = await raw_stream(client, server)
            writer.write(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
            await writer.drain()
            reply = await asyncio.wait_for(read_frame(reader), 30)
            writer.close()
            return served, handler, reply, client.peer_id.to_base58()

    served, handler, reply, client_id = asyncio.run(go())
    assert reply.kind == "error" and reply.error_cause() == Cause.BAD_FRAME
    assert "not a swarmtrain stream: it opens with b'GET '" in reply.error_text()
    assert served.strikes(client_id) == 1
    assert handler.requests == [] and served.bytes_received == 0 and served.budget.peak_bytes == 0


def test_a_frame_in_place_of_the_proof_is_refused_unread():
    """An opener that says hello, then skips the proof and sends its request frame: the frame's
    first bytes are taken for a proof, which fails; the frame itself is never read."""
    frame = request(torch.randn(256, 1024))  # 1 MiB

    async def go():
        async with p2p_pair() as (server, client):
            served, handler = await serve(server, KEY)
            reader, writer = await raw_stream(client, server)
            writer.write(HELLO + secrets.token_bytes(NONCE_BYTES))
            await writer.drain()
            challenge = await asyncio.wait_for(reader.readexactly(MAGIC_BYTES + NONCE_BYTES + TAG_BYTES), 30)
            for buf in encode_frame(frame):  # all of it: refused, the served side drops the rest
                writer.write(buf)
            await writer.drain()
            reply = await asyncio.wait_for(read_frame(reader), 30)
            writer.close()
            return served, handler, challenge, reply, client.peer_id.to_base58()

    served, handler, challenge, reply, client_id = asyncio.run(go())
    assert challenge.startswith(CHALLENGE)
    assert reply.kind == "error" and reply.error_cause() == Cause.UNAUTHORIZED
    assert "wrong proof of the private swarm's key" in reply.error_text()
    assert served.strikes(client_id) == 1
    assert handler.requests == [] and served.bytes_received == 0 and served.budget.peak_bytes == 0
