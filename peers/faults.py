"""Deterministic fault injection and emulated slowness for one stage peer.

`FaultInjector` ('ACTION:KIND:N') kills or terminates the peer exactly as its N-th task of a
kind starts: 'kill:backward:3' is a kill -9 of the whole peer (its DHT process and daemon
too, as on a lost spot instance) in the middle of its third backward pass; 'term:forward:2'
is a SIGTERM (a polite leave) in the middle of its second forward. Tests use it to hit the
exact phase they mean to, instead of killing at a guessed moment.

`SlowdownSource` gives the factor compute is slowed down by: `--slowdown`, or while a file
exists, the number in that file (a device that throttles for a while, then recovers).
"""

from __future__ import annotations

import os
import signal
import time

from swarmtrain.errors import ConfigError
from swarmtrain.schedule.queue import TASK_KINDS, Task

ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
KINDS = (*TASK_KINDS, "relayout")
"""Compute task kinds, and 'relayout': a layout move, once the peer kept its old stage's state."""
FILE_CHECK_S = 0.2
"""How often the slowdown file is looked at."""


class FaultInjector:
    """Raise a signal at a chosen task; `before_task` runs on the compute thread."""

    def __init__(self, spec: str | None):
        self.action, self.kind, self.nth = self.parse(spec) if spec else (None, None, 0)
        self._seen = 0

    @staticmethod
    def parse(spec: str) -> tuple[str, str, int]:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in ACTIONS or parts[1] not in KINDS or not parts[2].isdigit():
            raise ConfigError(
                f"--inject-fault {spec!r} must be ACTION:KIND:N with ACTION kill or term, "
                f"KIND one of {', '.join(KINDS)}, N >= 1 (e.g. kill:backward:3)"
            )
        if int(parts[2]) < 1:
            raise ConfigError(f"--inject-fault {spec!r}: N counts from 1")
        return parts[0], parts[1], int(parts[2])

    def before_task(self, task: Task) -> None:
        self.on(task.kind)

    def on(self, kind: str) -> None:
        """The peer starts something of `kind`: a task, or 'relayout'."""
        if self.action is None or kind != self.kind:
            return
        self._seen += 1
        if self._seen != self.nth:
            return
        if self.action == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGTERM)


class SlowdownSource:
    """The current compute slowdown factor (see the module docstring)."""

    def __init__(self, slowdown: float, path: str | None):
        self.base = slowdown
        self.path = path
        self._value = slowdown
        self._checked = -1.0

    def current(self) -> float:
        if self.path is None:
            return self.base
        now = time.monotonic()
        if now - self._checked >= FILE_CHECK_S:
            self._checked = now
            try:
                with open(self.path) as f:
                    self._value = max(1.0, float(f.read().strip() or self.base))
            except FileNotFoundError:
                self._value = self.base
            except (OSError, ValueError):
                pass  # a half-written file: keep the last value
        return self._value


CALL_KINDS = ("forward", "claim", "prepare", "exchange", "apply", "report")
"""What a trainer's fault counts: microbatches it sends into stage 0, the commit phases it
sends, the reports it sends another trainer."""


class CallFault:
    """'kill:KIND:N' kills a trainer (kill -9 of its process group: its DHT process and daemon
    die with it) as it sends its N-th request of a kind: 'kill:forward:3' in the middle of its
    feeding, 'kill:exchange:1' in the middle of its first commit."""

    def __init__(self, spec: str | None):
        self.kind, self.nth = self.parse(spec) if spec else (None, 0)
        self._seen = 0

    @staticmethod
    def parse(spec: str) -> tuple[str, int]:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] != "kill" or parts[1] not in CALL_KINDS or not parts[2].isdigit():
            raise ConfigError(
                f"--inject-fault {spec!r} must be kill:KIND:N with KIND one of {', '.join(CALL_KINDS)}, "
                "N >= 1 (e.g. kill:exchange:1)"
            )
        if int(parts[2]) < 1:
            raise ConfigError(f"--inject-fault {spec!r}: N counts from 1")
        return parts[1], int(parts[2])

    def before_call(self, frame) -> None:
        kind = frame.meta.get("phase") if frame.kind == "step" else frame.kind
        if self.kind is None or kind != self.kind:
            return
        self._seen += 1
        if self._seen == self.nth:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def wrap(self, transport) -> None:
        """Count (and strike at) every request `transport` sends."""
        if self.kind is None:
            return
        call = transport.call

        async def faulty_call(peer, name, request, *, timeout_s):
            self.before_call(request)
            return await call(peer, name, request, timeout_s=timeout_s)

        transport.call = faulty_call
