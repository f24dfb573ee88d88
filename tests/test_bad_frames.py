"""A live stage peer faced with bad frames: each gets a precise error reply, the sender is
banned after repeated offences, and the swarm keeps training. The sender is a peer the run
lets send them (a member of stage 0, under its own microbatch ids: the run is open, so any
peer counts as its trainer); an outsider's frame is refused before it is read."""

import asyncio
import dataclasses

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.train.authority import microbatch_id
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.trust.identity import Identity
from swarmtrain.trust.records import sign_record
from swarmtrain.wire.frames import PREFIX, Frame, read_frame
from swarmtrain.wire.keys import peers_key
from swarmtrain.wire.records import BatchConfig, PeerRecord
from tests.conftest import TINY_GPT

pytestmark = pytest.mark.swarm

BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=2, max_in_flight=2)
B, T, C = 4, TINY_GPT["seq_len"], TINY_GPT["d_model"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig

    config = LocalSwarmConfig(
        run_id="frames",
        model_config=TINY_GPT,
        num_stages=2,
        batch=BATCH,
        log_dir=str(tmp_path_factory.mktemp("s")),
        num_trainers=len(BAD_FRAMES) + 2,  # a client of its own per case: one strike each
    )
    with LocalSwarm(config) as swarm:
        swarm.peer_ids = [swarm.wait_ready(name) for name in sorted(swarm.procs) if name.startswith("stage")]
        # A second stage-1 peer with a 1 MiB frame limit, standing by, for the size test.
        small = swarm.spawn_stage(1, extra_args=("--max-frame-mb", "1"))
        swarm.small_limit_peer = swarm.wait_ready(small)
        announce_trainers_as_members(swarm)
        yield swarm


def announce_trainers_as_members(swarm) -> None:
    """Put a signed record of each authorized trainer as a (joining) member of stage 0 in the
    DHT, as a new stage peer announces itself: so what the test clients send either stage
    passes authorization and meets the checks of the frame itself. Stored once, up front, so
    the stage peers' view holds them all before the first case."""
    node = SwarmNode(swarm.node_config())
    try:
        expires = get_dht_time() + 600
        for n in range(swarm.config.num_trainers):
            who = Identity.load(swarm.trainer_identity(n))
            body = PeerRecord(peer_id=who.peer_id, role="stage", stage=0, state="joining").to_dict()
            envelope = sign_record(who, peers_key("frames"), body, expires)
            assert node.dht.store(peers_key("frames"), envelope, expires, subkey=who.peer_id)
    finally:
        node.shutdown()


def forward(stage: int, x, targets, run_id="frames", **meta) -> Frame:
    meta = {"loss_scale": 0.5, "budget_s": 20.0} | meta
    return Frame(
        kind="forward",
        run_id=run_id,
        mb_id="t:0:0",
        stage=stage,
        step=0,
        tensors={"x": x, "targets": targets},
        meta=meta,
    )


def good_targets():
    return torch.randint(0, 256, (B, T))


async def with_client(swarm, fn, *, member: bool = True, trainer: int | None = None):
    """`fn(transport)` from a fresh peer (with `member`, one that announces itself a member of
    stage 0), or as the run's `trainer`-th authorized trainer (a member of stage 0 already)."""
    identity = None if trainer is None else swarm.trainer_identity(trainer)
    node = SwarmNode(NodeConfig(initial_peers=(swarm.address,), identity_path=identity and str(identity)))
    try:
        if member and trainer is None:
            record = PeerRecord(peer_id=node.peer_id, role="stage", stage=0, state="joining")
            await node.announce_async("frames", record, ttl_s=300)
        transport = TensorTransport(await node.p2p())
        return await fn(transport)
    finally:
        await node.close_p2p()
        node.shutdown()


BAD_FRAMES = {  # case: (stage peer it is sent to, frame, what the error must say, its cause)
    "wrong trailing shape": (1, forward(1, torch.randn(B, T, C + 1), good_targets()), r"shape \(4, 16, 33\).*expects \('B', 16, 32\)", Cause.BAD_FRAME),
    "wrong dtype": (1, forward(1, torch.randn(B, T, C).half(), good_targets()), r"dtype torch.float16.*expects torch.float32", Cause.BAD_FRAME),
    "batch too large": (1, forward(1, torch.randn(B + 1, T, C), torch.randint(0, 256, (B + 1, T))), r"batch 5.*1\.\.4", Cause.BAD_FRAME),
    "NaN activations": (1, forward(1, torch.full((B, T, C), float("nan")), good_targets()), r"NaN or inf", Cause.BAD_FRAME),
    "inf activations": (1, forward(1, torch.full((B, T, C), float("inf")), good_targets()), r"NaN or inf", Cause.BAD_FRAME),
    "absurd activations": (1, forward(1, torch.full((B, T, C), 1e30), good_targets()), r"input activations of stage 1 out of bounds: its norm is not finite", Cause.BAD_FRAME),
    "token out of range": (0, forward(0, torch.full((B, T), 999), good_targets()), r"an index in microbatch .* is out of range", Cause.BAD_FRAME),
    "missing targets": (1, Frame(kind="forward", run_id="frames", stage=1, step=0, tensors={"x": torch.randn(B, T, C)}, meta={"loss_scale": 0.5, "budget_s": 20.0}), r"missing loss input 'targets'", Cause.BAD_FRAME),
    "no input": (1, Frame(kind="forward", run_id="frames", stage=1, step=0, tensors={"targets": good_targets()}, meta={"loss_scale": 0.5, "budget_s": 20.0}), r"needs its input tensor 'x'", Cause.BAD_FRAME),
    "another run's id": (1, forward(1, torch.randn(B, T, C), good_targets(), run_id="other"), r"serves run 'frames', not 'other'", Cause.WRONG_RUN),
    "stage out of range": (1, forward(5, torch.randn(B, T, C), good_targets()), r"serves stage 1, not 5", Cause.BAD_FRAME),
    "bad loss scale": (1, forward(1, torch.randn(B, T, C), good_targets(), loss_scale=7.0), r"'loss_scale' must be a number in \(0, 1\]", Cause.BAD_FRAME),
    "route as a string": (1, forward(1, torch.randn(B, T, C), good_targets(), prefer="QmA QmB"), r"'prefer' must be a list of strings", Cause.BAD_FRAME),
    "unknown meta": (1, forward(1, torch.randn(B, T, C), good_targets(), route=["a", "b"]), r"unknown fields \['route'\]", Cause.BAD_FRAME),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_each_bad_frame_gets_a_precise_error_reply(swarm, case):
    stage, frame, pattern, cause = BAD_FRAMES[case]

    async def send(transport):
        own = dataclasses.replace(frame, mb_id=microbatch_id(transport.peer_id, 0, 0, 0))
        with pytest.raises(RemoteError, match=pattern) as info:
            await transport.call(swarm.peer_ids[stage], handler_name("frames"), own, timeout_s=30)
        return info.value

    error = asyncio.run(with_client(swarm, send, trainer=1 + list(BAD_FRAMES).index(case)))
    assert error.retryable is False and error.cause == cause


def test_an_outsiders_forward_is_refused_before_it_is_read(swarm):
    frame = forward(1, torch.randn(B, T, C), good_targets())

    async def send(transport):
        own = dataclasses.replace(frame, mb_id=microbatch_id(transport.peer_id, 0, 0, 0))
        with pytest.raises(RemoteError, match="is not a replica of stage 0") as info:
            await transport.call(swarm.peer_ids[1], handler_name("frames"), own, timeout_s=30)
        return info.value

    error = asyncio.run(with_client(swarm, send, member=False))
    # only the membership refuses it: for a while that may be our view lagging a newcomer, so it
    # is refused without a strike and may ask again (authority.UNKNOWN_PEER_GRACE_S)
    assert error.retryable is True and error.cause == Cause.UNAUTHORIZED
    assert "it may not have the caller yet" in str(error)


def test_garbage_bytes_and_oversized_frames_are_refused_before_reading_them(swarm):
    async def send(transport):
        p2p = transport.p2p
        # Not a frame at all.
        _, reader, writer = await p2p.call_binary_stream_handler(
            PeerID.from_base58(swarm.peer_ids[1]), handler_name("frames")
        )
        writer.write(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        await writer.drain()
        garbage_reply = await asyncio.wait_for(read_frame(reader), 30)
        writer.close()
        # A prefix announcing 2 MiB to a peer whose limit is 1 MiB: answered without the payload.
        _, reader, writer = await p2p.call_binary_stream_handler(
            PeerID.from_base58(swarm.small_limit_peer), handler_name("frames")
        )
        writer.write(PREFIX.pack(b"STF1", 10, 2 * 2**20))
        await writer.drain()
        oversized_reply = await asyncio.wait_for(read_frame(reader), 30)
        writer.close()
        return garbage_reply, oversized_reply

    garbage, oversized = asyncio.run(with_client(swarm, send))
    assert garbage.kind == "error" and "not a swarmtrain frame" in garbage.error_text()
    assert oversized.kind == "error" and "exceeds the limit of 1048576 bytes" in oversized.error_text()


def test_repeat_offender_is_banned_and_the_swarm_keeps_training(swarm):
    bad = forward(1, torch.randn(B, T, C).half(), good_targets())
    good_shape = forward(1, torch.randn(B, T, C), good_targets())

    async def offend(transport):
        peer, name = swarm.peer_ids[1], handler_name("frames")
        bad.mb_id = good_shape.mb_id = microbatch_id(transport.peer_id, 0, 0, 0)
        for _ in range(3):
            with pytest.raises(RemoteError, match="dtype"):
                await transport.call(peer, name, bad, timeout_s=30)
        with pytest.raises(RemoteError, match=r"bans you for another \d+ s"):
            await transport.call(peer, name, good_shape, timeout_s=30)

    asyncio.run(with_client(swarm, offend, trainer=1 + len(BAD_FRAMES)))

    with swarm.trainer() as trainer:
        data = TokenBatches(stdlib_text(2**20), seq_len=T, microbatch_size=B, seed=0)
        results = list(trainer.train(data, steps=3))
    assert [r.step for r in results] == [0, 1, 2]
    assert all(r.replays == 0 and 0 < r.loss < 10 for r in results)
