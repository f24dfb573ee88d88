"""Which trainer commits a stage replica's step: one claim per step (pure).

Several trainers feed a run and any of them may commit a step (`swarmtrain.train.team`), but
one step's commit is driven by one trainer at a time, so no two plans or gradient scales ever
mix in a stage. A replica holds the claim of its current step for one trainer:
- the first trainer to claim the step (a Claim, or a Prepare) holds it;
- a trainer with a lower peer id takes it over (the committing trainer is the lowest live one,
  so a lower one is the rightful committer), unless it was itself taken over (below);
- a trainer that names the holder among the trainers it found gone (`Claim.replaces`) takes it
  over, and the holder cannot take it back by its lower id in this step;
- every other commit phase (exchange, apply, abort) is served to the holder alone, or claims
  the step when nobody holds it.
A trainer refused (`Cause.CLAIMED`) asks who holds the claim (a Status) and leaves the step to it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass
class StepClaim:
    """The claim on one replica's step (see the module docstring)."""

    step: int = -1
    holder: str = ""
    replaced: frozenset[str] = field(default_factory=frozenset)
    """Trainers taken over in this step, for they were found gone."""

    def holder_of(self, step: int) -> str:
        """The trainer that holds the claim on `step`, '' if none."""
        return self.holder if self.step == step else ""

    def take(self, step: int, trainer: str, replaces: Collection[str] = ()) -> bool:
        """Claim `step` for `trainer` (a Claim or a Prepare); whether it holds the claim now."""
        if self.step != step or not self.holder:
            self.step, self.holder, self.replaced = step, trainer, frozenset()
            return True
        if self.holder == trainer:
            return True
        if self.holder in replaces:
            self.replaced |= {self.holder}
            self.holder = trainer
            return True
        if trainer < self.holder and trainer not in self.replaced:
            self.holder = trainer
            return True
        return False

    def allows(self, step: int, trainer: str) -> bool:
        """Whether `trainer` may drive another phase of `step` (it holds the claim, or nobody
        does and it takes it now)."""
        if self.step != step or not self.holder:
            self.step, self.holder, self.replaced = step, trainer, frozenset()
        return self.holder == trainer
