"""Codecs: round trips, payload sizes, frame validation, error feedback, the exact replica
exchange, the 'auto' policy, and the hivemind adapter."""

import asyncio

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionInfo
from hivemind.proto import runtime_pb2

from swarmtrain.compress import (
    Codec,
    ErrorFeedback,
    choose_codec,
    codec_names,
    compress_for_exchange,
    decode_encoded,
    get_codec,
    resolve_codec,
    roundtrip,
)
from swarmtrain.compress.hivemind_codec import HivemindCodec, install_hivemind_codec
from swarmtrain.errors import BadFrameError
from swarmtrain.train.averaging import group_sum
from swarmtrain.wire.frames import Frame, encode_frame, read_frame

# Max relative error (max |x - x'| / max |x|) each codec may show on Gaussian data.
MAX_REL_ERROR = {
    "none": 0.0,
    "fp16": 1e-3,
    "bf16": 4e-3,
    "int8": 1 / 254 + 1e-6,
    "nf4": 0.2,
    "uint4": 1 / 14 + 1e-6,
    # fp16 scales: rounded up by at most one fp16 step (2^-10) for these normal-range blocks
    "int8-s16": (1 + 2**-10) / 254 + 1e-6,
    "nf4-s16": 0.2,
    "uint4-s16": (1 + 2**-10) / 14 + 1e-6,
}
SHAPES = [(0,), (1,), (3, 5), (17, 31, 3), (4096,)]


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def test_registry():
    assert set(codec_names()) == set(MAX_REL_ERROR)
    for name in codec_names():
        codec = get_codec(name)
        assert isinstance(codec, Codec) and codec.name == name
    with pytest.raises(ValueError, match="unknown codec 'zstd'"):
        get_codec("zstd")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(MAX_REL_ERROR))
def test_round_trip(name, shape, dtype):
    codec = get_codec(name)
    x = _randn(*shape, dtype=dtype)
    payload, meta = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert all(isinstance(v, int | float | str) for v in meta.values())
    out = codec.decode(payload, meta, tuple(shape), dtype)
    assert out.shape == x.shape and out.dtype == dtype
    if x.numel():
        err = (out.float() - x.float()).abs().max() / x.float().abs().max()
        # Decoding back into fp16/bf16 adds that dtype's own rounding.
        slack = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        assert err <= MAX_REL_ERROR[name] + slack, err


@pytest.mark.parametrize(
    ("name", "min_ratio", "max_ratio"),
    [
        ("int8", 3.9, 4.0),
        ("nf4", 7.0, 7.2),
        ("uint4", 7.0, 7.2),
        ("int8-s16", 3.96, 3.98),
        ("nf4-s16", 7.5, 7.6),
        ("uint4-s16", 7.5, 7.6),
        ("fp16", 2, 2),
        ("bf16", 2, 2),
        ("none", 1, 1),
    ],
)
def test_size_ratio_against_fp32(name, min_ratio, max_ratio):
    x = _randn(1 << 16)
    payload, _ = get_codec(name).encode(x)
    assert min_ratio <= x.numel() * 4 / payload.numel() <= max_ratio


def test_all_zero_and_non_finite():
    for name in ("int8", "nf4", "uint4"):
        codec = get_codec(name)
        payload, meta = codec.encode(torch.zeros(100))
        assert not codec.decode(payload, meta, (100,), torch.float32).any()
    x = _randn(100)
    x[7] = float("nan")
    for name in ("fp16", "int8", "nf4"):
        with pytest.raises(ValueError, match="inf/NaN"):
            get_codec(name).encode(x)
    with pytest.raises(ValueError, match="inf/NaN"):
        get_codec("fp16").encode(torch.full((3,), 1e6))  # beyond the fp16 range


@pytest.mark.parametrize("name", ["int8-s16", "nf4-s16", "uint4-s16"])
def test_fp16_scales_fall_back_to_fp32_for_a_tensor_beyond_them(name):
    codec, plain = get_codec(name), get_codec(name.removesuffix("-s16"))
    x = _randn(1000)
    payload, meta = codec.encode(x)
    assert meta["scales"] == "fp16" and codec.payload_nbytes(meta, (1000,), torch.float32) == payload.numel()
    x[10] = 1e5  # no fp16 scale holds this block
    payload, meta = codec.encode(x)
    assert meta["scales"] == "fp32"
    assert payload.numel() == plain.encode(x)[0].numel()  # what the fp32-scale codec sends
    torch.testing.assert_close(
        codec.decode(payload, meta, (1000,), torch.float32), roundtrip(x, plain.name), rtol=0, atol=0
    )
    if name == "int8-s16":  # the fused error-feedback path falls back the same way
        enc = ErrorFeedback().compress("g", x, name)
        assert enc.meta["scales"] == "fp32" and enc.payload.numel() == payload.numel()
    with pytest.raises(BadFrameError, match=rf"{name} frame has scales 'bf16', expected 'fp16' or 'fp32'"):
        codec.decode(payload, {**meta, "scales": "bf16"}, (1000,), torch.float32)
    with pytest.raises(BadFrameError, match=rf"{name} frame has scales None"):
        codec.decode(payload, {k: v for k, v in meta.items() if k != "scales"}, (1000,), torch.float32)
    # a frame of the fp32-scale codec names no scales
    p32, m32 = plain.encode(x)
    with pytest.raises(BadFrameError, match=r"frames carry fp32 scales and no 'scales' meta, got 'fp16'"):
        plain.decode(p32, {**m32, "scales": "fp16"}, (1000,), torch.float32)


@pytest.mark.parametrize("name", list(MAX_REL_ERROR))
def test_bad_frames_raise_before_allocating(name):
    codec = get_codec(name)
    payload, meta = codec.encode(_randn(100))
    bad = [
        (payload, {**meta, "codec": "other"}, (100,)),  # wrong codec
        (payload, {**meta, "numel": 10**12}, (10**6, 10**6)),  # huge shape: refused by size, not OOM
        (payload, meta, (101,)),  # numel does not match the shape
        (payload[:-1], meta, (100,)),  # truncated payload
        (torch.cat((payload, payload[:1])), meta, (100,)),  # trailing bytes
        (payload.view(torch.int8), meta, (100,)),  # not uint8
    ]
    if "block_size" in meta:
        bad.append((payload, {**meta, "block_size": 128}, (100,)))
    else:
        bad.append((payload, {**meta, "wire_dtype": "int64"}, (100,)))
    for p, m, shape in bad:
        with pytest.raises(BadFrameError):
            codec.decode(p, m, shape, torch.float32)
    with pytest.raises(BadFrameError, match="float32"):
        codec.decode(payload, meta, (100,), torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hivemind_adapter_round_trip(dtype):
    codec = HivemindCodec()
    x = _randn(33, 65, dtype=dtype).requires_grad_()
    info = CompressionInfo.from_tensor(x)
    message = codec.compress(x, info)
    assert isinstance(message, runtime_pb2.Tensor)
    assert message.compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT
    out = codec.extract(message)
    assert out.shape == x.shape and out.dtype == dtype and out.requires_grad
    assert (
        out.float() - x.detach().float()
    ).abs().max() <= x.detach().float().abs().max() / 254 * 1.01 + 4e-3
    ratio = codec.estimate_compression_ratio(info)
    assert ratio == pytest.approx(len(message.buffer) / (x.numel() * x.element_size()), rel=0.02)
    assert codec.extract(
        codec.compress(torch.empty(0, 4), CompressionInfo.from_tensor(torch.empty(0, 4)))
    ).shape == (0, 4)


def test_hivemind_adapter_reads_stock_frames_and_installs(monkeypatch):
    from hivemind.compression import serialization

    monkeypatch.setitem(
        serialization._BASE_COMPRESSION_TYPES,
        "BLOCKWISE_8BIT",
        serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"],
    )
    x = _randn(5000)
    stock = serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT)  # bitsandbytes frame
    codec = install_hivemind_codec()
    torch.testing.assert_close(codec.extract(stock), deserialize_torch_tensor(stock))
    ours = serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT)  # now through our codec
    assert ours.buffer.startswith(b"STQ8")
    assert (deserialize_torch_tensor(ours) - x).abs().max() <= x.abs().max() / 254 + 1e-6
    broken = runtime_pb2.Tensor()
    broken.CopyFrom(ours)
    broken.buffer = ours.buffer[:-3]
    with pytest.raises(BadFrameError):
        deserialize_torch_tensor(broken)


# what frames ask of a codec


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(MAX_REL_ERROR))
def test_payload_nbytes_is_the_encoded_size(name, shape):
    codec = get_codec(name)
    for dtype in (torch.float32, torch.bfloat16):
        payload, meta = codec.encode(_randn(*shape, dtype=dtype))
        assert codec.payload_nbytes(meta, tuple(shape), dtype) == payload.numel()


def test_codecs_are_registered_with_frames():
    from swarmtrain.wire.codec import find_codec, register_codec

    for name in codec_names():
        assert find_codec(name) is (None if name == "none" else get_codec(name))
    with pytest.raises(ValueError, match="codec 'none' is built into frames"):
        register_codec(get_codec("none"))
    with pytest.raises(TypeError, match="does not implement the Codec protocol"):
        register_codec(type("Half", (), {"name": "half"})())


# error feedback and the replica exchange


def test_error_feedback_keeps_the_sum_of_what_was_sent_close():
    """A constant gradient sent 40 times: without error feedback the rounding error of each send
    adds up (40x one send's error); with it the total trails by one residual at most."""
    g = _randn(3000) * 1e-2
    for name in ("int8", "nf4", "fp16"):
        feedback = ErrorFeedback()
        sent_plain, sent_fed = torch.zeros(3000), torch.zeros(3000)
        for _ in range(40):
            sent_plain += roundtrip(g, name)
            sent_fed += decode_encoded(feedback.compress("g", g, name))
        err_plain = (sent_plain - 40 * g).abs().max()
        err_fed = (sent_fed - 40 * g).abs().max()
        step = (roundtrip(g, name) - g).abs().max()  # one send's error
        assert err_plain > 20 * step, name
        assert err_fed <= 2 * step + 1e-6, name
        # what is still owed is exactly the residual
        torch.testing.assert_close(40 * g - sent_fed, feedback.residuals["g"], rtol=0, atol=1e-5)
    assert ErrorFeedback().compress("g", g, "none") is g


def test_error_feedback_int8_fused_kernel_matches_the_generic_path():
    g, feedback = _randn(5, 700), ErrorFeedback()
    codec, residual = get_codec("int8"), torch.zeros(5, 700)
    for step in range(3):
        fused = feedback.compress("g", g * (step + 1), "int8")  # fp32: one quantize_int8_error_feedback pass
        v = g * (step + 1) + residual  # the same algebra, spelled out
        payload, meta = codec.encode(v)
        residual = v - codec.decode(payload, meta, (5, 700), torch.float32)
        assert torch.equal(fused.payload, payload) and fused.meta == meta
        torch.testing.assert_close(feedback.residuals["g"], residual, rtol=0, atol=1e-6)
    # bf16 gradients take the generic path: the residual is what the receiver misses in bf16
    h = _randn(5, 700, dtype=torch.bfloat16)
    enc = feedback.compress("h", h, "int8")
    assert enc.dtype == torch.bfloat16 and enc.shape == (5, 700)
    assert torch.equal(feedback.residuals["h"], h.float() - decode_encoded(enc).float())
    # a key whose shape changes (a smaller last microbatch) starts from zero
    feedback.compress("g", g[:2], "int8")
    assert feedback.residuals["g"].shape == (2, 700)
    bad = g[:2].clone()
    bad[0, 0] = float("nan")
    before = feedback.residuals["g"].clone()
    with pytest.raises(ValueError, match="inf/NaN"):
        feedback.compress("g", bad, "int8")
    assert torch.equal(feedback.residuals["g"], before)  # untouched by the refused send
    assert feedback.residual_norm() > 0
    feedback.reset()
    assert feedback.residuals == {} and feedback.residual_norm() == 0


def _exchange_over_frames(sent: dict) -> list[torch.Tensor]:
    """What another replica gets from a 'grads' frame holding `sent`: encoded, written to a
    real StreamReader and read back."""
    frame = Frame(kind="grads", run_id="r", step=0, tensors=sent)
    data = b"".join(bytes(b) for b in encode_frame(frame))

    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)

    got = asyncio.run(read())
    return [got.tensors[str(i)] for i in range(len(got.tensors))]


@pytest.mark.parametrize("error_feedback", [False, True])
@pytest.mark.parametrize("name", list(MAX_REL_ERROR))
def test_two_replicas_summing_decoded_copies_stay_bit_identical(name, error_feedback):
    shapes = [(33, 17), (5,), (2, 3, 64)]
    grads = {
        peer: [
            torch.randn(s, generator=torch.Generator().manual_seed(seed + i)) for i, s in enumerate(shapes)
        ]
        for peer, seed in (("peerA", 0), ("peerB", 100))
    }
    feedback = {peer: ErrorFeedback() if error_feedback else None for peer in grads}
    for step in range(3):
        sent, mine = {}, {}
        for peer, local in grads.items():
            scaled = [g * (step + 1) for g in local]
            sent[peer], mine[peer] = compress_for_exchange(scaled, name, feedback[peer])
        received = {peer: _exchange_over_frames(sent[peer]) for peer in grads}
        for peer in grads:  # a receiver decodes exactly what the sender adds for itself
            assert all(torch.equal(a, b) for a, b in zip(received[peer], mine[peer]))
        total_a = group_sum("peerA", mine["peerA"], {"peerB": received["peerB"]})
        total_b = group_sum("peerB", mine["peerB"], {"peerA": received["peerA"]})
        assert all(torch.equal(a, b) for a, b in zip(total_a, total_b)), f"step {step}"
        exact = [a + b for a, b in zip(*(([g * (step + 1) for g in grads[p]]) for p in grads))]
        for t, e in zip(total_a, exact):
            assert (t - e).abs().max() <= 2 * MAX_REL_ERROR[name] * e.abs().max() * 3 + 1e-5
        if name == "none":
            assert all(torch.equal(t, e) for t, e in zip(total_a, exact))


def test_exchange_with_error_feedback_shrinks_the_accumulated_error():
    """Over 30 exchanges of the same gradients, the sum of the group totals drifts from the exact
    sum by 30 quantization errors without error feedback, by about one with it."""
    local = [_randn(4000) * 1e-3, _randn(300) * 5]
    errors = {}
    for use_feedback in (False, True):
        feedback = ErrorFeedback() if use_feedback else None
        total = [torch.zeros_like(g) for g in local]
        for _ in range(30):
            _, mine = compress_for_exchange(local, "nf4", feedback)
            for t, d in zip(total, mine):
                t += d
        errors[use_feedback] = max(
            float((t - 30 * g).abs().max() / g.abs().max()) for t, g in zip(total, local)
        )
    assert errors[True] * 10 < errors[False], errors


# the 'auto' policy


@pytest.mark.parametrize(
    ("bandwidth", "tensor_bytes", "codec"),
    [
        (10e9, 2**20, "none"),  # NVLink / datacenter
        (1e9, 2**20, "none"),
        (999e6, 2**20, "fp16"),
        (200e6, 2**20, "fp16"),
        (100e6 / 8 * 8, 2**20, "int8"),  # 100 Mbit/s = 12.5 MB/s
        (50e6 / 8, 2**20, "int8"),  # 50 Mbit/s
        (2.5e6, 2**20, "int8"),
        (1e6, 2**20, "nf4"),  # 8 Mbit/s uplink
        (1e6, 512, "none"),  # crosses in 0.5 ms: not worth a codec
        (1e6, 1000, "nf4"),
        (50e6 / 8, 0, "none"),
    ],
)
def test_auto_policy(bandwidth, tensor_bytes, codec):
    assert choose_codec(bandwidth, tensor_bytes) == codec
    assert resolve_codec("auto", bandwidth, tensor_bytes) == codec


def test_auto_policy_edges():
    assert resolve_codec("int8", 1e12, 10) == "int8"  # a fixed setting is kept
    assert resolve_codec("auto", None, 2**20) == "int8"  # link not measured yet
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="bandwidth must be > 0"):
            choose_codec(bad, 100)
    with pytest.raises(ValueError, match="tensor size must be >= 0"):
        choose_codec(1e6, -1)
    previous = "none"  # slower links never get a lighter codec
    order = ["none", "fp16", "int8", "nf4"]
    for bandwidth in sorted((10 ** (k / 4) for k in range(20, 44)), reverse=True):
        chosen = choose_codec(bandwidth, 2**20)
        assert order.index(chosen) >= order.index(previous)
        previous = chosen


def test_hivemind_adapter_uses_the_same_kernels():
    x = _randn(70, 33)
    out = HivemindCodec().extract(HivemindCodec().compress(x, CompressionInfo.from_tensor(x)))
    assert torch.equal(out, roundtrip(x, "int8"))


@pytest.mark.swarm
def test_compressed_frames_over_the_real_transport_and_its_byte_counters():
    from hivemind.p2p import P2P

    from swarmtrain.transport import TensorTransport, handler_name

    x = _randn(4, 16, 64)
    seen = {}

    async def backward(frame: Frame, peer: str) -> Frame:  # a stage answering with a compressed gradient
        seen.update(codecs=frame.codecs, x=frame.tensors["x"])
        return Frame(
            kind="result",
            run_id=frame.run_id,
            tensors={"grad": frame.tensors["x"] * 2},
            codecs={"grad": "nf4"},
        )

    async def go():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        try:
            served = TensorTransport(server)
            await served.serve(handler_name("run-1"), backward)
            caller = TensorTransport(client)
            request = Frame(kind="forward", run_id="run-1", tensors={"x": x}, codecs={"x": "int8"})
            reply = await caller.call(
                server.peer_id.to_base58(), handler_name("run-1"), request, timeout_s=30
            )
            return served, caller, reply
        finally:
            await client.shutdown()
            await server.shutdown()

    served, caller, reply = asyncio.run(go())
    assert seen["codecs"] == {"x": "int8"} and torch.equal(seen["x"], roundtrip(x, "int8"))
    assert reply.codecs == {"grad": "nf4"}
    assert torch.equal(reply.tensors["grad"], roundtrip(roundtrip(x, "int8") * 2, "nf4"))
    int8_bytes, nf4_bytes = 4 * 16 + x.numel(), 4 * 64 + x.numel() // 2
    assert (caller.bytes_sent, caller.raw_bytes_sent, caller.bytes_received) == (
        int8_bytes,
        x.nbytes,
        nf4_bytes,
    )
    assert (served.bytes_received, served.bytes_sent, served.raw_bytes_sent) == (
        int8_bytes,
        nf4_bytes,
        x.nbytes,
    )
