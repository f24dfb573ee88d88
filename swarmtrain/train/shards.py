"""Disjoint data shards for the several trainers of one run (pure).

The run's data order is one sequence of microbatches; step s takes its microbatches
s*M .. s*M + M - 1 (M: the run's microbatches per step). With N trainers, shard i of N feeds
the microbatches i, i + N, i + 2N, ... of that order, so in every step it feeds the positions
i, i + N, ... < M of the step: M / N of them (N must divide M, so every shard feeds the same
positions every step). Together the shards feed exactly what one trainer would, and no two
feed the same microbatch.

A trainer's position in its data follows from the run's step alone: before step s, shard i
has fed s * M / N microbatches (`ShardFeed` skips them), so a trainer that restarts, or that
finds the run went on without it, goes on where the run is and never feeds data twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from swarmtrain.errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` of the run's data order."""

    index: int
    count: int

    def __post_init__(self):
        if not isinstance(self.count, int) or not isinstance(self.index, int) or self.count < 1:
            raise ConfigError(f"shard {self.index!r}/{self.count!r}: N must be >= 1")
        if not 0 <= self.index < self.count:
            raise ConfigError(f"shard {self.index}/{self.count}: I must be in 0..{self.count - 1}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'I/N' (--shard) as a Shard; ConfigError naming the form otherwise."""
        index, slash, count = str(text).partition("/")
        if not slash or not index.strip().isdigit() or not count.strip().isdigit():
            raise ConfigError(f"--shard {text!r} is not I/N: give this trainer's shard, e.g. 0/2 or 1/2")
        try:
            return cls(int(index), int(count))
        except ConfigError as e:
            raise ConfigError(f"--{e}") from None

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def check(self, per_step: int) -> None:
        """ConfigError unless this shard splits steps of `per_step` microbatches evenly."""
        if per_step % self.count:
            raise ConfigError(
                f"shard {self} cannot feed an even share of a step of {per_step} microbatches: the "
                f"shard count must divide the run's microbatches per step (e.g. --shard I/{_divisor(per_step, self.count)})"
            )

    def positions(self, per_step: int) -> tuple[int, ...]:
        """The positions (0..per_step - 1) this shard feeds in every step."""
        self.check(per_step)
        return tuple(range(self.index, per_step, self.count))

    def share(self, per_step: int) -> int:
        """Microbatches this shard feeds per step."""
        return len(self.positions(per_step))

    def overlaps(self, other: Shard, per_step: int) -> bool:
        return bool(set(self.positions(per_step)) & set(other.positions(per_step)))


WHOLE = Shard(0, 1)
"""The whole data order: a run fed by one trainer."""


def _divisor(per_step: int, count: int) -> int:
    """The divisor of `per_step` nearest `count` (for the error message)."""
    return min((d for d in range(1, per_step + 1) if per_step % d == 0), key=lambda d: (abs(d - count), d))


def default_shard(trainers: tuple[str, ...], peer_id: str) -> Shard:
    """The shard of a trainer without --shard: its place among the run's authorized trainers, as
    the manifest lists them (the whole data when the run authorizes any trainer)."""
    if not trainers:
        return WHOLE
    if peer_id not in trainers:
        raise ConfigError(f"trainer {peer_id} is not one the run authorizes, so it has no shard by default")
    return Shard(trainers.index(peer_id), len(trainers))


class ShardFeed:
    """A trainer's microbatches step by step: `take(step)` gives its share of `step`.

    `items` are the shard's own microbatches in order, the first of them its share of step
    `first_step`. Taking a later step skips the shares of the steps between (the run went on
    without this trainer): a step's data is never fed in another step.
    """

    def __init__(self, items: Iterable[Any], *, share: int, first_step: int):
        if share < 1 or first_step < 0:
            raise ConfigError(f"a feed needs share >= 1 and first_step >= 0, got {share} and {first_step}")
        self._items: Iterator[Any] = iter(items)
        self.share = share
        self.next_step = first_step
        """The step the next items belong to."""

    @classmethod
    def from_run_order(cls, batches: Iterable[Any], shard: Shard, per_step: int) -> ShardFeed:
        """The feed of `shard` over `batches`, the run's whole data order from its first microbatch."""
        share = shard.share(per_step)
        return cls(itertools.islice(batches, shard.index, None, shard.count), share=share, first_step=0)

    def take(self, step: int) -> list[Any] | None:
        """This shard's microbatches of `step` (None once the data runs out). Raises ConfigError
        for a step before the feed's position: its data was fed, or skipped, already."""
        if step < self.next_step:
            raise ConfigError(f"this feed is at step {self.next_step}: step {step}'s data was fed or skipped")
        skip = (step - self.next_step) * self.share
        if skip:
            next(itertools.islice(self._items, skip - 1, skip), None)
        items = list(itertools.islice(self._items, self.share))
        self.next_step = step + 1
        return items if len(items) == self.share else None

    def relabel(self, step: int) -> None:
        """The microbatches last taken go into step `step` instead (a rollback renumbered the
        run's steps): the next ones are step + 1's."""
        self.next_step = step + 1
