"""An emulated WAN on one machine: one network namespace per peer, joined by a bridge, with
`tc tbf` bandwidth limits on every peer's access link.

    with WanNet(WanConfig(num_peers=4, rate_mbit=50)) as net:
        proc = net.spawn(2, [sys.executable, "-m", "swarmtrain.cli", "join", "--host", net.address(2), ...])
        net.set_rate(100)

Topology: a hub namespace holds bridge `br0`; peer k's namespace has one veth, `eth0` with
address 10.77.0.(k+1)/24, whose other end is a port of the bridge. tbf limits both directions
of that link (egress of eth0 is the peer's uplink, egress of its bridge port its downlink),
as a home or cloud connection is limited. Traffic stays inside the namespaces this module
creates (10.77.0.0/24 exists only there). netem is not available here (ENVIRONMENT.md), so
links add no latency or loss of their own.

Needs root and the `ip` and `tc` tools; NetnsError says what is missing and nothing falls
back to loopback. Names carry this process's pid; close() (also from __exit__, so on errors and
Ctrl+C) ends the processes spawned here and deletes the namespaces, which takes their veths,
bridge and qdiscs with them. `remove_stale()` deletes what a killed earlier run left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass

SUBNET = "10.77.0"
PREFIX = "stw"
"""Every namespace and interface this module creates starts with PREFIX + the creator's pid."""
MIN_BURST_BYTES = 32 * 1024


class NetnsError(RuntimeError):
    """Namespaces or qdiscs cannot be set up here (not root, no `ip`/`tc`, a command failed)."""


@dataclass(frozen=True, kw_only=True)
class WanConfig:
    """Peers and the bandwidth of each one's link."""

    num_peers: int = 4
    """Namespaces, one per peer (at most 250)."""
    rate_mbit: float = 100.0
    """Bandwidth of each peer's uplink and of its downlink, in Mbit/s."""
    queue_ms: float = 400.0
    """How long a packet may wait in a link's queue before it is dropped (tbf latency): the
    queue's depth. Home routers buffer a few hundred ms; with 100 ms, 1 MiB frames lose ~15%
    of the link to drops and TCP backoff."""

    def __post_init__(self):
        if not 1 <= self.num_peers <= 250:
            raise ValueError(f"num_peers must be in 1..250, got {self.num_peers}")
        if not self.rate_mbit > 0 or not self.queue_ms > 0:
            raise ValueError(f"rate_mbit and queue_ms must be > 0, got {self.rate_mbit} and {self.queue_ms}")


def check_prerequisites() -> None:
    """Raise NetnsError unless this process can create namespaces and qdiscs."""
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root: run this as root (e.g. with sudo)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"missing {' and '.join(missing)} (install iproute2)")


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _in(namespace: str, command: str) -> str:
    """Run `command` (words separated by spaces) inside `namespace`."""
    return _run("ip", "netns", "exec", namespace, *command.split())


def tbf_args(rate_mbit: float, queue_ms: float) -> list[str]:
    """tc arguments of a tbf qdisc limiting a link to `rate_mbit`, queueing up to `queue_ms`."""
    rate_bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(MIN_BURST_BYTES, int(rate_bytes_per_s / 250))  # 4 ms of traffic
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{queue_ms}ms"]


def remove_stale() -> list[str]:
    """Delete namespaces an earlier, killed run of this module left behind; returns their names."""
    removed = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{PREFIX}(\d+)[hp]\d*", name)
        if match and not _alive(int(match.group(1))):
            _run("ip", "netns", "delete", name)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WanNet:
    """The namespaces, bridge and links of one emulated WAN; a context manager."""

    def __init__(self, config: WanConfig):
        self.config = config
        tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{tag}h"
        self.namespaces = [f"{tag}p{k}" for k in range(config.num_peers)]
        self._ports = [f"{tag}b{k}" for k in range(config.num_peers)]  # bridge side of peer k's veth
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def address(self, k: int) -> str:
        """Peer k's IPv4 address (inside the namespaces only)."""
        return f"{SUBNET}.{k + 1}"

    def __enter__(self) -> WanNet:
        check_prerequisites()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        hub = self.hub
        self._add_namespace(hub)
        _in(hub, "ip link add br0 type bridge")
        _in(hub, "ip link set br0 up")
        for k, (ns, port) in enumerate(zip(self.namespaces, self._ports)):
            self._add_namespace(ns)
            _run(*f"ip link add eth0 netns {ns} type veth peer name {port} netns {hub}".split())
            _in(hub, f"ip link set {port} master br0")
            _in(hub, f"ip link set {port} up")
            _in(ns, f"ip addr add {self.address(k)}/24 dev eth0")
            _in(ns, "ip link set eth0 up")
            _in(ns, "ip link set lo up")
        self.set_rate(self.config.rate_mbit)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def set_rate(self, rate_mbit: float) -> None:
        """Limit every peer's uplink and downlink to `rate_mbit` Mbit/s (replacing any limit)."""
        tbf = " ".join(tbf_args(rate_mbit, self.config.queue_ms))
        for ns, port in zip(self.namespaces, self._ports):
            _in(ns, f"tc qdisc replace dev eth0 root {tbf}")  # the peer's uplink
            _in(self.hub, f"tc qdisc replace dev {port} root {tbf}")  # its downlink

    def qdiscs(self) -> list[str]:
        """`tc qdisc show` of every peer's eth0 (to report what was in force)."""
        return [_in(ns, "tc qdisc show dev eth0").strip() for ns in self.namespaces]

    def uplink_bytes(self) -> list[int]:
        """Bytes each peer's uplink qdisc has sent so far (`tc -s qdisc`: headers included)."""
        out = []
        for ns in self.namespaces:
            text = _in(ns, "tc -s qdisc show dev eth0")
            words = text.split()
            out.append(int(words[words.index("Sent") + 1]) if "Sent" in words else 0)
        return out

    def command(self, k: int, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside peer k's namespace."""
        return ["ip", "netns", "exec", self.namespaces[k], *argv]

    def spawn(self, k: int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start `argv` inside peer k's namespace, in its own process group; close() ends it."""
        proc = subprocess.Popen(self.command(k, argv), start_new_session=True, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def close(self, timeout_s: float = 5.0) -> None:
        """End every process spawned here (SIGTERM, then SIGKILL), then delete the namespaces."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        errors = []
        for name in reversed(self._created):
            try:
                _run("ip", "netns", "delete", name)  # takes the namespace's veths and qdiscs with it
            except NetnsError as e:
                errors.append(str(e))
        self._created.clear()
        if errors:
            raise NetnsError("cleanup left namespaces behind: " + "; ".join(errors))
