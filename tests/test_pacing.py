"""Frames paced to the uplink (`--uplink-mbit`): slots in the order asked for, back to back at
the rate; over real libp2p streams, frames sent at once leave one after another."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarmtrain.transport import TensorTransport, TransportConfig, handler_name
from swarmtrain.transport.pacing import Pacer
from swarmtrain.wire.frames import Frame
from tests.conftest import p2p_pair

NAME = handler_name("run-1")


def test_slots_follow_each_other_at_the_rate_in_the_order_asked():
    pacer = Pacer(1000.0)  # bytes/s
    assert pacer.reserve(500, now=10.0) == 0.0  # an idle link: at once
    assert pacer.reserve(1000, now=10.0) == pytest.approx(0.5)  # after the first's 0.5 s
    assert pacer.reserve(10, now=10.2) == pytest.approx(1.3)  # after both (free at 11.5)
    assert pacer.reserve(10, now=20.0) == 0.0  # the link went idle meanwhile: no credit saved up
    assert pacer.reserve(10, now=20.0) == pytest.approx(0.01)


def test_a_rate_must_be_positive():
    with pytest.raises(ValueError, match="uplink rate must be > 0"):
        Pacer(0)
    with pytest.raises(ValueError, match="invalid transport limits"):
        TransportConfig(uplink_bytes_per_s=-1.0)


@pytest.mark.swarm
def test_frames_sent_at_once_leave_one_after_another_at_the_rate():
    # Three 40 kB requests called at once through a 200 kB/s pacer: each starts to leave only
    # when the one before has had its 0.2 s on the link, so the server sees them at least
    # 0.2 s apart (in the order their streams opened); unpaced, no pacer.
    numel, rate = 10_000, 200_000.0

    async def arrivals(config):
        async with p2p_pair() as (server, client):
            seen: list[tuple[str, float]] = []

            async def handler(frame: Frame, caller: str) -> Frame:
                seen.append((frame.mb_id, time.monotonic()))
                return Frame(kind="result", run_id=frame.run_id, mb_id=frame.mb_id, tensors={})

            served = TensorTransport(server)
            await served.serve(NAME, handler)
            caller = TensorTransport(client, config)
            peer = server.peer_id.to_base58()
            frames = [
                Frame(kind="forward", run_id="run-1", mb_id=f"mb{i}", tensors={"x": torch.full((numel,), float(i))})
                for i in range(3)
            ]
            await asyncio.gather(*(caller.call(peer, NAME, f, timeout_s=30) for f in frames))
            return seen, caller.pacer

    seen, pacer = asyncio.run(arrivals(TransportConfig(uplink_bytes_per_s=rate)))
    assert sorted(mb for mb, _ in seen) == ["mb0", "mb1", "mb2"]
    slot = 4 * numel / rate
    gaps = [b - a for (_, a), (_, b) in zip(seen, seen[1:])]
    assert min(gaps) >= 0.9 * slot, gaps
    assert pacer.waited_s >= 0.9 * 3 * slot  # the second waited one slot, the third two

    _, unpaced = asyncio.run(arrivals(TransportConfig()))
    assert unpaced is None
