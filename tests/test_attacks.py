"""The attacks an outsider who reached the swarm tried, each against real peer processes:
none succeeds, each gets a clear refusal, and the run trains to the losses it trains to
without them.

The outsider joins the DHT as any peer can (an open swarm) and speaks well-formed frames:
- poison: commit phases and 1e30 gradients in a stage's exchange;
- hijack: forward frames under the trainer's microbatch ids, with its own data;
- stall and split: abort, prepare and apply on one stage;
- read: a state download;
- a peer record that claims a step far ahead, to draw replicas into resyncing from it;
- memory on a promise: headers promising 200 MiB payloads that never come;
- a forged manifest that names code for joining peers to import.
"""

import asyncio
import subprocess

import pytest
import torch

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.peers.launcher import cli_command
from swarmtrain.swarm import SwarmNode
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.wire.frames import PREFIX, Frame, encode_frame
from swarmtrain.wire.messages import Abort, Apply, Exchange, GradsMeta, Prepare
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, PeerRecord, RunManifest
from tests.conftest import TINY_GPT, assert_trains_like_the_reference, wait_until

pytestmark = pytest.mark.swarm

RUN = "attacks"
SEED = 5
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=2, max_in_flight=2)
B, T, C = BATCH.microbatch_size, TINY_GPT["seq_len"], TINY_GPT["d_model"]
STEPS = 4


def batches():
    return TokenBatches(stdlib_text(2**20), seq_len=T, microbatch_size=B, seed=SEED)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig

    config = LocalSwarmConfig(
        run_id=RUN,
        model_config=TINY_GPT,
        num_stages=2,
        seed=SEED,
        optimizer=OPTIMIZER,
        batch=BATCH,
        log_dir=str(tmp_path_factory.mktemp("attacks")),
    )
    with LocalSwarm(config) as swarm:
        swarm.spawn_stage(1)  # stage 1 on two replicas: there is an exchange to poison
        swarm.stage_peers = {
            name: swarm.wait_ready(name) for name in sorted(swarm.procs) if name.startswith("stage")
        }
        with swarm.trainer() as trainer:
            swarm.trainer_id = trainer.node.peer_id
        yield swarm


def stage_peers(swarm, stage: int) -> list[str]:
    return [pid for name, pid in swarm.stage_peers.items() if name.startswith(f"stage{stage}-")]


async def as_outsider(swarm, fn):
    """Run `fn(node, transport)` as a fresh outsider: its own identity, joined to the DHT."""
    node = SwarmNode(swarm.node_config())
    try:
        return await fn(node, TensorTransport(await node.p2p(), swarm_key=node.swarm_key))
    finally:
        await node.close_p2p()
        node.shutdown()


async def refused(transport, peer: str, frame: Frame, match: str) -> RemoteError:
    """Send `frame`; it must be refused as unauthorized (saying `match`), or, once the outsider
    has its three strikes there, because the peer bans it."""
    with pytest.raises(RemoteError, match=f"{match}|bans you for another") as info:
        await transport.call(peer, handler_name(RUN), frame, timeout_s=30)
    return info.value


def assert_refused_then_banned(errors: list[RemoteError], strikes: int = 3) -> None:
    causes = [e.cause for e in errors]
    assert causes[:strikes] == [Cause.UNAUTHORIZED] * strikes, errors
    assert set(causes[strikes:]) <= {Cause.UNAUTHORIZED, Cause.BANNED}, errors
    assert all(not e.retryable for e in errors), errors


def step_frame(stage: int, meta: dict) -> Frame:
    return Frame(kind="step", run_id=RUN, stage=stage, step=0, meta=meta)


def test_an_outsiders_commit_phases_exchange_and_state_download_are_refused(swarm):
    async def commit_phases(node, transport):
        errors = []
        for stage in (0, 1):
            peer = stage_peers(swarm, stage)[0]
            for phase in (
                Prepare(),
                Exchange(fresh=(), take=(), group=(node.peer_id, peer), attempt=0),
                Apply(grad_scale=1.0),
                Abort(),
            ):
                frame = step_frame(stage, phase.to_meta())
                errors.append(
                    await refused(transport, peer, frame, "not a trainer this run's owner authorized")
                )
        return errors

    async def poison_and_read(node, transport):
        poison = {str(i): torch.full((4,), 1e30) for i in range(3)}
        grads = Frame(kind="grads", run_id=RUN, stage=1, step=0, tensors=poison, meta=GradsMeta().to_meta())
        state = Frame(kind="state", run_id=RUN, stage=1, step=0)
        return [
            await refused(transport, stage_peers(swarm, 1)[1], grads, "only its replicas exchange gradients"),
            await refused(transport, stage_peers(swarm, 1)[0], state, "only they may download its state"),
        ]

    errors = asyncio.run(as_outsider(swarm, commit_phases))
    assert_refused_then_banned(errors[:4])  # stage 0: three strikes, then banned
    assert_refused_then_banned(errors[4:])  # stage 1 likewise
    assert Cause.BANNED in {e.cause for e in errors}
    errors = asyncio.run(as_outsider(swarm, poison_and_read))  # a fresh outsider
    assert [e.cause for e in errors] == [Cause.UNAUTHORIZED] * 2, errors


def test_forward_frames_under_the_trainers_ids_are_refused(swarm):
    async def attack(node, transport):
        x, targets = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T))
        errors = []
        for step in range(3):  # the next steps' ids, before the trainer sends them
            mb = f"{swarm.trainer_id}:{step}.0:0"
            frame = Frame(
                kind="forward",
                run_id=RUN,
                mb_id=mb,
                stage=0,
                step=step,
                tensors={"x": x, "targets": targets},
                meta={"loss_scale": 0.5, "budget_s": 20.0},
            )
            errors.append(
                await refused(transport, stage_peers(swarm, 0)[0], frame, "only they may send microbatches")
            )
        downstream = Frame(
            kind="forward",
            run_id=RUN,
            mb_id=f"{swarm.trainer_id}:0.0:1",
            stage=1,
            step=0,
            tensors={"x": torch.randn(B, T, C), "targets": targets},
            meta={"loss_scale": 0.5, "budget_s": 20.0},
        )
        errors.append(
            await refused(transport, stage_peers(swarm, 1)[0], downstream, "is not a replica of stage 0")
        )
        return errors

    errors = asyncio.run(as_outsider(swarm, attack))
    assert_refused_then_banned(errors[:3])  # stage 0: its three microbatches, then banned
    assert errors[3].cause == Cause.UNAUTHORIZED, errors  # stage 1 had not struck it yet


def test_headers_promising_payloads_that_never_come_hold_no_memory(swarm):
    victim = stage_peers(swarm, 1)[0]
    pid = next(p.pid for name, p in swarm.procs.items() if swarm.stage_peers.get(name) == victim)

    def rss_mib() -> float:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    async def attack(node, transport):
        from hivemind.p2p import PeerID

        big = Frame(kind="forward", run_id=RUN, mb_id=f"{node.peer_id}:0.0:0", stage=1, step=0,
                    tensors={"x": torch.zeros(50 * 2**20)})  # fmt: skip
        prefix, header = encode_frame(big)[:2]
        promise = bytes(prefix) + bytes(header)
        assert PREFIX.unpack(promise[: PREFIX.size])[2] >= 200 * 2**20
        del big
        before = rss_mib()
        streams = []
        for _ in range(6):
            _, reader, writer = await transport.p2p.call_binary_stream_handler(
                PeerID.from_base58(victim), handler_name(RUN)
            )
            writer.write(promise)  # a valid prefix and header; the 200 MiB never follow
            await writer.drain()
            streams.append(writer)
        # The peer still answers others at once, and holds no promised memory.
        pong = await transport.call(victim, handler_name(RUN), Frame(kind="ping", run_id=RUN), timeout_s=10)
        grown = rss_mib() - before
        for writer in streams:
            writer.close()
        return pong, grown

    pong, grown_mib = asyncio.run(as_outsider(swarm, attack))
    assert pong.kind == "pong"
    assert grown_mib < 100, f"the peer grew by {grown_mib:.0f} MiB on 6 x 200 MiB promises"


def test_a_forged_step_draws_no_resync_and_a_forged_manifest_runs_no_code(swarm, tmp_path):
    forger = SwarmNode(swarm.node_config())
    try:
        record = PeerRecord(peer_id=forger.peer_id, role="stage", stage=1, step=10**6, since=0.0)
        # a node just started may find no DHT peer to store on yet: poll until the store lands
        wait_until(
            lambda: forger.announce(RUN, record, ttl_s=120), timeout_s=30, what="the forged record stored"
        )
        evil = RunManifest(
            run_id="evil",
            model="os:system",
            model_config={"command": f"touch {tmp_path / 'pwned'}"},
            num_blocks=2,
            stage_bounds=(0, 1, 2),
        )
        forger.publish_manifest(evil, ttl_s=120)
        # Its own manifest for our run id too: peers joining through the coordinator ignore it.
        forger.publish_manifest(
            RunManifest(run_id=RUN, model="os:system", num_blocks=2, stage_bounds=(0, 1, 2)), ttl_s=120
        )
        joined = subprocess.run(
            cli_command("join", "--initial-peers", swarm.address, "--run-id", "evil", "--gpu", "cpu"),
            capture_output=True,
            text=True,
            timeout=120,
            env=swarm._env(),
        )
        assert joined.returncode == 2, joined.stderr
        assert "--allow-model" in joined.stderr and "os:system" in joined.stderr
        assert not (tmp_path / "pwned").exists()

        # Training goes on to the losses of an unattacked run, and no replica resynced from the forger.
        assert_trains_like_the_reference(
            swarm,
            batches,
            steps=STEPS,
            seed=SEED,
            optimizer=OPTIMIZER,
            microbatches_per_step=BATCH.microbatches_per_step,
        )
        for name in swarm.stage_peers:
            assert "resyncing" not in (swarm.log_dir / f"{name}.log").read_text(), name
    finally:
        forger.shutdown()
