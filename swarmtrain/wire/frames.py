"""Tensor frames: the one message format on swarmtrain's streams.

A frame is a fixed prefix, a msgpack header and a raw payload:

    magic b"STF1" | header_len: u32 LE | payload_len: u64 LE | header | payload

The header names the frame's kind, run, microbatch and stage, small metadata values, and
for each tensor a spec: [name, dtype, shape, "none", nbytes] for raw values, or
[name, dtype, shape, codec, nbytes, codec_meta] for a tensor a codec compressed (dtype and
shape are then those of the decoded tensor, nbytes the compressed size). The payload is the
tensors' bytes back to back, in header order.

A reader checks the prefix against its limits before reading anything else, validates the
whole header before reading the payload (for a compressed tensor: a known codec, its meta,
and the payload size the codec needs for the declared shape; the decoded sizes against
`max_decoded_bytes`), keeps the payload as it arrives, and decodes and checks for NaN/inf
before handing tensors on: a peer can make us reject a frame, never hold more than it sent.

Senders choose codecs per tensor (`Frame(..., codecs={"x": "int8"})`) or put tensors they
encoded themselves (`Encoded`, for error feedback) in `tensors`; receivers always get plain
decoded tensors, and `wire_nbytes` says what the frame cost on the wire.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from swarmtrain.errors import BadFrameError, Cause
from swarmtrain.wire.codec import Encoded, Meta, find_codec, known_codecs

MAGIC = b"STF1"
PREFIX = struct.Struct("<4sIQ")  # magic, header_len, payload_len
MAX_HEADER_BYTES = 256 * 1024
DEFAULT_MAX_FRAME_BYTES = 256 * 2**20
MAX_TENSORS = 1024
"""Enough for a stage's whole state in one frame (kind 'state_data')."""
MAX_NDIM = 8

FRAME_KINDS = ("forward", "result", "step", "step_done", "ping", "pong", "state", "state_data", "grads")
FRAME_KINDS += ("report", "outcome", "error")  # trainer to trainer; any reply
FRAME_KINDS += ("weights", "weights_data")  # a policy version's parameters (swarmtrain.train.versions)
FRAME_KINDS += ("rollout", "rollout_data")  # trainer <-> rollout peer (swarmtrain.wire.rollout_messages)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
META_VALUE_TYPES = (int, float, str, bool, type(None))
MAX_META_LIST = 4096
"""Longest list a meta value may be (lists hold scalars: microbatch ids, peer ids, stages)."""
MAX_CODEC_META_ITEMS = 8
MAX_CODEC_META_CHARS = 32
"""Longest key or string value in a codec's meta."""
MAX_DECODE_EXPANSION = 8
"""Default limit on decoded / wire bytes (4-bit codecs decode to at most 8x their size in fp32)."""
READ_CHUNK_BYTES = 2**20  # most payload bytes read (and kept) at a time


@dataclass(kw_only=True)
class Frame:
    """One request or reply. `tensors` are CPU tensors; `meta` holds scalars and lists of
    scalars only (`swarmtrain.wire.messages` gives each kind of frame its typed meta)."""

    kind: str
    run_id: str
    mb_id: str = ""
    """Microbatch id '(trainer):(step):(n)', empty for frames about no microbatch."""
    stage: int = -1
    """The stage the frame is addressed to (requests) or comes from (replies)."""
    step: int = -1
    tensors: dict[str, torch.Tensor | Encoded] = field(default_factory=dict)
    """Sender: tensors to send, plain or already Encoded. Receiver: plain (decoded) CPU tensors."""
    meta: dict[str, Any] = field(default_factory=dict)
    codecs: dict[str, str] = field(default_factory=dict)
    """Sender: tensor name -> codec to compress that plain float tensor with (absent: raw).
    Receiver: the codec of each tensor that came compressed."""
    wire_nbytes: int = 0
    """Receiver: payload bytes the frame took on the wire (set by read_frame)."""

    def error_text(self) -> str:
        return str(self.meta.get("error", "unknown error"))

    def error_cause(self) -> Cause:
        """An error frame's cause (an unknown one counts as the peer's own failure)."""
        try:
            return Cause(self.meta.get("cause"))
        except ValueError:
            return Cause.OWN_FAILURE

    def raw_nbytes(self) -> int:
        """Bytes of the tensors uncompressed (the wire size if nothing were compressed)."""
        return sum(t.raw_nbytes if isinstance(t, Encoded) else t.nbytes for t in self.tensors.values())


def error_frame(
    run_id: str,
    message: str,
    *,
    cause: Cause,
    retryable: bool | None = None,
    mb_id: str = "",
    stage: int = -1,
) -> Frame:
    """The reply a peer sends when it refuses or fails a request: a message for people, a
    `cause` for the caller's decision, and whether retrying elsewhere may help (by default
    what the cause implies)."""
    cause = Cause(cause)
    return Frame(
        kind="error",
        run_id=run_id,
        mb_id=mb_id,
        stage=stage,
        meta={
            "error": message,
            "cause": cause.value,
            "retryable": cause.retryable if retryable is None else retryable,
        },
    )


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in host memory; a GPU tensor (a compressed payload, or a raw tensor
    sent without a codec) is copied out through pinned memory. `write_frame` moves a frame's
    GPU tensors to the host first, off the event loop (`to_host`): this is the fallback."""
    t = t.detach().contiguous()
    if t.is_cuda:
        t = _copy_to_host([t])[0]
    return memoryview(t.cpu().reshape(-1).view(torch.uint8).numpy())


_copy_streams: dict[torch.device, Any] = {}


def _copy_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pinned host copies of CUDA `tensors`, made on a copy stream of their device (so they
    overlap compute queued after them) and waited for by this thread only."""
    device = tensors[0].device
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))  # after the kernels that made them
    hosts = []
    with torch.cuda.stream(stream):
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy is done
            hosts.append(host)
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
    return hosts


def has_device_tensors(frame: Frame) -> bool:
    """Whether any of `frame`'s tensors (or encoded payloads) is on a GPU."""
    return any((t.payload if isinstance(t, Encoded) else t).is_cuda for t in frame.tensors.values())


def to_host(frame: Frame) -> Frame:
    """`frame` with its GPU tensors compressed on the GPU (as `frame.codecs` says: only the
    compressed bytes cross to the host) and copied to pinned host memory on a copy stream.
    Blocks until the copies are done: `write_frame` runs it in a worker thread, so the event
    loop never waits for the GPU. A frame without GPU tensors is returned as it is."""
    if not has_device_tensors(frame):
        return frame
    tensors, codecs = dict(frame.tensors), dict(frame.codecs)
    for name, t in frame.tensors.items():
        if codecs.get(name, "none") != "none" and isinstance(t, torch.Tensor) and t.is_cuda:
            tensors[name] = _encode(name, t, codecs.pop(name))  # ValueError for inf/NaN, as in encode_frame

    def device_part(t: torch.Tensor | Encoded) -> torch.Tensor:
        return t.payload if isinstance(t, Encoded) else t

    on_gpu = [name for name, t in tensors.items() if device_part(t).is_cuda]
    hosts = _copy_to_host([device_part(tensors[name]).detach().contiguous() for name in on_gpu])
    for name, host in zip(on_gpu, hosts, strict=True):
        t = tensors[name]
        tensors[name] = dataclasses.replace(t, payload=host) if isinstance(t, Encoded) else host
    return dataclasses.replace(frame, tensors=tensors, codecs=codecs)


def _encode(name: str, t: torch.Tensor, codec_name: str) -> Encoded:
    codec = find_codec(codec_name)
    if codec is None:
        raise ValueError(
            f"tensor {name!r}: unknown codec {codec_name!r} (known: {', '.join(known_codecs())})"
        )
    if not t.is_floating_point():
        raise ValueError(f"tensor {name!r}: codec {codec_name!r} compresses float tensors, got {t.dtype}")
    payload, meta = codec.encode(t.detach())  # ValueError for inf/NaN: nothing non-finite is sent
    return Encoded(codec=codec_name, payload=payload, meta=meta, shape=tuple(t.shape), dtype=t.dtype)


def encode_frame(frame: Frame) -> list[bytes | memoryview]:
    """Serialize `frame` into buffers to write in order (raw tensor bytes are not copied).

    Tensors named in `frame.codecs` are compressed first; ValueError for an unknown codec, a
    non-float tensor given a codec, or inf/NaN in a tensor being compressed.
    """
    if frame.kind not in FRAME_KINDS:
        raise ValueError(f"unknown frame kind {frame.kind!r}")
    if unknown := set(frame.codecs) - set(frame.tensors):
        raise ValueError(f"codecs name tensors the frame does not hold: {sorted(unknown)}")
    specs, buffers = [], []
    for name, t in frame.tensors.items():
        if frame.codecs.get(name, "none") != "none":
            if isinstance(t, Encoded):
                raise ValueError(f"tensor {name!r} is already encoded with {t.codec!r}; drop it from codecs")
            t = _encode(name, t, frame.codecs[name])
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which frames do not carry")
        if isinstance(t, Encoded):
            if find_codec(t.codec) is None:
                raise ValueError(
                    f"tensor {name!r}: unknown codec {t.codec!r} (known: {', '.join(known_codecs())})"
                )
            buf = _tensor_bytes(t.payload)
            specs.append([name, DTYPE_NAMES[t.dtype], list(t.shape), t.codec, buf.nbytes, dict(t.meta)])
        else:
            buf = _tensor_bytes(t)
            specs.append([name, DTYPE_NAMES[t.dtype], list(t.shape), "none", buf.nbytes])
        buffers.append(buf)
    header = msgpack.packb(
        {
            "kind": frame.kind,
            "run": frame.run_id,
            "mb": frame.mb_id,
            "stage": frame.stage,
            "step": frame.step,
            "tensors": specs,
            "meta": frame.meta,
        },
        use_bin_type=True,
    )
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header is {len(header)} bytes, the limit is {MAX_HEADER_BYTES}")
    payload_len = sum(b.nbytes for b in buffers)
    return [PREFIX.pack(MAGIC, len(header), payload_len), header, *buffers]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise BadFrameError(message)


def _check_codec_meta(name: str, codec: str, meta: Any) -> None:
    _check(
        isinstance(meta, dict)
        and len(meta) <= MAX_CODEC_META_ITEMS
        and all(
            isinstance(k, str)
            and len(k) <= MAX_CODEC_META_CHARS
            and isinstance(v, (int, float, str))
            and not isinstance(v, bool)
            and (not isinstance(v, str) or len(v) <= MAX_CODEC_META_CHARS)
            for k, v in meta.items()
        ),
        f"tensor {name!r}: codec {codec!r} meta must map at most {MAX_CODEC_META_ITEMS} short names to "
        f"numbers or short strings, got {meta!r:.120}",
    )


def _spec_nbytes(spec: list) -> tuple[int, int]:
    """Validate one tensor spec; returns (payload bytes it needs, decoded bytes)."""
    _check(
        isinstance(spec, list) and len(spec) in (5, 6),
        "tensor spec must be [name, dtype, shape, codec, nbytes] or [name, dtype, shape, codec, nbytes, codec_meta]",
    )
    name, dtype, shape, codec, nbytes = spec[:5]
    _check(isinstance(name, str), f"tensor name {name!r} is not a new string")
    _check(
        isinstance(dtype, str) and dtype in DTYPES,  # a list or map here is unhashable, not a TypeError
        f"tensor {name!r}: unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})",
    )
    _check(
        codec == "none" or find_codec(codec) is not None,
        f"tensor {name!r}: unknown codec {codec!r} (known: {', '.join(known_codecs())})",
    )
    _check(
        isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape),
        f"tensor {name!r}: shape must be at most {MAX_NDIM} non-negative ints, got {shape!r}",
    )
    decoded = math.prod(shape) * DTYPES[dtype].itemsize
    if codec == "none":
        _check(len(spec) == 5, f"tensor {name!r}: codec 'none' takes no codec meta")
        want = decoded
        _check(
            isinstance(nbytes, int) and nbytes == want,
            f"tensor {name!r}: {nbytes!r} bytes do not match dtype {dtype} and shape {shape} ({want} bytes)",
        )
        return want, decoded
    _check(len(spec) == 6, f"tensor {name!r}: codec {codec!r} needs its meta as the spec's 6th field")
    _check(
        DTYPES[dtype].is_floating_point, f"tensor {name!r}: codec {codec!r} decodes to floats, not {dtype}"
    )
    meta: Meta = spec[5]
    _check_codec_meta(name, codec, meta)
    try:
        want = find_codec(codec).payload_nbytes(meta, tuple(shape), DTYPES[dtype])
    except BadFrameError as e:
        raise BadFrameError(f"tensor {name!r}: {e}") from None
    _check(
        isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes == want,
        f"tensor {name!r}: {nbytes!r} bytes do not match codec {codec} for dtype {dtype} and shape {shape} "
        f"({want} bytes)",
    )
    return want, decoded


def parse_header(raw: bytes, payload_len: int, *, max_decoded_bytes: int | None = None) -> dict:
    """Decode and validate a header; raises BadFrameError naming the first problem.

    `max_decoded_bytes` bounds the tensors' total size once decoded (None: no bound beyond
    what the payload size implies).
    """
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:
        raise BadFrameError(f"frame header is not valid msgpack ({type(e).__name__})") from None
    _check(isinstance(header, dict), "frame header is not a mapping")
    expected = {"kind", "run", "mb", "stage", "step", "tensors", "meta"}
    _check(set(header) == expected, f"frame header has fields {sorted(header)}, expected {sorted(expected)}")
    _check(header["kind"] in FRAME_KINDS, f"unknown frame kind {header['kind']!r}")
    _check(isinstance(header["run"], str) and len(header["run"]) <= 64, "frame run id must be a short string")
    _check(
        isinstance(header["mb"], str) and len(header["mb"]) <= 256,
        "frame microbatch id must be a short string",
    )
    for key in ("stage", "step"):
        _check(
            isinstance(header[key], int) and not isinstance(header[key], bool), f"frame {key} must be an int"
        )
    meta = header["meta"]
    _check(isinstance(meta, dict), "frame meta must be a mapping")
    for k, v in meta.items():
        _check(
            isinstance(k, str)
            and (
                isinstance(v, META_VALUE_TYPES)
                or (
                    isinstance(v, list)
                    and len(v) <= MAX_META_LIST
                    and all(isinstance(i, META_VALUE_TYPES) for i in v)
                )
            ),
            f"frame meta {k!r} must be a scalar or a list of at most {MAX_META_LIST} scalars",
        )
    specs = header["tensors"]
    _check(
        isinstance(specs, list) and len(specs) <= MAX_TENSORS, f"a frame holds at most {MAX_TENSORS} tensors"
    )
    total, total_decoded, names = 0, 0, set()
    for spec in specs:
        want, decoded = _spec_nbytes(spec)
        _check(spec[0] not in names, f"tensor name {spec[0]!r} is not a new string")
        names.add(spec[0])
        total += want
        total_decoded += decoded
    _check(total == payload_len, f"frame payload is {payload_len} bytes but its tensors need {total}")
    _check(
        max_decoded_bytes is None or total_decoded <= max_decoded_bytes,
        f"frame tensors decode to {total_decoded} bytes, over the limit of {max_decoded_bytes} bytes",
    )
    return header


# float dtype -> (same-width int dtype, its unsigned numpy view, magnitude mask, exponent mask):
# a value is NaN or +-inf exactly when its exponent bits are all ones, that is when its
# magnitude bits (all but the sign) reach the exponent mask.
_NONFINITE_BITS = {
    torch.float32: (torch.int32, np.uint32, 0x7FFFFFFF, 0x7F800000),
    torch.float16: (torch.int16, np.uint16, 0x7FFF, 0x7C00),
    torch.bfloat16: (torch.int16, np.uint16, 0x7FFF, 0x7F80),
}


def all_finite(t: torch.Tensor) -> bool:
    """torch.isfinite(t).all(), computed on the raw bits in numpy.

    One thread and one temporary: torch's version makes bool copies and wakes its thread
    pool, which on a busy host costs several times the round trip of a 256 KiB frame.
    """
    if t.numel() == 0:
        return True
    if t.device.type != "cpu":  # where it lives: one flag crosses to the host, not the tensor
        return bool(torch.isfinite(t).all())
    int_dtype, unsigned, magnitude, exponent = _NONFINITE_BITS[t.dtype]
    bits = t.view(int_dtype).numpy().view(unsigned)
    return bool(np.bitwise_and(bits, magnitude).max() < exponent)


def decode_tensors(
    header: dict, payload: bytearray, *, allow_nonfinite: bool = False, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Tensors of a validated header: raw ones view `payload`, compressed ones are decoded (on
    `device` when given: only the compressed bytes cross to it, and the decoded tensor is
    checked there).

    Rejects NaN/inf (after decoding) unless allowed.
    """
    tensors, offset = {}, 0
    for name, dtype, shape, codec, nbytes, *codec_meta in header["tensors"]:
        if codec != "none":
            raw = (
                torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            if device is not None:
                raw = raw.to(device)
            try:
                t = find_codec(codec).decode(raw, codec_meta[0], tuple(shape), DTYPES[dtype])
            except BadFrameError as e:
                raise BadFrameError(f"tensor {name!r}: {e}") from None
        elif nbytes:
            t = torch.frombuffer(
                payload, dtype=DTYPES[dtype], count=nbytes // DTYPES[dtype].itemsize, offset=offset
            ).view(shape)
        else:
            t = torch.empty(0, dtype=DTYPES[dtype]).view(shape)
        if t.is_floating_point() and not allow_nonfinite and not all_finite(t):
            raise BadFrameError(f"tensor {name!r} holds NaN or inf values")
        tensors[name] = t
        offset += nbytes
    return tensors


async def read_frame(
    reader: asyncio.StreamReader,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_decoded_bytes: int | None = None,
    allow_nonfinite: bool = False,
    charge: Callable[[int], None] = lambda _nbytes: None,
    first: bytes = b"",
    device: torch.device | None = None,
) -> Frame:
    """Read one frame. Raises BadFrameError for a malformed one, IncompleteReadError on EOF.

    `max_frame_bytes` bounds the payload off the wire, `max_decoded_bytes` the decoded tensors
    (default MAX_DECODE_EXPANSION x max_frame_bytes). Memory grows as bytes arrive: `charge(n)`
    runs before n more are kept and may raise BadFrameError; `first`: prefix bytes already read;
    `device`: where compressed tensors are decoded (default: the host, as raw ones stay).
    """
    if max_decoded_bytes is None:
        max_decoded_bytes = MAX_DECODE_EXPANSION * max_frame_bytes
    magic, header_len, payload_len = PREFIX.unpack(first + await reader.readexactly(PREFIX.size - len(first)))
    _check(magic == MAGIC, f"not a swarmtrain frame (magic {magic!r}, expected {MAGIC!r})")
    _check(header_len <= MAX_HEADER_BYTES, f"frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    _check(
        payload_len <= max_frame_bytes,
        f"frame payload of {payload_len} bytes exceeds the limit of {max_frame_bytes} bytes",
    )
    charge(PREFIX.size + header_len)
    raw_header = await reader.readexactly(header_len)
    header = parse_header(raw_header, payload_len, max_decoded_bytes=max_decoded_bytes)
    payload = bytearray()
    while len(payload) < payload_len:
        chunk = await reader.read(min(payload_len - len(payload), READ_CHUNK_BYTES))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(payload), payload_len)
        charge(len(chunk))
        payload += chunk
    return Frame(
        kind=header["kind"],
        run_id=header["run"],
        mb_id=header["mb"],
        stage=header["stage"],
        step=header["step"],
        tensors=decode_tensors(header, payload, allow_nonfinite=allow_nonfinite, device=device),
        meta=header["meta"],
        codecs={spec[0]: spec[3] for spec in header["tensors"] if spec[3] != "none"},
        wire_nbytes=payload_len,
    )


async def write_frame(
    writer: asyncio.StreamWriter, frame: Frame, *, preamble: bytes = b"", pacer=None
) -> int:
    """Write `preamble` then `frame` (compressed as `frame.codecs` says); returns its wire payload bytes.

    A frame holding GPU tensors is compressed and copied to the host in a worker thread first
    (`to_host`): the event loop never waits for the GPU. With a `pacer`
    (`swarmtrain.transport.pacing.Pacer`) the encoded frame waits for its slot on the uplink."""
    if has_device_tensors(frame):
        frame = await asyncio.to_thread(to_host, frame)
    # every separate send is a hop through both p2p daemons: send small frames whole, and a
    # large frame's prefix and header together (copying its payload would cost more)
    prefix, header, *payload = encode_frame(frame)
    payload_len = sum(b.nbytes for b in payload)
    if pacer is not None:
        await pacer.wait(len(preamble) + len(prefix) + len(header) + payload_len)
    if payload_len <= 64 * 1024:
        writer.write(b"".join([preamble, prefix, header, *payload]))
    else:
        writer.write(preamble + prefix + header)
        for buf in payload:
            writer.write(buf)
    await writer.drain()
    return payload_len
