"""Layouts the trainers re-plan (`swarmtrain.wire.layout_record`): the run's rule travels in its
manifest, the lead trainer's signed layout record lays a newer layout over the owner's, every
peer reads the same one, a record nobody authorized (or a forged one) changes nothing, and the
owner's coordinator signs the layout its trainers moved the run to into its manifest."""

import dataclasses

import pytest
from hivemind.utils import get_dht_time

from swarmtrain.errors import ConfigError
from swarmtrain.peers.coordinator import Coordinator, CoordinatorConfig
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.trust.records import sign_record
from swarmtrain.wire.keys import layout_key
from swarmtrain.wire.layout_record import LayoutRecord, ReplanConfig, apply_layout, fits, lead_trainer
from swarmtrain.wire.records import RunManifest
from tests.conftest import wait_until

A, B, C = (f"Qm{'A' * 40}{i}" for i in (1, 2, 3))


def manifest(**kw) -> RunManifest:
    fields = {"run_id": "run-1", "model": "tiny-gpt", "num_blocks": 6, "stage_bounds": (0, 3, 6)}
    return RunManifest(**(fields | {"replan": ReplanConfig(), "trainers": (A, B)} | kw))


def layout(version=2, planner=A, bounds=(0, 2, 6), at=1.0, **kw) -> LayoutRecord:
    return LayoutRecord(planner=planner, version=version, stage_bounds=bounds, at=at, **kw)


def test_the_rule_and_the_record_round_trip_and_name_what_is_wrong():
    rule = ReplanConfig(min_gain=0.3, patience=2, every_s=1)
    assert ReplanConfig.from_dict(rule.to_dict()) == rule and rule.every_s == 1.0
    m = manifest(replan=rule)
    assert RunManifest.from_dict(m.to_dict()) == m
    assert RunManifest.from_dict(m.to_dict() | {"replan": None}).replan is None
    record = layout(assignments={B: 1, A: 0}, note="why")
    assert LayoutRecord.from_dict(record.to_dict()) == record
    assert list(record.assignments) == [A, B]  # sorted: the same record from any order

    for fields, message in [
        ({"min_gain": -1}, "min_gain must be a finite number >= 0"),
        ({"patience": 0}, "patience must be an integer >= 1"),
        ({"every_s": 0}, "--replan-every"),
        ({"often": 1}, "unknown fields"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ReplanConfig.from_dict(ReplanConfig().to_dict() | fields)
    for fields, message in [
        ({"version": 1}, "version must be an integer >= 2"),
        ({"stage_bounds": [0, 4, 4]}, "must rise strictly from 0"),
        ({"stage_bounds": [1, 6]}, "must rise strictly from 0"),
        ({"assignments": {A: 2}}, "to stages 0..1"),
        ({"planner": "me"}, "planner must be a peer id"),
        ({"note": "x" * 301}, "at most 300 characters"),
        ({"at": float("nan")}, "at must be a DHT time"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LayoutRecord.from_dict(record.to_dict() | fields)
    with pytest.raises(ConfigError, match="replan must be a mapping"):
        manifest(replan="often")


def test_the_newest_layout_of_an_authorized_trainer_is_the_runs():
    m = manifest()
    newest = apply_layout(
        m, [layout(2, A, at=5.0), layout(3, B, (0, 4, 6), note="later", assignments={A: 1})]
    )
    assert (newest.layout_version, newest.stage_bounds, newest.layout_note) == (3, (0, 4, 6), "later")
    assert newest.assignments == {A: 1} and newest.layout_at == 1.0
    assert (
        dataclasses.replace(
            newest,
            stage_bounds=m.stage_bounds,
            assignments={},
            layout_version=1,
            layout_note="",
            layout_at=0.0,
        )
        == m
    )  # fmt: skip  (nothing else changes)
    # the same records in any order, and a tie of versions decided the same way everywhere
    tie = [layout(2, A, (0, 1, 6), at=2.0), layout(2, B, (0, 5, 6), at=2.0)]
    assert apply_layout(m, tie).stage_bounds == apply_layout(m, tie[::-1]).stage_bounds == (0, 5, 6)

    ignored = {
        "a trainer the run does not authorize": layout(planner=C),
        "not newer than the manifest's": layout(version=2, bounds=(0, 1, 6)),
        "another stage count": layout(version=3, bounds=(0, 2, 4, 6)),
        "other blocks": layout(version=3, bounds=(0, 2, 8)),
    }
    at_two = dataclasses.replace(m, layout_version=2)
    for why, record in ignored.items():
        assert apply_layout(at_two, [record]) == at_two, why
    assert not fits(dataclasses.replace(m, replan=None), layout())  # the owner did not opt in
    assert not fits(dataclasses.replace(m, layout_version=0), layout())  # its first layout is pending
    assert fits(manifest(trainers=()), layout(planner=C))  # an open run: any trainer


def test_the_lead_trainer_is_the_least_authorized_live_one():
    assert lead_trainer(manifest(), [C, B, A]) == A
    assert lead_trainer(manifest(), [C, B]) == B  # the lead went: the next one leads
    assert lead_trainer(manifest(), [C]) is None
    assert lead_trainer(manifest(trainers=()), [C, B]) == B


def test_a_trainers_layout_reaches_every_peer_and_the_owner_signs_it_in(tmp_path):
    """Over real DHT nodes: the authorized trainer's layout is every reader's; an outsider's
    record changes nothing and one forged in the trainer's name is not stored; the owner's
    coordinator signs the layout into its manifest, so it outlives the record."""
    trainer_key = tmp_path / "trainer.key"
    trainer = SwarmNode(NodeConfig(identity_path=str(trainer_key)))
    trainer_id = trainer.peer_id
    config = CoordinatorConfig(
        node=NodeConfig(initial_peers=tuple(trainer.addresses()[:1])),
        model_config={"n_layer": 4},
        num_stages=2,
        trainers=(trainer_id,),
        replan=ReplanConfig(every_s=1),
        republish_s=0.2,
    )
    coordinator = Coordinator(config)
    outsider = SwarmNode(NodeConfig(initial_peers=tuple(coordinator.addresses[:1])))
    reader = SwarmNode(NodeConfig(initial_peers=tuple(coordinator.addresses[:1]), client_mode=True))
    try:
        run_id = coordinator.manifest.run_id
        assert reader.get_manifest(run_id).layout_version == 1
        record = LayoutRecord(
            planner=trainer_id, version=2, stage_bounds=(0, 1, 4), note="re-planned", at=get_dht_time()
        )
        trainer.publish_layout(run_id, record, ttl_s=3).result()
        outsider.publish_layout(
            run_id, dataclasses.replace(record, planner=outsider.peer_id, version=9), ttl_s=60
        )
        # a record in the trainer's name signed by the outsider: no node stores it
        now = get_dht_time()
        forged = dataclasses.replace(record, version=7, stage_bounds=(0, 3, 4)).to_dict()
        envelope = sign_record(outsider.identity, layout_key(run_id), forged, now + 60)
        assert not outsider.dht.store(layout_key(run_id), envelope, now + 60, subkey=trainer_id)

        wait_until(lambda: reader.get_manifest(run_id).layout_version == 2, timeout_s=20, what="the layout")
        got = reader.get_manifest(run_id)
        assert (got.stage_bounds, got.layout_note) == ((0, 1, 4), "re-planned")
        assert {r.planner for r in reader.layout_records(run_id)} == {trainer_id, outsider.peer_id}
        wait_until(
            lambda: coordinator.manifest.layout_version == 2, timeout_s=20, what="the owner to sign it"
        )
        # the trainer's record expires (3 s); the layout stays the run's: the owner signed it
        wait_until(
            lambda: trainer_id not in {r.planner for r in reader.layout_records(run_id)},
            timeout_s=20,
            what="the trainer's record to expire",
        )
        assert reader.get_manifest(run_id).stage_bounds == (0, 1, 4)
    finally:
        for node in (reader, outsider, trainer):
            node.shutdown()
        coordinator.close()
