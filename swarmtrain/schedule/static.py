"""The static schedule's round-robin slots, built, read and routed by one rule (pure).

The static baseline fixes every microbatch's whole route when the trainer issues it:
microbatch `n` of a step goes to replica `n mod R_k` (peer-id order) of each stage k with R_k
replicas. The trainer builds the assignment once (`assign`); the forward frame carries it
(`ForwardMeta.slots`/`slot_counts`/`microbatches`); each stage reads from it which of the
step's microbatches will come to it (`expected_orders`), so its queue can run them in 1F1B
order; and a router that must pick a replica without a preference picks by the same rule
(`round_robin`).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.wire.messages import NO_PREFERENCE


@dataclass(frozen=True, kw_only=True)
class StaticAssignment:
    """Where microbatch `order` goes in every stage."""

    prefer: tuple[str, ...]
    """Per stage: the replica it goes to (NO_PREFERENCE where the stage has none yet)."""
    slots: tuple[int, ...]
    """Per stage: that replica's index in peer-id order..."""
    slot_counts: tuple[int, ...]
    """...among this many replicas."""


def round_robin(order: int, count: int) -> int:
    """The replica index microbatch `order` takes among `count` (peer-id order)."""
    return order % count


def assign(order: int, replicas: dict[int, list[str]], num_stages: int) -> StaticAssignment:
    """The fixed route of microbatch `order`, from each stage's replicas."""
    prefer, slots, counts = [], [], []
    for k in range(num_stages):
        ranked = sorted(set(replicas.get(k, [])))
        count = max(1, len(ranked))
        j = round_robin(order, count)
        prefer.append(ranked[j] if ranked else NO_PREFERENCE)
        slots.append(j)
        counts.append(count)
    return StaticAssignment(prefer=tuple(prefer), slots=tuple(slots), slot_counts=tuple(counts))


def expected_orders(slot: int, count: int, microbatches: int) -> list[int]:
    """The microbatches of a step that replica `slot` of `count` gets (see `assign`)."""
    return [n for n in range(microbatches) if round_robin(n, count) == slot]
