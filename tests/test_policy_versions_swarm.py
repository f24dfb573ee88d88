"""Policy versions on a real swarm: a peer that is neither a trainer nor a stage member fetches
versions of a 2-stage run as it trains, exact and compressed, and an old one is refused."""

import asyncio
import threading

import pytest
import torch

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.model.param_names import model_param_name
from swarmtrain.rl.weights import FetchConfig, fetch_version, latest_version, swarm_source
from swarmtrain.swarm import SwarmNode
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, wait_until

pytestmark = [pytest.mark.swarm]

STILL = ("--rebalance-every", "0")


class Client:
    """A rollout peer's side, on its own event loop (the node's p2p handle lives on it)."""

    def __init__(self, node_config):
        self.node = SwarmNode(node_config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.source = self.run(swarm_source(self.node))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def close(self):
        self.run(self.node.close_p2p())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.node.shutdown()


def params_of(trainer) -> dict[str, torch.Tensor]:
    """Every stage's parameters as its replica holds them now, under the whole model's names."""
    return {model_param_name(k): v for state in trainer.fetch_states() for k, v in state.items()}


def test_a_rollout_peer_fetches_versions_as_the_run_trains(local_swarm):
    swarm = local_swarm(
        model_config=TINY_GPT,
        num_stages=2,
        optimizer=OptimizerConfig(name="adamw", lr=1e-2),
        batch=BatchConfig(microbatch_size=4, microbatches_per_step=2, max_in_flight=2),
        stage_args={0: STILL, 1: STILL},
    )
    data = iter(TokenBatches(stdlib_text(2**18), seq_len=TINY_GPT["seq_len"], microbatch_size=4, seed=0))
    client = Client(swarm.node_config())  # a fresh identity: no trainer, no stage member
    try:
        with swarm.trainer() as trainer:
            list(trainer.train(data, steps=2))
            wait_until(lambda: client.run(latest_version(client.source)) == 2, timeout_s=20, what="version 2")
            v2 = params_of(trainer)
            got, exact = client.run(fetch_version(client.source, 2))
            assert got.keys() == v2.keys() and all(torch.equal(got[k], v2[k]) for k in v2)

            list(trainer.train(data, steps=1))
            v3 = params_of(trainer)
            again, _ = client.run(fetch_version(client.source, 2))  # the previous version, kept
            assert all(torch.equal(again[k], v2[k]) for k in v2)
            got, _ = client.run(fetch_version(client.source, 3))
            assert all(torch.equal(got[k], v3[k]) for k in v3)
            small, int8 = client.run(fetch_version(client.source, 3, FetchConfig(codec="int8")))
            assert int8.wire_bytes < exact.wire_bytes / 3.5 and int8.raw_bytes == exact.raw_bytes
            for k, t in v3.items():
                assert (small[k] - t).abs().max() <= t.abs().max() / 127 + 1e-7, k

            list(trainer.train(data, steps=2))
            with pytest.raises(RemoteError, match=r"version 2 is gone .* holds versions 3..5") as gone:
                client.run(fetch_version(client.source, 2))
            assert gone.value.cause == Cause.VERSION_GONE
    finally:
        client.close()
