"""Rebalancing with hysteresis on a real swarm: peers start piled on one stage while the
other stage's only peer is very slow; exactly one peer moves, and the layout then holds."""

import pytest

from swarmtrain.swarm import NodeConfig, SwarmNode, stage_replicas
from tests.conftest import TINY_GPT, holds_for, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

CHECK_S = 1.0


def layout(node: SwarmNode, run_id: str) -> dict[int, list[str]]:
    return {k: sorted(r.peer_id for r in rs) for k, rs in stage_replicas(node.peers(run_id)).items()}


def test_an_unbalanced_swarm_spreads_out_once_and_does_not_flap(local_swarm):
    fast = ("--rebalance-every", str(CHECK_S))
    # Stage 1's only peer announces 1/10^6 of this machine's speed: the pipeline's bottleneck.
    swarm = local_swarm(
        model_config=TINY_GPT, num_stages=2, stage_args={0: fast, 1: (*fast, "--slowdown", "1e6")}
    )
    for _ in range(2):
        swarm.spawn_stage(0, extra_args=fast)
    node = SwarmNode(NodeConfig(initial_peers=(swarm.address,)))
    try:

        def spread() -> bool:
            counts = [len(layout(node, "demo").get(k, [])) for k in (0, 1)]
            assert counts in ([3, 1], [2, 1], [2, 2]), counts  # one mover at a time, never a herd
            return counts == [2, 2]

        wait_until(spread, timeout_s=90, what="one stage-0 peer to move to stage 1")
        settled = {peer: k for k, peers in layout(node, "demo").items() for peer in peers}

        def nobody_moved() -> bool:
            # a record a DHT read misses now and then (a heartbeat late on a busy machine) is not a move
            now = layout(node, "demo")
            return all(settled.get(peer, k) == k for k, peers in now.items() for peer in peers)

        # Hysteresis: over several more checks (patience is 3) nobody moves back or on.
        holds_for(nobody_moved, duration_s=6 * CHECK_S, what="the settled layout")
    finally:
        node.shutdown()
