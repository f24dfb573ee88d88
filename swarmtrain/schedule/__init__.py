"""Readiness: which task a peer runs next, where each microbatch goes, how many are in flight,
and the accounting that makes every microbatch count once (pure policy, plus a thin runtime)."""

from swarmtrain.schedule.accounting import (
    CommitAction,
    CommitDecision,
    Repair,
    ReplicaReport,
    StageCommitPlan,
    StepLedger,
    decide_commit,
    plan_stage_commit,
)
from swarmtrain.schedule.queue import ReadinessQueue, StaticQueue, Task, in_flight_budget, one_f_one_b
from swarmtrain.schedule.readiness import Readiness, ReadinessConfig, ReadinessEstimator
from swarmtrain.schedule.routing import (
    BanConfig,
    Bans,
    ReadinessRouter,
    RoundRobinRouter,
    RouterConfig,
    StochasticRouter,
)
from swarmtrain.schedule.window import InFlightWindow, WindowConfig

__all__ = [
    "CommitAction",
    "CommitDecision",
    "Repair",
    "decide_commit",
    "BanConfig",
    "Bans",
    "InFlightWindow",
    "Readiness",
    "ReadinessConfig",
    "ReadinessEstimator",
    "ReadinessQueue",
    "ReadinessRouter",
    "ReplicaReport",
    "RoundRobinRouter",
    "RouterConfig",
    "StageCommitPlan",
    "StaticQueue",
    "StochasticRouter",
    "StepLedger",
    "Task",
    "WindowConfig",
    "in_flight_budget",
    "one_f_one_b",
    "plan_stage_commit",
]
