"""A stage replica's answer to a 'weights' request: its parameters at one policy version.

The request (`WeightsRequest`) names the version, a codec and the pieces it wants (row ranges
of the stage's parameters, planned by the caller to fit a frame: `swarmtrain.rl.weights`).
The replica reads them from a snapshot of that version, or from its live parameters on the
compute thread when the version is its current one (so no commit can step them mid-read), and
compresses them off the event loop. What it holds is `swarmtrain.train.versions`; who may ask
is `swarmtrain.train.authority` ('weights').
"""

from __future__ import annotations

import asyncio
import math

from torch import Tensor

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.train.context import StageContext
from swarmtrain.train.versions import check_pieces
from swarmtrain.wire.codec import Encoded, find_codec, known_codecs
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import WeightsRequest


def piece_nbytes(shape, start: int, end: int, itemsize: int) -> int:
    """Bytes of rows start..end of a parameter of `shape`, uncompressed."""
    return (end - start) * math.prod(shape[1:]) * itemsize if len(shape) else itemsize


def encode_pieces(tensors: list[Tensor], codec: str) -> dict[str, Tensor | Encoded]:
    """Frame tensors '0'..'N-1': as they are for codec 'none', else encoded with `codec`
    (float tensors only; others go as they are)."""
    out: dict[str, Tensor | Encoded] = {}
    coder = find_codec(codec)
    for i, t in enumerate(tensors):
        if coder is None or not t.is_floating_point():
            out[str(i)] = t
        else:
            payload, meta = coder.encode(t.contiguous())
            out[str(i)] = Encoded(
                codec=codec, payload=payload, meta=meta, shape=tuple(t.shape), dtype=t.dtype
            )
    return out


async def serve_weights(ctx: StageContext, request: WeightsRequest) -> Frame:
    """The reply to an authorized weights request (see the module docstring).

    Raises RemoteError: BAD_FRAME for an unknown codec or more bytes than a frame may carry,
    WRONG_STEP for a version this replica has not reached, VERSION_GONE for one it no longer
    holds; BadFrameError for pieces that name no parameter of the stage or rows it lacks.
    """
    runner, versions = ctx.runner, ctx.runner.versions
    versions.mark_interest()
    if request.codec not in known_codecs():
        raise RemoteError(
            f"unknown codec {request.codec!r} for weights (known: {', '.join(known_codecs())})",
            cause=Cause.BAD_FRAME,
        )
    pieces = request.pieces()
    params = runner.named_params
    check_pieces({k: p.shape for k, p in params.items()}, pieces)
    nbytes = sum(piece_nbytes(params[n].shape, s, e, params[n].element_size()) for n, s, e in pieces)
    limit = ctx.transport.config.max_frame_bytes
    if nbytes > limit:
        raise RemoteError(
            f"a weights request may ask for at most {limit} bytes (this peer's frame limit), this one "
            f"asks for {nbytes}: split it",
            cause=Cause.BAD_FRAME,
        )
    version = request.version
    tensors = versions.read_held(version, pieces)
    if tensors is None:  # the live parameters: read between two tasks, never across a commit
        tensors = await ctx.scheduler.call(lambda: versions.read(version, runner.step, params, pieces))
    if request.codec != "none":
        tensors = await asyncio.get_running_loop().run_in_executor(
            None, encode_pieces, tensors, request.codec
        )
    else:
        tensors = {str(i): t for i, t in enumerate(tensors)}
    return Frame(kind="weights_data", run_id=ctx.run_id, stage=ctx.stage, step=version, tensors=tensors)
