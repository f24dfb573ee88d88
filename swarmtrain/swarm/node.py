"""A peer's place in the swarm: its hivemind DHT node and what it reads and writes there.

The keys and their records are listed in `swarmtrain.wire.keys`. Every record is signed by
the peer that wrote it and stored under that peer's id (`swarmtrain.trust.records`); every
node validates what it stores and what lookups return, and a private swarm's nodes also
seal each record with the swarm key. One libp2p identity per process, from its key file
(`NodeConfig.identity_path`): the DHT, the tensor streams and the record signatures share it.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hivemind
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils import get_dht_time

from swarmtrain.errors import ConfigError, RunNotFoundError, SwarmError
from swarmtrain.trust.identity import Identity
from swarmtrain.trust.owner import OwnerPins, choose_owner
from swarmtrain.trust.records import member_proof, open_record, sign_record, validators
from swarmtrain.trust.swarmkey import SwarmKey, load_swarm_key
from swarmtrain.wire.keys import RUNS_KEY, layout_key, manifest_key, peers_key, run_summary, trainers_key
from swarmtrain.wire.layout_record import LayoutRecord, apply_layout
from swarmtrain.wire.records import PEER_ID_PATTERN, PeerRecord, RunManifest, check_run_id

logger = logging.getLogger(__name__)

MADDR_PATTERN = re.compile(
    r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/(tcp|udp)/([^/]+)(?:/quic|/quic-v1)?(?:/p2p/([^/]*))?$"
)
"""A peer multiaddr, loosely: the parts are checked one by one so the error can name the bad one."""
ADDRESS_FORM = "/ip4/HOST/tcp/PORT/p2p/PEER_ID"
GO_LOG_TIME = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ")
"""The timestamp Go's log package puts before the daemon's messages."""


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


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the OS's pick), for a daemon that must know its port before it
    starts: an announced address (--announce-host) names the port other peers dial."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
    identity_path: str | None = None
    """Key file of this peer's identity (--identity; made if missing). None: a key made for
    this process alone (a new peer id each start)."""
    swarm_key_path: str | None = None
    """The private swarm's key file (--swarm-key); None: an open swarm."""
    run_owner: str | None = None
    """Peer id of the run's owner whose manifest alone to accept (--run-owner); None: the
    owner whose address is in `initial_peers`, else the one pinned, else the only one."""
    refuse_taken_identity: bool = False
    """Refuse to start when a peer of the swarm already runs with this identity (two processes
    cannot share one peer id: a second coordinator given the owner's key file, say)."""

    def __post_init__(self):
        if self.run_owner is not None and not PEER_ID_PATTERN.match(str(self.run_owner)):
            raise ConfigError(
                f"--run-owner {self.run_owner!r} is not a peer id (base58, like Qm... or 12D3KooW...): "
                "give the owner id the run's coordinator printed"
            )
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
    if "already taken by another peer" in text:
        return (
            f"a peer of this swarm already runs with identity {cfg.identity_path}: two processes cannot "
            "share one; give this one its own --identity"
        )
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

    def __init__(self, config: NodeConfig, *, identity: Identity | None = None):
        self.config = config
        self.swarm_key: SwarmKey | None = (
            None if config.swarm_key_path is None else load_swarm_key(config.swarm_key_path)
        )
        scratch = None
        if identity is None and config.identity_path is None:
            scratch = tempfile.TemporaryDirectory(prefix="swarmtrain-id-")
            identity = Identity.load(Path(scratch.name) / "peer.key")
        self.identity = identity or Identity.load(config.identity_path)
        self.pins = OwnerPins()
        self._signed: dict[str, tuple[dict, float]] = {}  # key -> this peer's latest (envelope, expiration)
        self._owners: dict[str, str] = {}
        """run id -> the owner whose manifest this node accepted."""
        self._held: dict[tuple[str, str], tuple[dict, float]] = {}
        """(key, owner) -> (envelope, expiration): an owner's signed manifest and run-list
        entry, as read, which this node stores again to keep them alive."""
        self._run_entries: dict[tuple[str, str], tuple[dict, float]] = {}
        """(owner, run id) -> the owner's signed run-list entry, as read."""
        port = config.port
        if config.announce_host and not port:  # the announced address needs its port up front
            port = free_port(config.host)
        host_maddrs = [f"/ip4/{config.host}/tcp/{port}"]
        announce = [f"/ip4/{config.announce_host}/tcp/{port}"] if config.announce_host else None
        try:
            self.dht = hivemind.DHT(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=host_maddrs,
                announce_maddrs=announce,
                client_mode=config.client_mode,
                record_validators=validators(self.swarm_key),
                identity_path=str(self.identity.path),
                check_if_identity_free=config.refuse_taken_identity and bool(config.initial_peers),
                start=True,
            )
        except P2PDaemonError as e:
            raise SwarmError(_explain_daemon_error(e, config)) from None
        finally:
            if scratch is not None:
                scratch.cleanup()
        if self.dht.peer_id.to_base58() != self.identity.peer_id:
            raise SwarmError(
                f"the p2p daemon took peer id {self.dht.peer_id} instead of {self.identity.peer_id}"
            )
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

    # signed records

    def _put(self, key: str, body, expiration_time: float, *, wait: bool = True):
        """Store `body` under `key`, subkey this peer, signed; a future if not `wait`."""
        envelope = sign_record(self.identity, key, body, expiration_time)
        self._signed[key] = (envelope, expiration_time)
        return self.dht.store(
            key, envelope, expiration_time=expiration_time, subkey=self.peer_id, return_future=not wait
        )

    def _signed_by(self, found) -> dict[str, tuple[dict, float]]:
        """{signer: (envelope, expiration)} of a subkeyed lookup (the DHT validated each)."""
        if found is None or not isinstance(found.value, dict):
            return {}
        return {
            str(subkey): (item.value, item.expiration_time)
            for subkey, item in found.value.items()
            if isinstance(item.value, dict) and "body" in item.value
        }

    # manifest

    def publish_manifest(self, manifest: RunManifest, *, ttl_s: float) -> None:
        """Sign and store the run's manifest (this peer is its owner) and its entry in the run list."""
        expires = get_dht_time() + ttl_s
        ok = self._put(manifest_key(manifest.run_id), manifest.to_dict(), expires)
        self._put(RUNS_KEY, run_summary(manifest), expires)
        if not ok:
            logger.warning("manifest of run %s was not stored in the DHT", manifest.run_id)

    async def republish_manifest_async(self, manifest: RunManifest, *, ttl_s: float) -> None:
        """Keep the run's manifest (and its entry in the run list) alive without a coordinator:
        the owner signs it anew; another peer stores again the owner's signed copies it read,
        which keep the expiry the owner signed."""
        if self.owner_of(manifest.run_id) in (None, self.peer_id):
            expires = get_dht_time() + ttl_s
            await self._put(manifest_key(manifest.run_id), manifest.to_dict(), expires, wait=False)
            await self._put(RUNS_KEY, run_summary(manifest), expires, wait=False)
            return
        for key, envelope, expires, owner in self._held_copies(manifest.run_id):
            await self.dht.store(key, envelope, expiration_time=expires, subkey=owner, return_future=True)

    def store_held_manifest(self, run_id: str) -> int:
        """Store again the owner's signed manifest of `run_id` and its run-list entry, as last
        read (`get_manifest`), never signing one: a peer that does not own the run keeps the
        owner's manifest alive. Returns how many records were stored."""
        stored = 0
        for key, envelope, expires, owner in self._held_copies(run_id):
            stored += bool(self.dht.store(key, envelope, expiration_time=expires, subkey=owner))
        return stored

    def _held_copies(self, run_id: str) -> list[tuple[str, dict, float, str]]:
        """(key, envelope, expiration, owner) of the owner's unexpired signed records this node holds."""
        owner = self.owner_of(run_id)
        copies = []
        for key in (manifest_key(run_id), RUNS_KEY):
            held = self._held.get((key, owner))
            if held is not None and held[1] > get_dht_time():
                copies.append((key, held[0], held[1], owner))
        return copies

    def owner_of(self, run_id: str) -> str | None:
        """The owner whose manifest of `run_id` this node accepted (None before it read one)."""
        return self._owners.get(run_id)

    def known_runs(self) -> list[str]:
        runs = set()
        for signer, (envelope, expires) in self._signed_by(self.dht.get(RUNS_KEY, latest=True)).items():
            summary = open_record(envelope)
            runs.add(str(summary["run_id"]))
            self._run_entries[(signer, str(summary["run_id"]))] = (envelope, expires)
        return sorted(runs)

    def get_manifest(self, run_id: str, *, prefer_own: bool = False) -> RunManifest | None:
        """The run's manifest from the owner this peer accepts (see `swarmtrain.trust.owner`;
        with `prefer_own`, this peer's own manifest when it signed one), or None if the DHT has
        none. RunNotFoundError or ConfigError if no owner can be chosen."""
        key = manifest_key(check_run_id(run_id))
        signed = self._signed_by(self.dht.get(key, latest=True))
        if not signed:
            return None
        initial_ids = tuple(a.rsplit("/p2p/", 1)[-1] for a in self.config.initial_peers)
        owner = self.peer_id if prefer_own and self.peer_id in signed else None
        owner = owner or choose_owner(
            run_id,
            sorted(signed),
            run_owner=self.config.run_owner,
            initial_peer_ids=initial_ids,
            pins=self.pins,
        )
        envelope, expires = signed[owner]
        self._held[(key, owner)] = (envelope, expires)
        if (owner, run_id) in self._run_entries:
            self._held[(RUNS_KEY, owner)] = self._run_entries[(owner, run_id)]
        self._owners[run_id] = owner
        manifest = RunManifest.from_dict(open_record(envelope))
        if manifest.replan is None:
            return manifest
        return apply_layout(manifest, self.layout_records(run_id))

    # layouts the trainers moved a run to (`swarmtrain.wire.layout_record`)

    def publish_layout(self, run_id: str, record: LayoutRecord, *, ttl_s: float):
        """Store `record` (planned by this peer) under `{run}.layout`; returns a future."""
        return self._put(layout_key(run_id), record.to_dict(), get_dht_time() + ttl_s, wait=False)

    def layout_records(self, run_id: str) -> list[LayoutRecord]:
        """The layout each trainer last moved the run to (each signed by the trainer it names:
        the DHT checked that and the record's form)."""
        found = self.dht.get(layout_key(run_id), latest=True)
        records = []
        for body in self._points(found):
            try:
                records.append(LayoutRecord.from_dict(body))
            except ConfigError as e:  # validated when stored; a node of another version, say
                logger.debug("ignoring malformed layout record: %s", e)
        return records

    def _private_hint(self) -> str:
        """What to add to 'no run here' when this peer has no swarm key: a private swarm's
        records are unreadable without it, so the swarm looks empty."""
        if self.swarm_key is not None:
            return ""
        return " (if the swarm is private, every peer needs its key: pass --swarm-key FILE)"

    def require_manifest(self, run_id: str | None) -> RunManifest:
        """The manifest of `run_id` (or of the only run, if None); RunNotFoundError otherwise."""
        runs = self.known_runs()
        if run_id is None:
            if len(runs) == 1:
                run_id = runs[0]
            elif not runs:
                raise RunNotFoundError(
                    "no run is announced in this swarm yet: start one with `swarmtrain coordinator`"
                    + self._private_hint()
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
                    f"`swarmtrain coordinator --run-id {run_id}`" + self._private_hint()
                )
            known = ", ".join(repr(r) for r in runs)
            raise RunNotFoundError(
                f"no run {run_id!r} in this swarm; it announces {known}: pass one of those as --run-id"
            )
        return manifest

    # membership

    async def announce_async(self, run_id: str, record: PeerRecord, *, ttl_s: float) -> bool:
        return await self._put(peers_key(run_id), record.to_dict(), get_dht_time() + ttl_s, wait=False)

    def announce(self, run_id: str, record: PeerRecord, *, ttl_s: float) -> bool:
        return self._put(peers_key(run_id), record.to_dict(), get_dht_time() + ttl_s)

    @staticmethod
    def _parse_peers(found) -> list[PeerRecord]:
        if found is None or not isinstance(found.value, dict):
            return []
        records = []
        for subkey, item in found.value.items():
            try:
                record = PeerRecord.from_dict(open_record(item.value))
            except (ConfigError, KeyError, TypeError, ValueError) as e:
                logger.debug("ignoring malformed peer record %s: %s", subkey, e)
                continue
            if record.peer_id == subkey:
                records.append(record)
        return sorted(records, key=lambda r: (r.stage, r.peer_id))

    def publish_trainer_point(self, run_id: str, point, *, ttl_s: float):
        """Store a trainer's latest point (`wire.metrics.TrainerPoint`) under `{run}.trainers`,
        keyed by this peer; returns a future (fire and forget, or wait on it before leaving)."""
        return self._put(trainers_key(run_id), point.to_dict(), get_dht_time() + ttl_s, wait=False)

    @staticmethod
    def _points(found) -> list[dict]:
        if found is None or not isinstance(found.value, dict):
            return []
        return [open_record(item.value) for item in found.value.values() if isinstance(item.value, dict)]

    def trainer_points(self, run_id: str) -> list[dict]:
        """The latest point each live trainer published (raw dicts, each signed by the trainer it
        names: the DHT checked that; the reader validates the rest)."""
        return self._points(self.dht.get(trainers_key(run_id), latest=True))

    async def trainer_points_async(self, run_id: str) -> list[dict]:
        return self._points(await self.dht.get(trainers_key(run_id), latest=True, return_future=True))

    async def peers_async(self, run_id: str) -> list[PeerRecord]:
        return self._parse_peers(await self.dht.get(peers_key(run_id), latest=True, return_future=True))

    def membership_proof(self, run_id: str) -> list | None:
        """This peer's latest signed record of `run_id`, as a frame carries it to a peer whose view
        of the run may lack it (`trust.records.member_proof`); None before the first announcement."""
        signed = self._signed.get(peers_key(run_id))
        return None if signed is None else member_proof(*signed)

    def peers(self, run_id: str) -> list[PeerRecord]:
        return self._parse_peers(self.dht.get(peers_key(run_id), latest=True))


def fresher_view(previous: list[PeerRecord], read: list[PeerRecord], own: str) -> list[PeerRecord]:
    """The run's peer records after a re-read: `read` itself when it holds `own` (this peer's
    record, which it announces every heartbeat: a whole read), else `previous` updated with
    the records `read` holds. Over a congested link a DHT read can come back from a node that
    missed some stores, or with nothing at all; a peer whose record such a read lacks has not
    left for that (a peer that left drops out of the next whole read, once its record expires),
    and forgetting it would refuse its frames as an outsider's."""
    if any(r.peer_id == own for r in read):
        return read
    merged = {r.peer_id: r for r in previous} | {r.peer_id: r for r in read}
    return sorted(merged.values(), key=lambda r: (r.stage, r.peer_id))


def stage_replicas(records: list[PeerRecord], layout: int | None = None) -> dict[int, list[PeerRecord]]:
    """The serving peers of each stage (of layout version `layout`, when given), earliest first
    (ties broken by peer id)."""
    out: dict[int, list[PeerRecord]] = {}
    for r in sorted(records, key=lambda r: (r.since, r.peer_id)):
        if r.role == "stage" and r.state == "serving" and (layout is None or r.layout == layout):
            out.setdefault(r.stage, []).append(r)
    return out
