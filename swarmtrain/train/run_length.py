"""How long a run lasts: its manifest's `max_steps`, and how each role tells the run is over.

A run of `max_steps` N > 0 applies steps 0..N-1; N = 0 runs until stopped. A trainer runs at
most the steps left (`steps_to_run`) and says so once it reaches the last; a stage replica
that applied step N-1 (its parameters are at step N, `is_finished`) announces the state
'finished' and leaves; a trainer started on a run that is over is refused (`RunFinishedError`).
Over means, by evidence no stranger can forge (`run_is_over`): a trainer the run authorizes
reported its last step committed, or the run's owner (its coordinator) announces it finished.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarmtrain.errors import SwarmError
from swarmtrain.wire.records import PeerRecord


class RunFinishedError(SwarmError):
    """The run has applied its last step: there is nothing left to train."""


def is_finished(step: int, max_steps: int) -> bool:
    """Whether parameters at `step` (steps applied so far) have taken the run's last step."""
    return 0 < max_steps <= step


def steps_to_run(run_id: str, step: int, steps: int, max_steps: int) -> int:
    """How many of the `steps` asked for a trainer at `step` runs: all of them in a run without
    a step count, else no more than the run has left. Raises RunFinishedError when none is left."""
    if max_steps <= 0:
        return steps
    if step >= max_steps:
        raise finished_error(run_id, max_steps)
    return min(steps, max_steps - step)


def run_is_over(
    max_steps: int, committed: int | None, records: Iterable[PeerRecord], owner: str | None
) -> bool:
    """Whether the run is over: `committed` (the furthest step an authorized trainer reported,
    `authority.committed_step`) is its last, or the record of `owner` (the run owner's peer
    id) announces it finished. Stage peers' own records are claims, and count for nothing here."""
    if max_steps <= 0:
        return False
    if committed is not None and committed + 1 >= max_steps:
        return True
    return any(r.peer_id == owner and r.state == "finished" for r in records)


def finished_error(run_id: str, max_steps: int) -> RunFinishedError:
    return RunFinishedError(
        f"run {run_id!r} is finished: it ran all its {max_steps} steps (its coordinator's --steps); "
        "start a new run (another --run-id) to train more"
    )


def last_step_message(run_id: str, max_steps: int) -> str:
    """What a trainer says once it applied the run's last step."""
    return f"run {run_id!r} reached its last step ({max_steps}); stopping"


def finished_message(run_id: str, step: int) -> str:
    """What a stage peer says as it leaves a finished run."""
    return f"run {run_id!r} finished at step {step}"
