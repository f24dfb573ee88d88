"""A discrete-event simulator of a swarm that drives the real policies.

Simulated peers, links, preemptions and joins are events (`engine`); every decision a real
peer or trainer makes (which task runs next, which replica a microbatch goes to, bans, the
in-flight window, which stage a new peer joins, whether a peer moves) is taken by the very
objects the real peers use, imported from `swarmtrain.schedule` and `swarmtrain.plan`.
Nothing here decides policy (tests/test_sim.py fails if something does).

    from swarmtrain.sim import Scenario, simulate
    result = simulate(Scenario(peers={"4090": 8, "t4": 8}, duration_s=600))
"""

from swarmtrain.sim.scenario import Scenario, load_scenario
from swarmtrain.sim.state import SimResult
from swarmtrain.sim.swarm import simulate

__all__ = ["Scenario", "SimResult", "load_scenario", "simulate"]
