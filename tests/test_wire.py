"""Wire layer: tensor frames through a real asyncio.StreamReader, every rejection a reader
makes before it trusts a header or allocates a payload, and the DHT records' validation."""

from __future__ import annotations

import asyncio
import math
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.compress import codec_names, encode_tensor, get_codec, roundtrip  # registers the codecs
from swarmtrain.errors import BadFrameError, Cause
from swarmtrain.wire import frames
from swarmtrain.wire.codec import Encoded, known_codecs
from swarmtrain.wire.frames import (
    DTYPES,
    FRAME_KINDS,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    PREFIX,
    Frame,
    encode_frame,
    error_frame,
    read_frame,
    write_frame,
)
from swarmtrain.wire.records import (
    CODEC_CHOICES,
)

# helpers


def encoded(frame: Frame) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(frame))


def read_bytes(data: bytes, **kw) -> Frame:
    """Read one frame from a real StreamReader fed exactly `data`, then EOF."""

    async def go() -> Frame:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, **kw)

    return asyncio.run(go())


def left_after_rejection(data: bytes, **kw) -> bytes:
    """What is still unread in a stream holding `data` after read_frame rejected it."""

    async def go() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        with pytest.raises(BadFrameError):
            await read_frame(reader, **kw)
        return await reader.read()

    return asyncio.run(go())


def rejects(data: bytes, match: str, **kw) -> None:
    """A stream holding `data` then EOF is refused with BadFrameError (not IncompleteReadError).

    Callers pass only the bytes before the payload where the rejection must come from the prefix
    or header: had the reader asked for more it would have hit EOF instead.
    """
    with pytest.raises(BadFrameError, match=match):
        read_bytes(data, **kw)


def header(**overrides) -> dict:
    fields = {
        "kind": "forward",
        "run": "run-1",
        "mb": "t:0:0",
        "stage": 1,
        "step": 0,
        "tensors": [],
        "meta": {},
    }
    return fields | overrides


def raw_frame(hdr: dict | bytes, payload_len: int, payload: bytes = b"") -> bytes:
    raw = hdr if isinstance(hdr, bytes) else msgpack.packb(hdr, use_bin_type=True)
    return PREFIX.pack(MAGIC, len(raw), payload_len) + raw + payload


def spec(name="x", dtype="float32", shape=(2, 3), codec="none", nbytes=None) -> list:
    if nbytes is None:
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    return [name, dtype, list(shape), codec, nbytes]


def sample(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    lo, hi = (
        (-(2**62), 2**62) if dtype == torch.int64 else (torch.iinfo(dtype).min, torch.iinfo(dtype).max + 1)
    )
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def assert_same_frame(a: Frame, b: Frame) -> None:
    def fields(f: Frame) -> tuple:
        return f.kind, f.run_id, f.mb_id, f.stage, f.step, f.meta

    assert fields(a) == fields(b)
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (u.dtype, u.shape) == (t.dtype, t.shape), name
        assert torch.equal(u, t), name


# frames: round trips


def test_round_trip_of_every_dtype_with_empty_and_zero_dim_tensors():
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, dtype in DTYPES.items():
        tensors[f"{name}.a"] = sample(dtype, (3, 5), gen)
        tensors[f"{name}.b"] = sample(dtype, (2, 1, 4), gen)
    tensors["empty"] = torch.empty(0, 7, dtype=torch.bfloat16)
    tensors["scalar"] = torch.tensor(-2.5, dtype=torch.float16)
    meta = {"loss_scale": 0.25, "budget_s": 3, "route": "a b c", "retry": False, "none": None}
    frame = Frame(kind="forward", run_id="run-1", mb_id="t:3:1", stage=2, step=3, tensors=tensors, meta=meta)

    got = read_bytes(encoded(frame))

    assert_same_frame(frame, got)
    assert got.tensors["scalar"].dim() == 0 and got.tensors["empty"].shape == (0, 7)


def test_round_trip_of_edge_values_offsets_and_layouts():
    gen = torch.Generator().manual_seed(1)
    i64, f32 = torch.iinfo(torch.int64), torch.finfo(torch.float32)
    tensors = {
        "int_extremes": torch.tensor([i64.min, i64.max, 0, -1]),
        "float_extremes": torch.tensor([f32.max, f32.min, f32.tiny, -0.0]),
        "odd": torch.arange(3, dtype=torch.uint8),  # puts the next tensor at an unaligned offset
        "after_odd": torch.randn(4, generator=gen),
        "strided": torch.randn(4, 6, generator=gen).t(),  # non-contiguous
        "empty_middle": torch.empty(2, 0, 3, dtype=torch.int32),
        "scalar_int": torch.tensor(-7, dtype=torch.int8),
    }
    frame = Frame(kind="result", run_id="r", tensors=tensors)

    got = read_bytes(encoded(frame))

    assert_same_frame(frame, got)
    assert torch.equal(got.tensors["float_extremes"].signbit(), tensors["float_extremes"].signbit())


def test_frame_without_tensors_and_error_frames():
    ping = Frame(kind="ping", run_id="r")
    got = read_bytes(encoded(ping))
    assert_same_frame(ping, got)
    assert (got.mb_id, got.stage, got.step) == ("", -1, -1)

    err = error_frame("r", "stage 1 is draining", cause=Cause.DRAINING, mb_id="t:0:0", stage=1)
    got = read_bytes(encoded(err))
    assert got.kind == "error" and got.error_text() == "stage 1 is draining"
    assert got.error_cause() == Cause.DRAINING
    assert got.meta["retryable"] is True and (got.mb_id, got.stage) == ("t:0:0", 1)
    assert Frame(kind="error", run_id="r").error_text() == "unknown error"
    # The cause decides retryability unless the sender says otherwise; an unknown cause is the
    # peer's own failure.
    refused = read_bytes(encoded(error_frame("r", "NaN loss", cause=Cause.REFUSED)))
    assert refused.meta["retryable"] is False and refused.error_cause() == Cause.REFUSED
    forced = read_bytes(encoded(error_frame("r", "x", cause=Cause.WRONG_STEP, retryable=False)))
    assert forced.meta["retryable"] is False
    odd = Frame(kind="error", run_id="r", meta={"error": "?", "cause": "gremlins"})
    assert odd.error_cause() == Cause.OWN_FAILURE


def test_meta_lists_of_scalars_round_trip():
    frame = Frame(
        kind="step", run_id="r", meta={"fresh": ["t:0:1", "t:0:2"], "needed_by": [1, 2], "empty": []}
    )
    assert read_bytes(encoded(frame)).meta == frame.meta


def test_frames_back_to_back_on_one_stream_and_write_frame():
    class Writer:  # the two methods write_frame uses
        def __init__(self):
            self.data = bytearray()

        def write(self, buf):
            self.data += buf

        async def drain(self):
            pass

    a = Frame(kind="forward", run_id="r", mb_id="t:0:0", tensors={"x": torch.arange(6).view(2, 3)})
    b = Frame(
        kind="result", run_id="r", mb_id="t:0:0", tensors={"grad": torch.ones(2, 3)}, meta={"loss": 1.5}
    )

    async def go():
        writer = Writer()
        await write_frame(writer, a)
        await write_frame(writer, b)
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(writer.data))
        reader.feed_eof()
        return await read_frame(reader), await read_frame(reader), reader.at_eof()

    got_a, got_b, at_eof = asyncio.run(go())
    assert_same_frame(a, got_a)
    assert_same_frame(b, got_b)
    assert at_eof


def test_payload_arriving_in_pieces():
    frame = Frame(kind="result", run_id="r", tensors={"g": torch.randn(64, 64)})
    data = encoded(frame)

    async def go():
        reader = asyncio.StreamReader()
        task = asyncio.ensure_future(read_frame(reader))
        for i in range(0, len(data), 1000):
            reader.feed_data(data[i : i + 1000])
            await asyncio.sleep(0)  # let the reader consume what has arrived
        reader.feed_eof()
        return await task

    assert_same_frame(frame, asyncio.run(go()))


@st.composite
def random_frames(draw) -> Frame:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=0, max_size=6, unique=True))
    tensors = {}
    for name in names:
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
        tensors[name] = sample(dtype, shape, gen)
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=10),
    )
    meta = draw(st.dictionaries(st.text(max_size=6), scalars, max_size=4))
    return Frame(
        kind=draw(st.sampled_from(FRAME_KINDS)),
        run_id=draw(st.text(max_size=64)),
        mb_id=draw(st.text(max_size=20)),
        stage=draw(st.integers(-1, 64)),
        step=draw(st.integers(-1, 2**40)),
        tensors=tensors,
        meta=meta,
    )


@settings(max_examples=50, deadline=None)
@given(random_frames())
def test_round_trip_property(frame):
    assert_same_frame(frame, read_bytes(encoded(frame)))


def test_encode_refuses_what_frames_do_not_carry():
    with pytest.raises(ValueError, match="unknown frame kind 'bogus'"):
        encode_frame(Frame(kind="bogus", run_id="r"))
    with pytest.raises(ValueError, match="tensor 'x' has dtype torch.float64"):
        encode_frame(Frame(kind="forward", run_id="r", tensors={"x": torch.zeros(2, dtype=torch.float64)}))


# frames: rejections


def test_wrong_magic():
    data = encoded(Frame(kind="ping", run_id="r"))
    rejects(b"HTTP" + data[4 : PREFIX.size], r"not a swarmtrain frame \(magic b'HTTP', expected b'STF1'\)")


def test_header_len_over_the_limit_is_refused_from_the_prefix_alone():
    rejects(PREFIX.pack(MAGIC, MAX_HEADER_BYTES + 1, 0), f"header of {MAX_HEADER_BYTES + 1} bytes exceeds")


def test_payload_over_max_frame_bytes_is_refused_before_reading_or_allocating_it(monkeypatch):
    hdr = header(tensors=[spec(shape=(1024, 1024))])  # 4 MiB promised
    data = raw_frame(hdr, 4 * 2**20)
    allocated = []

    def spy_bytearray(*args):
        allocated.append(args)
        return bytearray(*args)

    monkeypatch.setattr(frames, "bytearray", spy_bytearray, raising=False)
    rejects(data, r"payload of 4194304 bytes exceeds the limit of 1048576 bytes", max_frame_bytes=2**20)
    assert allocated == []
    # Refused from the prefix alone: the header is still unread in the stream.
    assert left_after_rejection(data, max_frame_bytes=2**20) == data[PREFIX.size :]
    # Within the limit, the same header leads to a read of the payload, which is kept as it
    # arrives: a payload buffer that starts empty, never one of the promised size.
    with pytest.raises(asyncio.IncompleteReadError):
        read_bytes(data, max_frame_bytes=4 * 2**20)
    assert allocated == [()]


def test_memory_is_charged_as_the_payload_arrives_and_a_charge_can_refuse_it():
    hdr = msgpack.packb(header(tensors=[spec(shape=(1024, 1024))]), use_bin_type=True)  # 4 MiB promised
    arrived = 3 * 2**20 + 5
    data = raw_frame(hdr, 4 * 2**20, bytes(arrived))
    charges = []
    with pytest.raises(asyncio.IncompleteReadError):
        read_bytes(data, max_frame_bytes=4 * 2**20, charge=charges.append)
    # the prefix and header first, then the payload in chunks of at most READ_CHUNK_BYTES
    assert charges[0] == PREFIX.size + len(hdr)
    assert sum(charges[1:]) == arrived and max(charges[1:]) <= frames.READ_CHUNK_BYTES

    def refuse_past_1mib(nbytes: int) -> None:
        charges.append(nbytes)
        if sum(charges) > 2**20:
            raise BadFrameError("over budget")

    charges = []
    left = left_after_rejection(data, max_frame_bytes=4 * 2**20, charge=refuse_past_1mib)
    # refused by the first chunk past the budget: everything after it is still unread
    assert sum(charges) > 2**20 and len(left) == len(data) - sum(charges)


def test_a_frame_whose_prefix_the_caller_already_read():
    frame = Frame(kind="ping", run_id="r", meta={"t": 1.0})
    data = encoded(frame)
    assert_same_frame(frame, read_bytes(data[4:], first=data[:4]))


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (msgpack.packb(header()) + b"\x00", "not valid msgpack"),  # trailing bytes
        (msgpack.packb([1, 2, 3]), "not a mapping"),
    ],
)
def test_header_not_msgpack(raw, match):
    rejects(raw_frame(raw, 0), match)


def test_header_fields_missing_or_extra():
    hdr = header()
    del hdr["mb"]
    rejects(
        raw_frame(hdr, 0), r"frame header has fields \['kind', 'meta', 'run', 'stage', 'step', 'tensors'\]"
    )
    rejects(raw_frame(header(extra=1), 0), r"has fields \[.*'extra'.*\], expected")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"kind": "launch"}, "unknown frame kind 'launch'"),
        ({"kind": ["ping"]}, r"unknown frame kind \['ping'\]"),
        ({"run": 5}, "run id must be a short string"),
        ({"run": "r" * 65}, "run id must be a short string"),
        ({"mb": None}, "microbatch id must be a short string"),
        ({"stage": "1"}, "frame stage must be an int"),
        ({"step": True}, "frame step must be an int"),
        ({"meta": [1]}, "frame meta must be a mapping"),
        ({"meta": {"route": [["a"], "b"]}}, "frame meta 'route' must be a scalar or a list of at most"),
        (
            {"meta": {"ids": ["a"] * (frames.MAX_META_LIST + 1)}},
            "frame meta 'ids' must be a scalar or a list",
        ),
        ({"meta": {"cfg": {"a": 1}}}, "frame meta 'cfg' must be a scalar"),
        ({"tensors": {"x": 1}}, "at most .* tensors"),
    ],
)
def test_bad_header_values(overrides, match):
    rejects(raw_frame(header(**overrides), 0), match)


def test_too_many_tensors():
    n = frames.MAX_TENSORS + 1
    specs = [spec(name=f"t{i}", dtype="uint8", shape=(0,)) for i in range(n)]
    rejects(raw_frame(header(tensors=specs), 0), f"a frame holds at most {frames.MAX_TENSORS} tensors")


@pytest.mark.parametrize(
    ("bad_spec", "match"),
    [
        (["x", "float32", [2]], r"tensor spec must be \[name, dtype, shape, codec, nbytes\]"),
        ("x", r"tensor spec must be"),
        (
            ["x", "float64", [2, 3], "none", 48],
            r"unsupported dtype 'float64' \(supported: float32, float16, ",
        ),
        (["x", ["float32"], [2, 3], "none", 24], r"tensor 'x': unsupported dtype \['float32'\]"),
        (["x", {"a": 1}, [2, 3], "none", 24], r"tensor 'x': unsupported dtype \{'a': 1\}"),
        (
            spec(codec="zstd"),
            r"tensor 'x': unknown codec 'zstd' \(known: none, fp16, bf16, int8, nf4, uint4, int8-s16, nf4-s16, uint4-s16\)",
        ),
        (["x", "float32", [2, -3], "none", 0], r"shape must be at most 8 non-negative ints, got \[2, -3\]"),
        (["x", "float32", [1] * (MAX_NDIM + 1), "none", 4], "shape must be at most 8 non-negative ints"),
        (["x", "float32", [2.0, 3], "none", 24], r"got \[2\.0, 3\]"),
        (["x", "float32", [True], "none", 4], r"got \[True\]"),
        (["x", "float32", "2x3", "none", 24], "shape must be"),
        (["x", "float32", [2**31], "none", 2**33], "shape must be"),
        (spec(nbytes=20), r"tensor 'x': 20 bytes do not match dtype float32 and shape \[2, 3\] \(24 bytes\)"),
        (spec(nbytes=24.0), "24.0 bytes do not match"),
        (
            spec(dtype="bfloat16", nbytes=24),
            r"24 bytes do not match dtype bfloat16 and shape \[2, 3\] \(12 bytes\)",
        ),
        ([7, "float32", [2, 3], "none", 24], "tensor name 7 is not a new string"),
    ],
)
def test_bad_tensor_specs(bad_spec, match):
    rejects(raw_frame(header(tensors=[bad_spec]), 0), match)  # specs are checked before the payload size


def test_duplicate_tensor_names():
    rejects(raw_frame(header(tensors=[spec(), spec()]), 48), "tensor name 'x' is not a new string")


def test_payload_length_must_equal_the_tensors_sum():
    specs = [spec(name="a"), spec(name="b", dtype="int64", shape=(4,))]  # 24 + 32 bytes
    rejects(raw_frame(header(tensors=specs), 57), "frame payload is 57 bytes but its tensors need 56")
    rejects(raw_frame(header(tensors=specs), 55), "frame payload is 55 bytes but its tensors need 56")
    rejects(raw_frame(header(), 8), "frame payload is 8 bytes but its tensors need 0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_floats_are_refused_unless_allowed(dtype, bad):
    t = torch.ones(2, 3, dtype=dtype)
    t[1, 2] = bad
    data = encoded(Frame(kind="result", run_id="r", tensors={"ok": torch.ones(2), "grad": t}))
    rejects(data, "tensor 'grad' holds NaN or inf values")
    got = read_bytes(data, allow_nonfinite=True).tensors["grad"]
    assert torch.equal(got.isnan(), t.isnan()) and torch.equal(got.isinf(), t.isinf())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(t))


@pytest.mark.parametrize("cut", ["prefix", "header", "payload", "last_byte"])
def test_truncated_stream_raises_incomplete_read(cut):
    frame = Frame(kind="forward", run_id="r", mb_id="t:0:0", tensors={"x": torch.randn(4, 4)}, meta={"a": 1})
    data = encoded(frame)
    header_len = struct.unpack_from("<I", data, 4)[0]
    end = {
        "prefix": PREFIX.size - 1,
        "header": PREFIX.size + header_len - 1,
        "payload": PREFIX.size + header_len + 10,
        "last_byte": len(data) - 1,
    }[cut]
    with pytest.raises(asyncio.IncompleteReadError):
        read_bytes(data[:end])
    with pytest.raises(asyncio.IncompleteReadError):
        read_bytes(b"")


# frames: compressed tensors

LOSSY = [name for name in codec_names() if name != "none"]


def int8_spec(name="x", shape=(2, 300), **meta_overrides) -> list:
    """A valid int8 spec for `shape`, with its meta changed by `meta_overrides`."""
    numel = math.prod(shape)
    meta = {"codec": "int8", "numel": numel, "block_size": 256} | meta_overrides
    return [name, "float32", list(shape), "int8", 4 * -(-numel // 256) + numel, meta]


def test_registry_seen_by_frames():
    assert known_codecs() == codec_names()
    assert set(CODEC_CHOICES) == {*codec_names(), "auto"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", codec_names())
def test_round_trip_of_every_codec_through_a_real_stream(name, dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, 33, generator=gen).to(dtype)  # 2112 values: a partial last block
    tensors = {
        "odd": torch.arange(3, dtype=torch.uint8),  # puts x at an unaligned payload offset
        "x": x,
        "targets": torch.randint(0, 256, (4, 16), generator=gen),
        "empty": torch.empty(0, 5, dtype=dtype),
        "scalar": torch.tensor(1.5, dtype=dtype),
        "raw": torch.randn(7, generator=gen),
    }
    codecs = {"x": name, "empty": name, "scalar": name}
    frame = Frame(kind="forward", run_id="r", mb_id="t:0:1", stage=1, tensors=tensors, codecs=codecs)
    data = encoded(frame)

    got = read_bytes(data)

    assert list(got.tensors) == list(tensors)
    for key, t in tensors.items():
        u = got.tensors[key]
        assert (u.shape, u.dtype) == (t.shape, t.dtype), key
        want = roundtrip(t, name) if key in codecs else t
        assert torch.equal(u, want), key  # exactly what the codec decodes, nothing else touched
    assert got.codecs == ({} if name == "none" else codecs)
    header_len = struct.unpack_from("<I", data, 4)[0]
    assert got.wire_nbytes == len(data) - PREFIX.size - header_len
    assert frame.raw_nbytes() == sum(t.nbytes for t in tensors.values())
    wire = {k: get_codec(name).encode(t)[0].numel() if k in codecs and name != "none" else t.nbytes
            for k, t in tensors.items()}  # fmt: skip
    assert got.wire_nbytes == sum(wire.values())


def test_pre_encoded_tensors_travel_as_they_are_and_write_frame_returns_wire_bytes():
    x = torch.randn(3, 100)
    enc = encode_tensor(x, "nf4")
    frame = Frame(kind="grads", run_id="r", step=4, tensors={"0": enc, "1": torch.ones(2)})
    assert frame.raw_nbytes() == x.nbytes + 8

    class Writer:
        data = bytearray()

        def write(self, buf):
            self.data += buf

        async def drain(self):
            pass

    writer = Writer()
    wire = asyncio.run(write_frame(writer, frame))
    assert wire == enc.nbytes + 8
    got = read_bytes(bytes(writer.data))
    assert got.wire_nbytes == wire and got.codecs == {"0": "nf4"}
    assert torch.equal(got.tensors["0"], roundtrip(x, "nf4"))


def test_sender_refuses_what_it_cannot_compress():
    def frame(tensors, codecs):
        return Frame(kind="forward", run_id="r", tensors=tensors, codecs=codecs)

    x = torch.randn(10)
    bad = x.clone()
    bad[3] = math.inf
    cases = [
        (frame({"x": bad}, {"x": "int8"}), "inf/NaN"),  # nothing non-finite goes out compressed
        (frame({"x": bad}, {"x": "fp16"}), "inf/NaN"),
        (frame({"x": torch.full((2,), 1e6)}, {"x": "fp16"}), "inf/NaN"),  # beyond fp16's range
        (frame({"t": torch.arange(4)}, {"t": "int8"}), "codec 'int8' compresses float tensors"),
        (frame({"x": x}, {"x": "zstd"}), "unknown codec 'zstd'"),
        (frame({"x": x}, {"y": "int8"}), r"codecs name tensors the frame does not hold: \['y'\]"),
        (frame({"x": encode_tensor(x, "int8")}, {"x": "int8"}), "already encoded"),
    ]
    for f, match in cases:
        with pytest.raises(ValueError, match=match):
            encode_frame(f)


def test_compressed_tensor_specs_are_checked_before_the_payload():
    ok = int8_spec()
    assert read_bytes(raw_frame(header(tensors=[ok]), ok[4], bytes(ok[4]))).tensors["x"].shape == (2, 300)
    cases = [
        (["x", "float32", [2, 3], "zstd", 6, {}], r"tensor 'x': unknown codec 'zstd' \(known: none, "),
        (["x", "float32", [2, 3], ["int8"], 6, {}], r"tensor 'x': unknown codec \['int8'\]"),
        (int8_spec()[:5], r"tensor 'x': codec 'int8' needs its meta as the spec's 6th field"),
        (spec() + [{}], "tensor 'x': codec 'none' takes no codec meta"),
        (["x", "int32", [4], "int8", 8, {}], "tensor 'x': codec 'int8' decodes to floats, not int32"),
        (int8_spec(block_size=128), "tensor 'x': int8 frame has block size 128, expected 256"),
        (int8_spec(block_size="256"), "tensor 'x': int8 frame has block size '256', expected 256"),
        (int8_spec(numel=599), r"tensor 'x': meta numel 599 does not match shape \(2, 300\) \(600 values\)"),
        (int8_spec(numel=True), "codec 'int8' meta must map"),  # a bool is no count
        (int8_spec(numel=599.0), "meta numel 599.0 does not match"),
        (int8_spec(codec="nf4"), "tensor 'x': frame says codec 'nf4', decoding with 'int8'"),
        (int8_spec()[:5] + [[256]], r"tensor 'x': codec 'int8' meta must map at most 8 short names"),
        (int8_spec(extra=[1, 2]), "codec 'int8' meta must map"),
        (int8_spec(extra={"a": 1}), "codec 'int8' meta must map"),
        (int8_spec(extra=True), "codec 'int8' meta must map"),
        (int8_spec(extra=None), "codec 'int8' meta must map"),
        (int8_spec(extra="s" * 33), "codec 'int8' meta must map"),
        (int8_spec(**{f"k{i}": i for i in range(6)}), "codec 'int8' meta must map at most 8"),
        (int8_spec()[:4] + [100, int8_spec()[5]], r"tensor 'x': 100 bytes do not match codec int8 .* \(612 bytes\)"),
        (int8_spec()[:4] + [612.0, int8_spec()[5]], "612.0 bytes do not match"),
        (["x", "float32", [10], "fp16", 20, {"codec": "fp16", "numel": 10, "wire_dtype": "float32"}],
         "tensor 'x': codec 'fp16': bad wire dtype 'float32'"),
        (["x", "float32", [10], "nf4", 5 + 4, {"codec": "nf4", "numel": 10, "block_size": 4096}],
         "tensor 'x': nf4 frame has block size 4096, expected 64"),
    ]  # fmt: skip
    for bad_spec, match in cases:
        rejects(raw_frame(header(tensors=[bad_spec]), 0), match)  # refused with the payload unread


def test_payload_and_decoded_sizes_of_compressed_frames():
    specs = [int8_spec("a"), int8_spec("b", shape=(64,))]  # 612 + 68 bytes
    rejects(raw_frame(header(tensors=specs), 681), "frame payload is 681 bytes but its tensors need 680")
    data = raw_frame(header(tensors=specs), 680)
    # 600 + 64 fp32 values decode to 2656 bytes: over a decoded limit, refused before the payload.
    rejects(data, "frame tensors decode to 2656 bytes, over the limit of 2655 bytes", max_decoded_bytes=2655)
    with pytest.raises(asyncio.IncompleteReadError):
        read_bytes(data, max_decoded_bytes=2656)  # within the limit: the reader waits for the payload
    # The default limit (MAX_DECODE_EXPANSION x max_frame_bytes) admits any codec's largest
    # expansion, fp32 from 4-bit at the largest block size, so it only stops forged frames.
    assert frames.MAX_DECODE_EXPANSION >= 32 / (4 + 32 / 4096)
    with pytest.raises(asyncio.IncompleteReadError):
        read_bytes(data, max_frame_bytes=680)


@pytest.mark.parametrize("name", LOSSY)
def test_nonfinite_values_decoded_from_a_payload_are_refused(name):
    x = torch.randn(300)
    enc = encode_tensor(x, name)
    payload = enc.payload.clone()
    # the first block's fp32 absmax (int8, 4-bit) or the first value (fp16, bf16) becomes NaN
    first = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name, torch.float32)
    nan = torch.tensor([math.nan], dtype=first).view(torch.uint8)
    payload[: nan.numel()] = nan
    poisoned = Encoded(codec=name, payload=payload, meta=enc.meta, shape=enc.shape, dtype=enc.dtype)
    data = encoded(Frame(kind="result", run_id="r", tensors={"grad": poisoned}))
    rejects(data, "tensor 'grad' holds NaN or inf values")
    assert not torch.isfinite(read_bytes(data, allow_nonfinite=True).tensors["grad"]).all()
