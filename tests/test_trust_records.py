"""Signed DHT records, identities, run owners and the private swarm's record seal.

Most forgeries are checked against the validator directly (milliseconds); a few real DHT
nodes on 127.0.0.1 show that a forged record is dropped by the node asked to store it and a
keyless node can neither read nor write a private swarm's records.
"""

import base64
import dataclasses

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmtrain.errors import ConfigError, RunNotFoundError
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.trust import generate_swarm_key, load_swarm_key
from swarmtrain.trust.identity import Identity, data_dir
from swarmtrain.trust.owner import OwnerPins, choose_owner
from swarmtrain.trust.records import RecordValidator, SealValidator, check_envelope, sign_record
from swarmtrain.wire.keys import manifest_key, peers_key
from swarmtrain.wire.records import PeerRecord, RunManifest


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    return [Identity.load(folder / f"k{i}.key") for i in range(3)]


def manifest(run_id="run-1", **kw) -> RunManifest:
    return RunManifest(run_id=run_id, model="tiny-gpt", num_blocks=2, stage_bounds=(0, 1, 2), **kw)


def record(key: str, subkey: str, envelope, expiration: float) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(envelope),
        expiration,
    )


def signed(identity, key, body, expiration=None, subkey=None) -> DHTRecord:
    expiration = expiration or get_dht_time() + 60
    return record(key, subkey or identity.peer_id, sign_record(identity, key, body, expiration), expiration)


def peer_body(identity, **kw) -> dict:
    return PeerRecord(peer_id=identity.peer_id, role="stage", stage=0, **kw).to_dict()


def test_a_signed_record_passes_and_every_forgery_is_named(keys):
    me, other, _ = keys
    key = peers_key("run-1")
    good = signed(me, key, peer_body(me))
    assert check_envelope(good) == key
    assert RecordValidator().validate(good)

    forgeries = {
        # a record claiming another peer's id, signed by me, under that peer's subkey
        "not signed by that peer": signed(me, key, peer_body(other), subkey=other.peer_id),
        # my key, but a record about someone else under my own subkey
        "signed by": signed(me, key, peer_body(other)),
        # the body changed after signing (a higher step)
        "bad signature": dataclasses.replace(
            good,
            value=MSGPackSerializer.dumps(
                sign_record(me, key, peer_body(me), good.expiration_time)
                | {"body": MSGPackSerializer.dumps(peer_body(me, step=10**6))}
            ),
        ),
        # replayed with a later expiry than the one signed
        "bad signature on": dataclasses.replace(good, expiration_time=good.expiration_time + 3600),
        # stored under another key than the one it names
        "stored under another": dataclasses.replace(
            good, key=DHTID.generate(source="run-2.peers").to_bytes()
        ),
        "not a signed swarmtrain record": record(
            key, me.peer_id, {"peer_id": me.peer_id}, get_dht_time() + 60
        ),
        "is not a swarmtrain key": signed(me, "run-1.secrets", {"x": 1}),
        "unknown fields": signed(me, key, peer_body(me) | {"evil": 1}),
        "manifest of run 'run-2' stored under run 'run-1'": signed(
            me, manifest_key("run-1"), manifest("run-2").to_dict()
        ),
        "must rise strictly": signed(
            me, manifest_key("run-1"), manifest().to_dict() | {"stage_bounds": [0, 2, 1]}
        ),
    }
    validator = RecordValidator()
    for reason, forged in forgeries.items():
        with pytest.raises(ConfigError, match=reason):
            check_envelope(forged)
        assert not validator.validate(forged), reason
    assert validator.rejected == len(forgeries)


def test_a_record_too_big_or_undecodable_is_refused_before_any_signature_check(keys):
    me = keys[0]
    good = signed(me, peers_key("run-1"), peer_body(me))
    with pytest.raises(ConfigError, match="bytes"):
        check_envelope(dataclasses.replace(good, value=b"\x00" * (65 * 1024)))
    with pytest.raises(ConfigError, match="undecodable"):
        check_envelope(dataclasses.replace(good, value=b"\xc1\xff"))


def test_the_seal_binds_a_record_to_the_swarm_key_and_its_place(tmp_path, keys):
    me = keys[0]
    seal = SealValidator(generate_swarm_key(tmp_path / "a.key"))
    other = SealValidator(generate_swarm_key(tmp_path / "b.key"))
    good = signed(me, peers_key("run-1"), peer_body(me))
    sealed = dataclasses.replace(good, value=seal.sign_value(good))
    assert seal.validate(sealed) and seal.strip_value(sealed) == good.value
    assert me.peer_id.encode() not in sealed.value  # a keyless reader learns nothing of the record
    assert not other.validate(sealed)
    assert not seal.validate(good)  # an unsealed record is not one of the swarm's
    assert not seal.validate(dataclasses.replace(sealed, expiration_time=sealed.expiration_time + 1))
    assert not RecordValidator().validate(sealed)  # and an open swarm's nodes drop sealed ones


def test_swarm_key_files_are_checked_with_clear_errors(tmp_path):
    key = generate_swarm_key(tmp_path / "swarm.key")
    assert load_swarm_key(tmp_path / "swarm.key") == key
    assert key.secret.hex() not in repr(key)
    assert (tmp_path / "swarm.key").stat().st_mode & 0o077 == 0
    with pytest.raises(ConfigError, match="already exists: keygen never overwrites"):
        generate_swarm_key(tmp_path / "swarm.key")
    with pytest.raises(ConfigError, match="no such file; make one with `swarmtrain keygen PATH`"):
        load_swarm_key(tmp_path / "missing.key")
    (tmp_path / "bad.key").write_text("hello\n")
    with pytest.raises(ConfigError, match="is not a swarm key file"):
        load_swarm_key(tmp_path / "bad.key")
    (tmp_path / "short.key").write_text("swarmtrain-swarm-key-v1\nabcd\n")
    with pytest.raises(ConfigError, match="64 hex digits"):
        load_swarm_key(tmp_path / "short.key")


def test_identities_persist_and_default_ones_are_one_per_running_peer(tmp_path):
    first = Identity.load(tmp_path / "me.key")
    assert Identity.load(tmp_path / "me.key").peer_id == first.peer_id
    a, b = Identity.default("stage"), Identity.default("stage")
    assert a.path != b.path and a.peer_id != b.peer_id
    assert a.path.parent == data_dir() / "identity"
    (tmp_path / "junk.key").write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="is not a peer key"):
        Identity.load(tmp_path / "junk.key")
    with pytest.raises(ConfigError, match="does not exist; create it first"):
        Identity.load(tmp_path / "no" / "such" / "me.key")


def test_the_owner_is_the_one_told_else_addressed_else_pinned_else_the_only_one(tmp_path, keys):
    a, b, _ = (k.peer_id for k in keys)
    pins = OwnerPins(tmp_path / "pins.json")
    choose = lambda owners, **kw: choose_owner(  # noqa: E731
        "run-1", owners, **({"run_owner": None, "initial_peer_ids": (), "pins": pins} | kw)
    )
    with pytest.raises(ConfigError, match="announced by 2 different owners .*pass --run-owner"):
        choose([a, b])
    assert choose([a, b], run_owner=b) == b  # told, and now pinned
    with pytest.raises(RunNotFoundError, match=f"no manifest signed by --run-owner {a}"):
        choose([b], run_owner=a)
    assert choose([a, b]) == b  # the pin settles it
    with pytest.raises(ConfigError, match=f"this machine pinned owner {b} .* pass --run-owner"):
        choose([a])  # a forger alone in the DHT does not win over the pin
    assert choose([a, b], initial_peer_ids=(a,)) == a  # the address it was given names the owner
    assert pins.get("run-1") == a
    assert choose(["x" * 46], pins=OwnerPins(tmp_path / "fresh.json")) == "x" * 46  # first use


def test_dht_nodes_drop_forged_records_and_pick_the_owners_manifest(tmp_path):
    owner = SwarmNode(NodeConfig(identity_path=str(tmp_path / "owner.key")))
    try:
        addr = owner.addresses()[:1]
        forger = SwarmNode(NodeConfig(initial_peers=tuple(addr)))
        reader = SwarmNode(NodeConfig(initial_peers=tuple(addr), client_mode=True))
        try:
            owner.publish_manifest(manifest(trainers=(owner.peer_id,)), ttl_s=60)
            forger.publish_manifest(manifest(seed=666), ttl_s=120)  # same run id, its own signature
            forger.announce("run-1", PeerRecord(peer_id=forger.peer_id, role="stage", stage=0), ttl_s=60)
            # a record claiming the owner's id, signed by the forger: every node refuses to store it
            now = get_dht_time()
            body = PeerRecord(peer_id=owner.peer_id, role="stage", stage=1, step=99).to_dict()
            envelope = sign_record(forger.identity, peers_key("run-1"), body, now + 60)
            assert not forger.dht.store(peers_key("run-1"), envelope, now + 60, subkey=owner.peer_id)
            assert [r.peer_id for r in reader.peers("run-1")] == [forger.peer_id]

            # the reader was given the owner's address: its manifest wins over the forger's
            got = reader.get_manifest("run-1")
            assert got.seed == 0 and reader.owner_of("run-1") == owner.peer_id
            # a peer given only the forger's address, with no pin, must choose
            confused = SwarmNode(NodeConfig(initial_peers=tuple(forger.addresses()[:1]), client_mode=True))
            try:
                assert confused.get_manifest("run-1").seed == 666  # it was told the forger's address
                with pytest.raises(RunNotFoundError, match="--run-owner"):
                    SwarmNode.get_manifest(_with_owner(confused, reader.identity.peer_id), "run-1")
            finally:
                confused.shutdown()
        finally:
            forger.shutdown()
            reader.shutdown()
    finally:
        owner.shutdown()


def _with_owner(node: SwarmNode, owner: str) -> SwarmNode:
    node.config = dataclasses.replace(node.config, run_owner=owner)
    return node


def test_a_private_swarms_records_are_unreadable_and_unwritable_without_its_key(tmp_path):
    key = str(tmp_path / "swarm.key")
    generate_swarm_key(key)
    keyed = SwarmNode(NodeConfig(swarm_key_path=key))
    try:
        addr = tuple(keyed.addresses()[:1])
        member = SwarmNode(NodeConfig(initial_peers=addr, swarm_key_path=key, client_mode=True))
        outsider = SwarmNode(NodeConfig(initial_peers=addr))
        try:
            keyed.publish_manifest(manifest(), ttl_s=60)
            assert member.known_runs() == ["run-1"] and member.get_manifest("run-1") == manifest()
            assert outsider.known_runs() == [] and outsider.get_manifest("run-1") is None
            outsider.announce("run-1", PeerRecord(peer_id=outsider.peer_id, role="stage", stage=0), ttl_s=60)
            member.announce("run-1", PeerRecord(peer_id=member.peer_id, role="stage", stage=1), ttl_s=60)
            assert [r.peer_id for r in keyed.peers("run-1")] == [member.peer_id]
        finally:
            member.shutdown()
            outsider.shutdown()
    finally:
        keyed.shutdown()


@pytest.mark.swarm
def test_a_coordinators_address_survives_a_restart(tmp_path):
    """Same key file, and the port it had last time: the address peers were given still works."""
    import subprocess

    from swarmtrain.peers.launcher import cli_command
    from tests.conftest import wait_until

    def start_and_stop() -> str:
        address_file = tmp_path / "address"
        address_file.unlink(missing_ok=True)
        proc = subprocess.Popen(
            cli_command("coordinator", "--run-id", "same", "--model-config", "n_layer=2,d_model=16,n_head=2",
                        "--stages", "2", "--address-file", str(address_file)),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_until(address_file.exists, timeout_s=60, what="the coordinator's address")
            return address_file.read_text().strip()
        finally:
            proc.terminate()
            proc.wait(30)

    first = start_and_stop()
    assert start_and_stop() == first
    assert first.endswith(Identity.load(data_dir() / "identity" / "coordinator-0.key").peer_id)


def test_a_membership_proof_opens_for_its_signer_and_every_forgery_is_named(keys):
    from swarmtrain.trust.records import member_proof, open_member_proof

    me, other, _ = keys
    key, now = peers_key("run-1"), get_dht_time()
    proof = member_proof(sign_record(me, key, peer_body(me), now + 30), now + 30)
    assert open_member_proof(proof, key=key, signer=me.peer_id, now=now)["peer_id"] == me.peer_id

    def refused(p, match, *, signer=me.peer_id, at=now, for_key=key):
        with pytest.raises(ConfigError, match=match):
            open_member_proof(p, key=for_key, signer=signer, now=at)

    refused(proof, "signed by another peer than the caller", signer=other.peer_id)  # replayed by another
    assert open_member_proof(proof, key=key, signer=me.peer_id, now=now + 89)  # in flight past its life
    refused(proof, "expired over 60 s ago", at=now + 91)
    refused(proof, "not of", for_key=peers_key("run-2"))

    def made(fields) -> str:
        return base64.b64encode(MSGPackSerializer.dumps(fields)).decode()

    fields = MSGPackSerializer.loads(base64.b64decode(proof))
    refused(made([*fields[:4], now + 300]), "bad signature")  # its life stretched
    refused(
        made([fields[0], MSGPackSerializer.dumps(peer_body(me) | {"stage": 1}), *fields[2:]]), "bad signature"
    )
    refused(made(fields[:4]), r"\[key, body, pub, sig, expiration\]")
    refused(made([fields[0], "body", *fields[2:]]), "wrong types")
    refused("not base64!", "base64 of msgpack")
    refused(["a", "list"], "a string")
    # another peer's record signed by me is no proof of its membership
    forged = member_proof(sign_record(me, key, peer_body(other), now + 30), now + 30)
    refused(forged, "", signer=me.peer_id)
