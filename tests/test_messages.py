"""Typed protocol messages: each record round-trips through a frame, and each bad field is
refused with a message that names it."""

import pytest

from swarmtrain.errors import BadFrameError
from swarmtrain.wire.frames import MAX_META_LIST, Frame, encode_frame
from swarmtrain.wire.messages import (
    NO_PREFERENCE,
    Abort,
    Applied,
    Apply,
    Claim,
    CommitRequest,
    Exchange,
    Exchanged,
    ForwardMeta,
    GradsMeta,
    PongMeta,
    Prepare,
    Prepared,
    Readiness,
    ResultMeta,
    Status,
    StepStatus,
)
from tests.test_wire import read_bytes

RECORDS = [
    ForwardMeta(loss_scale=0.25, budget_s=12.5),
    ForwardMeta(
        loss_scale=1.0,
        budget_s=3.0,
        order=7,
        replay=True,
        prefer=("QmA", NO_PREFERENCE),
        needed_by=(1,),
        slots=(1, 0),
        slot_counts=(2, 1),
        microbatches=8,
    ),
    ResultMeta(
        loss=2.5, route=("QmA", "QmB"), replays=2, service_s=0.1, r_backlog=0.5, r_service=0.02, r_queue=3
    ),
    Prepared(fresh=("t:0.0:1", "t:0.0:2"), held=()),
    Exchange(fresh=("t:0.0:1",), take=("t:0.0:3",), group=("QmA", "QmB"), attempt=2),
    Exchanged(grad_sq_norm=2.25),
    Exchanged(),
    Apply(grad_scale=1.5, digest=True),
    Applied(digest="abc"),
    Applied(),
    GradsMeta(attempt=1),
    StepStatus(
        committer="QmA",
        exchanged=True,
        next_attempt=3,
        applied_step=4,
        applied_scale=0.5,
        counted=("t:4.0:1",),
    ),
    StepStatus(),
    PongMeta(state="serving", served=3, failed=1, in_flight=2, r_backlog=0.1),
    Readiness(r_backlog=1.0, r_service=0.5, r_queue=4),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_round_trip_through_a_frame(record):
    frame = Frame(kind="result", run_id="r", meta=record.to_meta())
    got = read_bytes(b"".join(bytes(b) for b in encode_frame(frame)))
    assert type(record).from_meta(got.meta) == record


@pytest.mark.parametrize(
    "request_",
    [
        Prepare(),
        Exchange(fresh=(), take=(), group=("QmA",)),
        Apply(),
        Abort(),
        Claim(replaces=("QmA",)),
        Status(),
    ],
)
def test_commit_requests_parse_by_phase(request_):
    assert CommitRequest.parse(request_.to_meta()) == request_


@pytest.mark.parametrize(
    ("record", "meta", "match"),
    [
        (ForwardMeta, {"budget_s": 1.0}, "forward meta lacks 'loss_scale'"),
        (ForwardMeta, {"loss_scale": 0.0, "budget_s": 1.0}, r"'loss_scale' must be a number in \(0, 1\]"),
        (ForwardMeta, {"loss_scale": 0.5, "budget_s": float("nan")}, "'budget_s' must be a number"),
        (ForwardMeta, {"loss_scale": 0.5, "budget_s": 1.0, "order": -1}, "'order' must be an int >= 0"),
        (ForwardMeta, {"loss_scale": 0.5, "budget_s": 1.0, "replay": 1}, "'replay' must be a bool"),
        (
            ForwardMeta,
            {"loss_scale": 0.5, "budget_s": 1.0, "prefer": "QmA QmB"},
            "'prefer' must be a list of strings",
        ),
        (
            ForwardMeta,
            {"loss_scale": 0.5, "budget_s": 1.0, "needed_by": ["1"]},
            "'needed_by' must be a list of ints",
        ),
        (
            ForwardMeta,
            {"loss_scale": 0.5, "budget_s": 1.0, "slots": [2], "slot_counts": [2], "microbatches": 4},
            "slots",
        ),
        (
            ForwardMeta,
            {"loss_scale": 0.5, "budget_s": 1.0, "slots": [0], "slot_counts": [1]},
            "needs microbatches",
        ),
        (ForwardMeta, {"loss_scale": 0.5, "budget_s": 1.0, "route": "a b"}, r"unknown fields \['route'\]"),
        (ResultMeta, {"loss": "2.5", "route": []}, "'loss' must be a number"),
        (ResultMeta, {"loss": 2.5, "route": ["a" * 200]}, "'route' must be a list of strings of at most 128"),
        (Prepared, {"fresh": "a b"}, "'fresh' must be a list of strings"),
        (
            Exchange,
            {"phase": "exchange", "fresh": [], "take": [], "group": ["QmA"], "attempt": 1.0},
            "'attempt' must be an int",
        ),
        (Exchanged, {"grad_sq_norm": -1.0}, r"'grad_sq_norm' must be a number in \[0, inf\]"),
        (Exchanged, {"grad_sq_norm": float("nan")}, "'grad_sq_norm' must be a number"),
        (Exchanged, {"grad_sq_norm": float("inf")}, "'grad_sq_norm' must be a number"),
        (Exchanged, {"grad_sq_norm": "4"}, "'grad_sq_norm' must be a number"),
        (Exchanged, {"norm": 4.0}, r"exchanged meta has unknown fields \['norm'\]"),
        (Apply, {"phase": "apply", "grad_scale": 0.0}, r"'grad_scale' must be a number in \(0, 1000"),
        (Apply, {"phase": "apply", "grad_scale": 1.0, "digest": "yes"}, "'digest' must be a bool"),
        (GradsMeta, {"attempt": True}, "'attempt' must be an int"),
        (Apply, {"phase": "abort"}, "apply meta must have phase 'apply', got 'abort'"),
    ],
)
def test_bad_fields_are_refused_by_name(record, meta, match):
    with pytest.raises(BadFrameError, match=match):
        record.from_meta(meta)


def test_an_unknown_commit_phase_is_refused():
    with pytest.raises(
        BadFrameError,
        match=r"unknown commit phase 'launch' \(known: prepare, exchange, apply, abort, rollback, relayout, claim, status\)",
    ):
        CommitRequest.parse({"phase": "launch"})
    with pytest.raises(BadFrameError, match="unknown commit phase None"):
        CommitRequest.parse({})


def test_a_forward_names_its_preferred_replica_per_stage():
    meta = ForwardMeta(loss_scale=1.0, budget_s=1.0, prefer=("QmA", NO_PREFERENCE))
    assert (meta.preferred(0), meta.preferred(1), meta.preferred(2)) == ("QmA", None, None)


def test_a_commit_phase_of_the_wrong_type_is_a_bad_frame_not_an_internal_error():
    for phase in ([], {}, None, 3):
        with pytest.raises(BadFrameError, match="unknown commit phase"):
            CommitRequest.parse({"phase": phase})


def test_a_static_step_cannot_claim_more_microbatches_than_a_commit_can_list():
    slots = {"slots": [0, 0], "slot_counts": [1, 1], "loss_scale": 0.5, "budget_s": 1.0}
    assert ForwardMeta.from_meta(slots | {"microbatches": MAX_META_LIST}).microbatches == MAX_META_LIST
    with pytest.raises(BadFrameError, match=r"'microbatches' must be an int in \[1, 4096\]"):
        ForwardMeta.from_meta(slots | {"microbatches": 2**62})
