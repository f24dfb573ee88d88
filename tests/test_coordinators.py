"""Coordinators that join a swarm, as real processes on 127.0.0.1: a run started inside a swarm
whose only peer is a plain hivemind DHT node (no swarmtrain record validators), a second
coordinator that serves the owner's manifest instead of signing one of its own, and the owner's
key file refused while the owner runs but taken back after it died."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from swarmtrain.peers.launcher import cli_command
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.trust.identity import Identity
from swarmtrain.wire.keys import manifest_key
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, wait_until

pytestmark = pytest.mark.swarm

LR = 0.01
BARE_ADDRESS = re.compile(r"--initial_peers (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)")


@pytest.fixture
def bare_dht(tmp_path):
    """A plain `hivemind-dht` bootstrap node (hivemind's own CLI, no swarmtrain code); its address."""
    log = tmp_path / "bare-dht.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, HIVEMIND_LOGLEVEL="INFO"),
            start_new_session=True,
        )
    found = []

    def address() -> bool:
        found[:] = BARE_ADDRESS.findall(log.read_text(errors="replace"))
        return bool(found) or proc.poll() is not None

    wait_until(address, timeout_s=60, what="the plain DHT node's address")
    assert found, log.read_text()
    yield proc, found[0]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def signers_and_lr(address: str, run_id: str = "demo") -> tuple[set[str], float]:
    """Who signed a manifest of `run_id`, and the learning rate of the one a peer accepts."""
    node = SwarmNode(NodeConfig(initial_peers=(address,)))
    try:
        found = node.dht.get(manifest_key(run_id), latest=True)
        manifest = node.get_manifest(run_id)
        return set(found.value) if found is not None else set(), manifest.optimizer.lr
    finally:
        node.shutdown()


def coordinator_args(swarm, name: str, address: str, *, lr: float, identity=None) -> list[str]:
    """`swarmtrain coordinator` joining `address`, with run-shaping flags unlike the run's."""
    return [
        "coordinator",
        "--initial-peers", address,
        "--model-config", "n_layer=2,d_model=16,n_head=2,seq_len=8",
        "--stages", "1",
        "--lr", str(lr),
        "--host", "127.0.0.1",
        "--address-file", str(swarm.log_dir / f"{name}.address"),
        "--identity", str(identity or swarm.identity(name)),
    ]  # fmt: skip


def test_a_run_starts_in_a_plain_dht_swarm_and_any_coordinator_serves_the_owners_manifest(
    local_swarm, bare_dht
):
    bare, bare_address = bare_dht
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=2,
        optimizer=OptimizerConfig(name="adamw", lr=LR),
        batch=BatchConfig(microbatch_size=2, microbatches_per_step=2, max_in_flight=2),
        initial_peers=(bare_address,),
    )
    owner = Identity.load(swarm.identity("coordinator")).peer_id

    # A second coordinator, its own identity, other flags: it serves the owner's manifest.
    swarm.spawn("second", coordinator_args(swarm, "second", swarm.address, lr=0.5))
    second = swarm._wait_file("second", swarm.log_dir / "second.address")
    assert "serving its manifest as it is" in swarm.log_tail("second", 20)
    assert f"owner:        {owner}" in swarm.log_tail("second", 20)

    # The owner's key file while the owner runs: refused, in one line.
    taken = subprocess.run(
        cli_command(
            *coordinator_args(swarm, "taken", second, lr=0.5, identity=swarm.identity("coordinator"))
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert taken.returncode == 2, taken.stderr
    assert "already runs with identity" in taken.stderr and len(taken.stderr.strip().splitlines()) == 1

    # The owner and the bootstrap node die; the run goes on through the second coordinator.
    swarm.signal("coordinator", signal.SIGKILL)
    os.killpg(bare.pid, signal.SIGKILL)
    swarm.address = second
    with swarm.trainer() as trainer:
        (result,) = trainer.train(_batches(), steps=1)
    assert result.step == 0 and result.completed == 2

    # The owner comes back with its key file and other flags: it signs the same manifest again.
    again = coordinator_args(swarm, "owner-again", second, lr=0.5, identity=swarm.identity("coordinator"))
    swarm.spawn("owner-again", again)
    swarm._wait_file("owner-again", swarm.log_dir / "owner-again.address")
    assert "serving its manifest as it is" in swarm.log_tail("owner-again", 20)
    assert signers_and_lr(second) == ({owner}, LR)


def _batches():
    from swarmtrain.train.data import TokenBatches, stdlib_text

    return TokenBatches(stdlib_text(2**16), seq_len=TINY_GPT["seq_len"], microbatch_size=2, seed=0)
