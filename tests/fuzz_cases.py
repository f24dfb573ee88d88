"""What an outsider throws at a live swarm's stage peers (tests/test_fuzz.py): hypothesis
strategies of attempts, each bytes for one stage's peer.

Every attempt is built so that it cannot be a well-formed request that changes a replica's
state (a forward it would compute, a commit phase, gradients for an exchange): whether an
outsider may send those is the peers' authorization, a strategy list of its own once peers
authorize callers. Byte mutations start from frames of another run, or from frames no peer
acts on (pings, replies); field mutations each break a check made before any state changes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import torch
from hypothesis import strategies as st

from swarmtrain.wire.codec import known_codecs
from swarmtrain.wire.frames import DTYPES, FRAME_KINDS, MAGIC, MAX_HEADER_BYTES, PREFIX, Frame, encode_frame
from swarmtrain.wire.messages import Abort, Apply, Exchange, ForwardMeta, GradsMeta, PongMeta, Prepare
from tests.conftest import TINY_GPT

RUN = "fuzz"
OTHER_RUN = "elsewhere"
"""Byte mutations of its frames cannot reach RUN's id: another length, no common prefix."""
NUM_STAGES = 2
MICROBATCH_SIZE = 4
B, T, C, V = MICROBATCH_SIZE, TINY_GPT["seq_len"], TINY_GPT["d_model"], TINY_GPT["vocab_size"]
MAX_FRAME_BYTES = 2**20
"""The fuzzed peers' --max-frame-mb 1."""


@dataclass(frozen=True)
class Attempt:
    """Bytes to send to one stage's peer, and whether a pong is a fine answer (a ping may
    survive a mutation, or be one)."""

    stage: int
    data: bytes
    may_pong: bool = False


# frames to start from


def encoded(frame: Frame) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(frame))


def stage_input(stage: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(stage)
    return torch.randint(0, V, (B, T), generator=g) if stage == 0 else torch.randn(B, T, C, generator=g)


def targets() -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


FORWARD_META = ForwardMeta(loss_scale=0.5, budget_s=20.0).to_meta()


def forward(stage: int, *, run_id: str = RUN, **fields) -> Frame:
    """A valid forward to `stage` of step 0, but for `fields` replaced."""
    frame = dict(
        kind="forward",
        run_id=run_id,
        mb_id="outsider:0:0",
        stage=stage,
        step=0,
        tensors={"x": stage_input(stage), "targets": targets()},
        meta=dict(FORWARD_META),
    )
    return Frame(**(frame | fields))


def other_run_frames(stage: int) -> list[Frame]:
    """A frame of every kind a stage peer is sent, well formed but for another run."""
    o = OTHER_RUN
    grads = {str(i): torch.randn(3, 5) for i in range(3)}
    return [
        forward(stage, run_id=o),
        forward(stage, run_id=o, codecs={"x": "int8"}) if stage else forward(stage, run_id=o, mb_id="o:1:2"),
        Frame(kind="step", run_id=o, stage=stage, step=0, meta=Prepare().to_meta()),
        Frame(kind="step", run_id=o, stage=stage, step=0, meta=Apply(grad_scale=0.5).to_meta()),
        Frame(kind="grads", run_id=o, stage=stage, step=0, tensors=grads, meta=GradsMeta().to_meta()),
        Frame(kind="state", run_id=o, stage=stage),
        Frame(kind="ping", run_id=o, stage=stage),
    ]


def inert_frames(stage: int) -> list[Frame]:
    """Frames of this run that no peer acts on: a ping, and replies sent as requests."""
    return [
        Frame(kind="ping", run_id=RUN, stage=stage),
        Frame(kind="pong", run_id=RUN, stage=stage, meta=PongMeta(state="serving").to_meta()),
        Frame(kind="result", run_id=RUN, stage=stage, mb_id="t:0:0", tensors={"grad": torch.randn(B, T, C)}),
        Frame(kind="step_done", run_id=RUN, stage=stage, meta={"fresh": ["t:0:0"]}),
        Frame(
            kind="state_data", run_id=RUN, stage=stage, tensors={"w": torch.randn(4, 4), "n": torch.arange(3)}
        ),
        Frame(kind="error", run_id=RUN, stage=stage, meta={"error": "x", "cause": "bad_frame"}),
    ]


BASES = [
    (stage, encoded(frame), frame.kind in ("ping", "pong") and frame.run_id == RUN)
    for stage in range(NUM_STAGES)
    for frame in [*other_run_frames(stage), *inert_frames(stage)]
]
"""(stage, encoded frame, whether a mutation may leave a ping of this run)."""

stages = st.integers(0, NUM_STAGES - 1)


# framing: what read_frame must refuse, or survive


@st.composite
def random_bytes(draw) -> Attempt:
    # At least a prefix's worth: a shorter request waits out the read timeout (as truncated
    # frames and the unkept promises of test_fuzz do), which would cost a second an example.
    data = draw(st.binary(min_size=PREFIX.size, max_size=512))
    if draw(st.booleans()):
        data = MAGIC + data  # past the magic check, into the lengths and the header
    return Attempt(draw(stages), data)


@st.composite
def mutated_frames(draw) -> Attempt:
    stage, data, may_pong = draw(st.sampled_from(BASES))
    data = bytearray(data)
    how = draw(st.sampled_from(["flip bits", "truncate", "append"]))
    if how == "flip bits":  # at most 3: no flip of another run's id reaches RUN's
        for _ in range(draw(st.integers(1, 3))):
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    else:
        data += draw(st.binary(min_size=1, max_size=64))
    return Attempt(stage, bytes(data), may_pong)


LENGTH_EDGES = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
"""u32/u64 lengths at sign boundaries: what a sender's negative length becomes on the wire."""


@st.composite
def lying_prefixes(draw) -> Attempt:
    """A ping's header behind a prefix whose lengths lie: oversize, 'negative', off by some."""
    stage = draw(stages)
    header = encoded(Frame(kind="ping", run_id=RUN, stage=stage))[PREFIX.size :]
    u32 = st.one_of(
        st.sampled_from([e for e in LENGTH_EDGES if e < 2**32] + [MAX_HEADER_BYTES + 1]),
        st.integers(0, 2**32 - 1),
        st.integers(0, len(header) + 8),
    )
    u64 = st.one_of(
        st.sampled_from(LENGTH_EDGES + [MAX_FRAME_BYTES, MAX_FRAME_BYTES + 1]),
        st.integers(0, 2**64 - 1),
        st.integers(0, 64),
    )
    header_len, payload_len = draw(u32), draw(u64)
    body = header + draw(st.binary(max_size=64))
    return Attempt(stage, struct.pack("<4sIQ", MAGIC, header_len, payload_len) + body, may_pong=True)


HEADER = {  # a valid forward's header to stage 0, whose fields the strategy breaks
    "kind": "forward",
    "run": RUN,
    "mb": "outsider:0:0",
    "stage": 0,
    "step": 0,
    "tensors": [["x", "int64", [B, T], "none", B * T * 8], ["targets", "int64", [B, T], "none", B * T * 8]],
    "meta": FORWARD_META,
}
PAYLOAD = bytes(2 * B * T * 8)

ints = st.integers(-(2**63), 2**64 - 1)
"""What msgpack can carry."""
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=8))
not_an_int = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=8), st.lists(ints, max_size=2))
not_a_str = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.lists(st.text(max_size=2), max_size=2))


@st.composite
def bad_specs(draw) -> list:
    """A tensor spec that fails validation."""
    name, dtype, shape, codec, nbytes = ["x", "int64", [B, T], "none", B * T * 8]
    broken = draw(st.sampled_from(["dtype", "shape", "nbytes", "codec", "arity", "codec meta", "name"]))
    if broken == "dtype":
        bad_dtype = st.one_of(st.text(max_size=10).filter(lambda d: d not in DTYPES), not_a_str)
        return [name, draw(bad_dtype), shape, codec, nbytes]
    if broken == "shape":
        bad_shape = draw(st.one_of(
            st.lists(st.integers(0, 4), min_size=9, max_size=12),
            st.lists(st.one_of(st.integers(-(2**63), -1), st.integers(2**31, 2**63), st.booleans(), st.floats()), min_size=1, max_size=3),
            not_an_int.filter(lambda v: not isinstance(v, list)),
        ))  # fmt: skip
        return [name, dtype, bad_shape, codec, nbytes]
    if broken == "nbytes":
        return [name, dtype, shape, codec, draw(st.one_of(ints.filter(lambda n: n != nbytes), not_an_int))]
    if broken == "codec":
        unknown = draw(st.text(max_size=12).filter(lambda c: c not in known_codecs()))
        return [name, "float32", [B, T], unknown, nbytes, {}]
    if broken == "arity":
        return draw(
            st.one_of(st.lists(scalars, max_size=4), st.lists(scalars, min_size=7, max_size=9), scalars)
        )
    if broken == "codec meta":
        meta = draw(
            st.one_of(
                st.dictionaries(st.text(max_size=40), scalars, min_size=9, max_size=10),
                st.lists(scalars, max_size=3),
                scalars,
            )
        )
        return [name, "float32", [B, T, C], "int8", B * T * C, meta]
    return [draw(not_a_str), dtype, shape, codec, nbytes]


@st.composite
def bad_headers(draw) -> Attempt:
    """A well-prefixed frame whose header breaks one rule (fields, types, tensor specs)."""
    header = dict(HEADER)
    broken = draw(
        st.sampled_from(
            ["drop", "extra", "kind", "run", "mb", "stage", "step", "meta", "tensors", "spec", "msgpack"]
        )
    )
    if broken == "drop":
        del header[draw(st.sampled_from(sorted(header)))]
    elif broken == "extra":
        header[draw(st.text(max_size=8).filter(lambda k: k not in HEADER))] = draw(scalars)
    elif broken == "kind":
        header["kind"] = draw(
            st.one_of(st.text(max_size=12).filter(lambda k: k not in FRAME_KINDS), not_a_str)
        )
    elif broken == "run":
        header["run"] = draw(st.one_of(st.text(min_size=65, max_size=80), not_a_str))
    elif broken == "mb":
        header["mb"] = draw(st.one_of(st.text(min_size=257, max_size=300), not_a_str))
    elif broken in ("stage", "step"):
        header[broken] = draw(not_an_int)
    elif broken == "meta":
        header["meta"] = draw(st.one_of(
            scalars,
            st.dictionaries(st.text(max_size=4), st.dictionaries(st.text(max_size=2), scalars, min_size=1, max_size=2), min_size=1, max_size=2),
            st.text(max_size=4).map(lambda k: {k: [0] * 4097}),
        ))  # fmt: skip
    elif broken == "tensors":
        header["tensors"] = draw(
            st.one_of(scalars, st.dictionaries(st.text(max_size=3), scalars, max_size=2))
        )
    elif broken == "spec":
        header["tensors"] = [draw(bad_specs()), HEADER["tensors"][1]]
    if broken == "msgpack":  # random bytes: no mapping of exactly the header's fields
        raw = draw(st.binary(min_size=1, max_size=64))
    else:
        raw = msgpack.packb(header, use_bin_type=True)
    return Attempt(0, PREFIX.pack(MAGIC, len(raw), len(PAYLOAD)) + raw + PAYLOAD)


# dispatch: well-framed requests of this run, each with a field that fails a check made
# before any state changes


@st.composite
def forwards_with_bad_meta(draw) -> Attempt:
    stage = draw(stages)
    meta = dict(FORWARD_META)
    broken = draw(st.sampled_from(["unknown field", "missing field", "wrong type", "out of range", "slots"]))
    if broken == "unknown field":
        meta[draw(st.text(max_size=12).filter(lambda k: k not in ForwardMeta.FIELDS))] = draw(scalars)
    elif broken == "missing field":
        del meta[draw(st.sampled_from(["loss_scale", "budget_s"]))]
    elif broken == "wrong type":  # no forward meta field takes a string
        meta[draw(st.sampled_from(sorted(ForwardMeta.FIELDS)))] = draw(st.text(max_size=8))
    elif broken == "out of range":
        field, value = draw(st.one_of(
            st.tuples(st.just("loss_scale"), st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True))),
            st.tuples(st.just("budget_s"), st.one_of(st.floats(max_value=0.0), st.floats(min_value=1e6, exclude_min=True))),
            st.tuples(st.sampled_from(["order", "microbatches"]), st.integers(-(2**63), -1)),
            st.tuples(st.sampled_from(["needed_by", "slots"]), st.lists(st.integers(-(2**63), -1), min_size=1, max_size=3)),
        ))  # fmt: skip
        meta[field] = value
    else:  # static-schedule slots that do not fit, or a step of absurdly many microbatches
        count = draw(st.integers(1, 4))
        meta |= draw(st.one_of(
            st.just({"slots": [0] * NUM_STAGES, "slot_counts": [count] * NUM_STAGES}),  # no microbatches
            st.just({"slots": [count] * NUM_STAGES, "slot_counts": [count] * NUM_STAGES, "microbatches": 4}),
            st.just({"slots": [0], "slot_counts": [1, 1], "microbatches": 4}),
            st.integers(2**20, 2**62).map(lambda n: {"slots": [0] * NUM_STAGES, "slot_counts": [1] * NUM_STAGES, "microbatches": n}),
        ))  # fmt: skip
    return Attempt(stage, encoded(forward(stage, meta=meta)))


@st.composite
def forwards_with_bad_tensors(draw) -> Attempt:
    stage = draw(stages)
    x, y = stage_input(stage), targets()
    broken = draw(
        st.sampled_from(["dtype", "trailing shape", "batch", "missing", "extra", "nonfinite", "targets"])
    )
    if broken == "dtype":
        dtype = draw(
            st.sampled_from(
                [torch.float16, torch.bfloat16, torch.uint8]
                + ([torch.float32] if stage == 0 else [torch.int64])
            )
        )
        tensors = {"x": x.to(dtype), "targets": y}
    elif broken == "trailing shape":
        extra = draw(st.integers(1, 3))
        tensors = {
            "x": torch.zeros(B, T + extra, dtype=x.dtype) if stage == 0 else torch.zeros(B, T, C + extra),
            "targets": y,
        }
    elif broken == "batch":
        n = draw(st.integers(B + 1, 3 * B))
        tensors = {"x": x.repeat(3, *[1] * (x.dim() - 1))[:n], "targets": y.repeat(3, 1)[:n]}
    elif broken == "missing":
        missing = draw(st.sampled_from(["x", "targets"]))
        tensors = {k: v for k, v in {"x": x, "targets": y}.items() if k != missing}
    elif broken == "extra":
        tensors = {
            "x": x,
            "targets": y,
            draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in ("x", "targets"))): y,
        }
    elif broken == "nonfinite" and stage == 1:
        x = x.clone()
        x[draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))] = draw(
            st.sampled_from([float("nan"), float("inf"), -float("inf")])
        )
        tensors = {"x": x, "targets": y}
    else:  # targets of the wrong dtype or shape
        bad = draw(st.sampled_from([y.float(), y[:, :-1], y[:, :, None], y.int()]))
        tensors = {"x": x, "targets": bad}
    return Attempt(stage, encoded(forward(stage, tensors=tensors)))


COMMIT_FIELDS = {"phase", "fresh", "take", "group", "attempt", "grad_scale", "digest"}
COMMIT_METAS = [
    Prepare().to_meta(),
    Abort().to_meta(),
    Apply().to_meta(),
    Exchange(fresh=(), take=(), group=("QmX",)).to_meta(),
]


@st.composite
def commits_with_bad_meta(draw) -> Attempt:
    meta = dict(draw(st.sampled_from(COMMIT_METAS)))
    broken = draw(st.sampled_from(["unknown field", "phase", "no phase", "wrong type"]))
    if broken == "unknown field":
        meta[draw(st.text(max_size=12).filter(lambda k: k not in COMMIT_FIELDS))] = draw(scalars)
    elif broken == "phase":
        phases = ("prepare", "exchange", "apply", "abort")
        meta["phase"] = draw(st.one_of(st.text(max_size=10).filter(lambda p: p not in phases), not_a_str))
    elif broken == "no phase":
        del meta["phase"]
    else:  # an exchange's fields hold lists and an int: a string fits none of them
        meta = Exchange(fresh=(), take=(), group=("QmX",)).to_meta()
        meta[draw(st.sampled_from(["fresh", "take", "group", "attempt"]))] = draw(st.text(max_size=8))
    stage = draw(stages)
    return Attempt(stage, encoded(Frame(kind="step", run_id=RUN, stage=stage, step=0, meta=meta)))


@st.composite
def exchanges_with_bad_fields(draw) -> Attempt:
    stage = draw(stages)
    meta = GradsMeta().to_meta()
    grads = {str(i): torch.zeros(3) for i in range(2)}
    broken = draw(st.sampled_from(["unknown field", "attempt", "step"]))
    step = 0
    if broken == "unknown field":
        meta[draw(st.text(max_size=12).filter(lambda k: k != "attempt"))] = draw(scalars)
    elif broken == "attempt":
        meta["attempt"] = draw(st.one_of(st.integers(-(2**63), -1), st.text(max_size=4), st.floats()))
    else:  # a step no replica is at: refused before the inbox sees it
        step = draw(st.one_of(st.integers(1, 2**62), st.integers(-(2**62), -1)))
    return Attempt(
        stage, encoded(Frame(kind="grads", run_id=RUN, stage=stage, step=step, tensors=grads, meta=meta))
    )


@st.composite
def misaddressed_requests(draw) -> Attempt:
    """Any kind, to a stage that does not exist, or for another run."""
    kind = draw(st.sampled_from(["forward", "step", "grads", "state", "weights", "ping"]))
    if draw(st.booleans()):
        run_id, stage = RUN, draw(st.one_of(st.integers(NUM_STAGES, 2**62), st.integers(-(2**62), -1)))
    else:
        run_id, stage = draw(st.text(max_size=64).filter(lambda r: r != RUN)), draw(stages)
    frame = Frame(
        kind=kind, run_id=run_id, stage=stage, step=0, meta=FORWARD_META if kind == "forward" else {}
    )
    # A ping names no stage it needs: any peer of the run answers it.
    return Attempt(draw(stages), encoded(frame), may_pong=kind == "ping" and run_id == RUN)


@st.composite
def replies_sent_as_requests(draw) -> Attempt:
    kind = draw(
        st.sampled_from(["result", "step_done", "pong", "state_data", "weights_data", "error", "ping"])
    )
    stage = draw(stages)
    meta = draw(
        st.dictionaries(st.text(max_size=8), st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=4)
    )
    frame = Frame(kind=kind, run_id=RUN, stage=stage, step=draw(st.integers(-5, 5)), meta=meta)
    return Attempt(stage, encoded(frame), may_pong=kind == "ping")


STRATEGIES = {
    # framing (wire/frames.py)
    "random bytes": random_bytes(),
    "mutated frames": mutated_frames(),
    "lying prefixes": lying_prefixes(),
    "bad headers": bad_headers(),
    # dispatch (train/service.py and the typed meta of wire/messages.py)
    "forward with bad meta": forwards_with_bad_meta(),
    "forward with bad tensors": forwards_with_bad_tensors(),
    "commit with bad meta": commits_with_bad_meta(),
    "exchange with bad fields": exchanges_with_bad_fields(),
    "misaddressed requests": misaddressed_requests(),
    "replies sent as requests": replies_sent_as_requests(),
    # authorization: an outsider's well-formed forward, commit, exchange or state request
    # (each must be refused as 'unauthorized' once stage peers authorize their callers)
}


ABSURD_STEP = {"slots": [0] * NUM_STAGES, "slot_counts": [1] * NUM_STAGES, "microbatches": 2**62}
REGRESSIONS = {
    "commit with bad meta": [  # a list as the phase: unhashable, was an internal error
        Attempt(0, encoded(Frame(kind="step", run_id=RUN, stage=0, step=0, meta={"phase": []}))),
    ],
    "forward with bad meta": [  # a static step of 2**62 microbatches: the peer counted them all
        Attempt(s, encoded(forward(s, meta=FORWARD_META | ABSURD_STEP))) for s in range(NUM_STAGES)
    ],
}
"""Attempts this fuzzing once found a fault with, tried on every run besides the drawn ones."""
