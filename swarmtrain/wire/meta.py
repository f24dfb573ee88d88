"""The base of the typed protocol messages: `Message` and the checkers of its fields.

A message is a frozen dataclass whose fields travel as a frame's `meta` (scalars and lists of
scalars). `Message.from_meta` checks every field with the checker `FIELDS` names for it and
raises BadFrameError naming the first bad one; the records themselves are in
`swarmtrain.wire.messages` (the stage protocol), `swarmtrain.wire.commit_messages` (the commit
phases) and `swarmtrain.wire.team_messages` (trainer to trainer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from swarmtrain.errors import BadFrameError
from swarmtrain.wire.frames import MAX_META_LIST

__all__ = ["MAX_META_LIST", "Message"]

MAX_PEER_ID_CHARS = 128
MAX_MB_ID_CHARS = 256


def _fail(what: str, name: str, expected: str, value: Any) -> None:
    raise BadFrameError(f"{what} meta {name!r} must be {expected}, got {value!r:.80}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, float) or _is_int(v)) and math.isfinite(v)


# Field checkers: (value, what, name) -> the typed value, or BadFrameError.


def _float(lo: float, hi: float, *, lo_open: bool = False):
    def check(v, what, name):
        if not _is_number(v) or v > hi or v < lo or (lo_open and v == lo):
            _fail(what, name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]", v)
        return float(v)

    return check


def _int(lo: int = 0, hi: int | None = None):
    def check(v, what, name):
        if not _is_int(v) or v < lo or (hi is not None and v > hi):
            _fail(what, name, f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]", v)
        return v

    return check


def _bool(v, what, name):
    if not isinstance(v, bool):
        _fail(what, name, "a bool", v)
    return v


def _str(max_chars: int):
    def check(v, what, name):
        if not isinstance(v, str) or len(v) > max_chars:
            _fail(what, name, f"a string of at most {max_chars} characters", v)
        return v

    return check


def _strs(max_chars: int):
    def check(v, what, name):
        if not isinstance(v, list) or not all(isinstance(i, str) and len(i) <= max_chars for i in v):
            _fail(what, name, f"a list of strings of at most {max_chars} characters", v)
        return tuple(v)

    return check


def _ints(lo: int = 0):
    def check(v, what, name):
        if not isinstance(v, list) or not all(_is_int(i) and i >= lo for i in v):
            _fail(what, name, f"a list of ints >= {lo}", v)
        return tuple(v)

    return check


def _floats(lo: float, hi: float):
    def check(v, what, name):
        if not isinstance(v, list) or not all(_is_number(i) and lo <= i <= hi for i in v):
            _fail(what, name, f"a list of numbers in [{lo}, {hi}]", v)
        return tuple(float(i) for i in v)

    return check


def _optional(check):
    def optional(v, what, name):
        return None if v is None else check(v, what, name)

    return optional


class Message:
    """Base of the meta records: `to_meta()` and a validating `from_meta()`.

    Subclasses are frozen dataclasses that name their wire `WHAT` (for error messages) and a
    checker per field in `FIELDS`; tuple fields travel as lists. Fields with defaults may be
    absent from the meta; unknown keys are refused.
    """

    WHAT: ClassVar[str] = "frame"
    FIELDS: ClassVar[dict[str, Any]] = {}

    def to_meta(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_meta(cls, meta: dict[str, Any], *, ignore: frozenset[str] = frozenset()):
        if not isinstance(meta, dict):
            raise BadFrameError(f"{cls.WHAT} meta must be a mapping")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(meta) - set(fields) - ignore
        if unknown:
            raise BadFrameError(f"{cls.WHAT} meta has unknown fields {sorted(unknown)}")
        values = {}
        for name, f in fields.items():
            if name not in meta:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise BadFrameError(f"{cls.WHAT} meta lacks {name!r}")
                continue
            values[name] = cls.FIELDS[name](meta[name], cls.WHAT, name)
        return cls(**values)
