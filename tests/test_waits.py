"""Waits a user can hit say what they wait for, show progress, and give up with the command
that would end them: a trainer whose run has no stage peer, on a real coordinator."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from swarmtrain.peers.trainer import Trainer, TrainerConfig
from swarmtrain.swarm import NodeConfig
from swarmtrain.train.committer import StepFailedError
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.trust.identity import Identity
from tests.conftest import wait_until

pytestmark = pytest.mark.swarm


def test_a_trainer_without_stage_peers_says_what_it_waits_for_and_how_to_end_it(
    tmp_path, caplog, monkeypatch
):
    import swarmtrain.peers.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "WAIT_NOTE_FIRST_S", 0.5)
    monkeypatch.setattr(trainer_module, "WAIT_NOTE_EVERY_S", 1.0)
    trainer_key = tmp_path / "trainer.key"
    address_file = tmp_path / "address"
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "swarmtrain.cli", "coordinator", "--run-id", "waits", "--stages", "2",
         "--model-config", "n_layer=2,d_model=32,n_head=2,seq_len=16", "--address-file", str(address_file),
         "--identity", str(tmp_path / "coordinator.key"), "--trainer", Identity.load(trainer_key).peer_id],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_until(
            lambda: address_file.exists() or coordinator.poll() is not None,
            timeout_s=120,
            what="the coordinator",
        )
        assert coordinator.poll() is None, coordinator.stderr.read().decode()[-2000:]
        address = address_file.read_text().strip()
        node = NodeConfig(initial_peers=(address,), identity_path=str(trainer_key))
        batches = TokenBatches(stdlib_text(2**16), seq_len=16, microbatch_size=2, seed=0)
        config = TrainerConfig(node=node, run_id="waits", wait_for_stages_s=3.5)
        with (
            caplog.at_level(logging.WARNING),
            Trainer(config) as trainer,
            pytest.raises(StepFailedError) as failed,
        ):
            next(iter(trainer.train(batches, steps=1)))
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=60)
    fix = f"`swarmtrain join --initial-peers {address} --run-id waits --stage K`"
    assert str(failed.value).startswith("no peer serves stage(s) 0, 1 of run 'waits'"), failed.value
    assert str(failed.value).endswith(f"start one with {fix}")
    notes = [r.getMessage() for r in caplog.records if "waiting for a peer" in r.getMessage()]
    assert len(notes) >= 2, notes  # progress, not one line at the end
    assert all(n.startswith("waiting for a peer to serve stage(s) 0, 1 of run 'waits' (") for n in notes)
    assert notes[0].endswith(f"of 4 s): start one with {fix}")
