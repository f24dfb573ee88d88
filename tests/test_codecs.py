"""Codecs: round trips, payload sizes, frame validation, and the hivemind adapter."""

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionInfo
from hivemind.proto import runtime_pb2

from swarmtrain.compress import Codec, codec_names, get_codec
from swarmtrain.compress.hivemind_codec import HivemindCodec, install_hivemind_codec
from swarmtrain.errors import BadFrameError

# Max relative error (max |x - x'| / max |x|) each codec may show on Gaussian data.
MAX_REL_ERROR = {
    "none": 0.0,
    "fp16": 1e-3,
    "bf16": 4e-3,
    "int8": 1 / 254 + 1e-6,
    "nf4": 0.2,
    "uint4": 1 / 14 + 1e-6,
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
