"""A peer's place in the swarm: its hivemind DHT node and what it reads and writes there.

DHT keys (all under the run id):

| key                | subkey  | value                  | expiry                        |
|--------------------|---------|------------------------|-------------------------------|
| `{run}.manifest`   | -       | RunManifest.to_dict()  | republished by coordinators   |
| `{run}.peers`      | peer id | PeerRecord.to_dict()   | heartbeat TTL                 |
| `swarmtrain.runs`  | run id  | {model, num_stages}    | republished by coordinators   |

The last key lets a peer that asks for an unknown run id say which runs do exist.
One libp2p identity per process: the DHT, the tensor streams and (later) the averagers
share it through `replicate_p2p()`.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass

import hivemind
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils import get_dht_time

from swarmtrain.errors import ConfigError, RunNotFoundError, SwarmError
from swarmtrain.wire.records import PEER_ID_PATTERN, PeerRecord, RunManifest, check_run_id

logger = logging.getLogger(__name__)

RUNS_KEY = "swarmtrain.runs"
MADDR_PATTERN = re.compile(
    r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/(tcp|udp)/([^/]+)(?:/quic|/quic-v1)?(?:/p2p/([^/]*))?$"
)
"""A peer multiaddr, loosely: the parts are checked one by one so the error can name the bad one."""
ADDRESS_FORM = "/ip4/HOST/tcp/PORT/p2p/PEER_ID"
GO_LOG_TIME = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ")
"""The timestamp Go's log package puts before the daemon's messages."""


def manifest_key(run_id: str) -> str:
    return f"{run_id}.manifest"


def peers_key(run_id: str) -> str:
    return f"{run_id}.peers"


def trainers_key(run_id: str) -> str:
    """Subkey: trainer peer id; value: its latest TrainerPoint (what the dashboard charts)."""
    return f"{run_id}.trainers"


def check_peer_address(addr: str) -> str:
    """Return `addr` if it is a peer multiaddr another peer can dial; else raise ConfigError
    naming the part that is wrong (host, port or peer id) and the form expected."""
    copy_hint = f"copy the whole address `swarmtrain coordinator` printed ({ADDRESS_FORM})"
    m = MADDR_PATTERN.match(addr)
    if m is None:
        raise ConfigError(f"--initial-peers {addr!r} is not a peer address: {copy_hint}")
    proto, host, _, port, peer_id = m.groups()
    if proto in ("ip4", "ip6"):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(
                f"--initial-peers {addr!r}: {host!r} is not an {proto} address; {copy_hint}"
            ) from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--initial-peers {addr!r}: port {port!r} is not a number in 1..65535; {copy_hint}")
    if peer_id is None:
        raise ConfigError(
            f"--initial-peers {addr!r} lacks the /p2p/PEER_ID part that names the peer; {copy_hint}"
        )
    if not PEER_ID_PATTERN.match(peer_id):
        raise ConfigError(
            f"--initial-peers {addr!r}: {peer_id!r} is not a peer id (base58, like 12D3KooW...); {copy_hint}"
        )
    return addr


def check_initial_peers(addrs: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Validate --initial-peers multiaddrs (also comma- or space-separated in one string);
    raises ConfigError naming the bad one."""
    return tuple(check_peer_address(part) for addr in addrs for part in str(addr).replace(",", " ").split())


def check_host(host: str, flag: str = "--host") -> str:
    """Return `host` if it is an IPv4 address to listen on, else raise ConfigError."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(
            f"{flag} {host!r} is not an IPv4 address: use 127.0.0.1 (this machine only) "
            "or 0.0.0.0 (peers on other machines too)"
        ) from None
    return host


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """How a peer joins the swarm's DHT."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the swarm; empty starts a new swarm."""
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 to accept peers from other machines)."""
    port: int = 0
    """TCP port to listen on; 0 picks a free one."""
    announce_host: str | None = None
    """Address other peers should dial, if it differs from `host` (behind NAT, 0.0.0.0)."""
    client_mode: bool = False
    """Read and write the DHT without serving it to others (a short-lived reader such as
    `swarmtrain status`); needs `initial_peers`."""

    def __post_init__(self):
        object.__setattr__(self, "initial_peers", check_initial_peers(self.initial_peers))
        check_host(self.host)
        if self.announce_host is not None:
            check_host(self.announce_host, "announce host")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in 0..65535 (0 picks a free port), got {self.port}")
        if self.client_mode and not self.initial_peers:
            raise ConfigError("a DHT client needs --initial-peers: the address of a peer in the swarm")


def _explain_daemon_error(e: Exception, cfg: NodeConfig) -> str:
    """One line saying why the libp2p daemon did not start and what to change."""
    text = " ".join(GO_LOG_TIME.sub("", str(e)).split())
    if "address already in use" in text:
        return f"port {cfg.port} on {cfg.host} is already in use: pick another --port, or 0 for any free port"
    if "failed to connect to bootstrap peers" in text:
        return (
            f"could not reach any of --initial-peers {' '.join(cfg.initial_peers)}: check that the coordinator "
            "is running and that the address (host, port and peer id) is the one it printed"
        )
    if "failed to parse multiaddr" in text or "invalid p2p multiaddr" in text:
        return (
            f"the peer-to-peer daemon rejected an address ({text.split(': ', 1)[-1]}): check --initial-peers "
            f"{' '.join(cfg.initial_peers) or '(none)'} and --host {cfg.host}"
        )
    if "cannot assign requested address" in text or "assign requested" in text:
        return (
            f"cannot listen on --host {cfg.host}: it is not an address of this machine; "
            "use 127.0.0.1 or 0.0.0.0"
        )
    return f"the peer-to-peer daemon failed to start ({text}): check --host, --port and --initial-peers"


class SwarmNode:
    """A started DHT node. Sync methods block; `*_async` ones await the DHT process."""

    def __init__(self, config: NodeConfig):
        self.config = config
        host_maddrs = [f"/ip4/{config.host}/tcp/{config.port}"]
        announce = None
        if config.announce_host and config.port:
            announce = [f"/ip4/{config.announce_host}/tcp/{config.port}"]
        try:
            self.dht = hivemind.DHT(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=host_maddrs,
                announce_maddrs=announce,
                client_mode=config.client_mode,
                start=True,
            )
        except P2PDaemonError as e:
            raise SwarmError(_explain_daemon_error(e, config)) from None
        self._p2p: P2P | None = None

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def addresses(self) -> list[str]:
        """Multiaddrs other peers can pass as --initial-peers."""
        return [str(a) for a in self.dht.get_visible_maddrs()]

    async def p2p(self) -> P2P:
        """This process's handle on the DHT's libp2p daemon (same identity)."""
        if self._p2p is None:
            self._p2p = await self.dht.replicate_p2p()
        return self._p2p

    async def close_p2p(self) -> None:
        """Close this process's P2P handle (the daemon itself belongs to the DHT process)."""
        if self._p2p is not None:
            p2p, self._p2p = self._p2p, None
            await p2p.shutdown()

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()

    # manifest

    def publish_manifest(self, manifest: RunManifest, *, ttl_s: float) -> None:
        now = get_dht_time()
        ok = self.dht.store(manifest_key(manifest.run_id), manifest.to_dict(), expiration_time=now + ttl_s)
        summary = {"model": manifest.model, "num_stages": manifest.num_stages}
        self.dht.store(RUNS_KEY, summary, expiration_time=now + ttl_s, subkey=manifest.run_id)
        if not ok:
            logger.warning("manifest of run %s was not stored in the DHT", manifest.run_id)

    async def republish_manifest_async(self, manifest: RunManifest, *, ttl_s: float) -> None:
        """Keep the run's manifest (and its entry in the run list) alive without a coordinator."""
        now = get_dht_time()
        summary = {"model": manifest.model, "num_stages": manifest.num_stages}
        await self.dht.store(
            manifest_key(manifest.run_id), manifest.to_dict(), expiration_time=now + ttl_s, return_future=True
        )
        await self.dht.store(
            RUNS_KEY, summary, expiration_time=now + ttl_s, subkey=manifest.run_id, return_future=True
        )

    def known_runs(self) -> list[str]:
        found = self.dht.get(RUNS_KEY, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        return sorted(str(k) for k in found.value)

    def get_manifest(self, run_id: str) -> RunManifest | None:
        """The run's manifest, or None if the DHT has none. ConfigError if it is malformed."""
        found = self.dht.get(manifest_key(check_run_id(run_id)), latest=True)
        if found is None:
            return None
        return RunManifest.from_dict(found.value)

    def require_manifest(self, run_id: str | None) -> RunManifest:
        """The manifest of `run_id` (or of the only run, if None); RunNotFoundError otherwise."""
        runs = self.known_runs()
        if run_id is None:
            if len(runs) == 1:
                run_id = runs[0]
            elif not runs:
                raise RunNotFoundError(
                    "no run is announced in this swarm yet: start one with `swarmtrain coordinator`"
                )
            else:
                raise RunNotFoundError(
                    f"this swarm has several runs ({', '.join(repr(r) for r in runs)}): choose one with --run-id"
                )
        manifest = self.get_manifest(run_id)
        if manifest is None:
            if not runs:
                raise RunNotFoundError(
                    f"no run {run_id!r} in this swarm, nor any other: start it with "
                    f"`swarmtrain coordinator --run-id {run_id}`"
                )
            known = ", ".join(repr(r) for r in runs)
            raise RunNotFoundError(
                f"no run {run_id!r} in this swarm; it announces {known}: pass one of those as --run-id"
            )
        return manifest

    # membership

    async def announce_async(self, run_id: str, record: PeerRecord, *, ttl_s: float) -> bool:
        return await self.dht.store(
            peers_key(run_id),
            record.to_dict(),
            expiration_time=get_dht_time() + ttl_s,
            subkey=record.peer_id,
            return_future=True,
        )

    def announce(self, run_id: str, record: PeerRecord, *, ttl_s: float) -> bool:
        return self.dht.store(
            peers_key(run_id), record.to_dict(), expiration_time=get_dht_time() + ttl_s, subkey=record.peer_id
        )

    @staticmethod
    def _parse_peers(found) -> list[PeerRecord]:
        if found is None or not isinstance(found.value, dict):
            return []
        records = []
        for subkey, item in found.value.items():
            try:
                record = PeerRecord.from_dict(item.value)
            except ConfigError as e:
                logger.debug("ignoring malformed peer record %s: %s", subkey, e)
                continue
            if record.peer_id == subkey:
                records.append(record)
        return sorted(records, key=lambda r: (r.stage, r.peer_id))

    def publish_trainer_point(self, run_id: str, point, *, ttl_s: float):
        """Store a trainer's latest point (`wire.metrics.TrainerPoint`) under `{run}.trainers`,
        keyed by this peer; returns a future (fire and forget, or wait on it before leaving)."""
        return self.dht.store(
            trainers_key(run_id),
            point.to_dict(),
            expiration_time=get_dht_time() + ttl_s,
            subkey=self.peer_id,
            return_future=True,
        )

    def trainer_points(self, run_id: str) -> list[dict]:
        """The latest point each live trainer published (raw dicts; the reader validates them)."""
        found = self.dht.get(trainers_key(run_id), latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        return [item.value for item in found.value.values() if isinstance(item.value, dict)]

    async def peers_async(self, run_id: str) -> list[PeerRecord]:
        return self._parse_peers(await self.dht.get(peers_key(run_id), latest=True, return_future=True))

    def peers(self, run_id: str) -> list[PeerRecord]:
        return self._parse_peers(self.dht.get(peers_key(run_id), latest=True))


def stage_replicas(records: list[PeerRecord]) -> dict[int, list[PeerRecord]]:
    """The serving peers of each stage, earliest first (ties broken by peer id)."""
    out: dict[int, list[PeerRecord]] = {}
    for r in sorted(records, key=lambda r: (r.since, r.peer_id)):
        if r.role == "stage" and r.state == "serving":
            out.setdefault(r.stage, []).append(r)
    return out
