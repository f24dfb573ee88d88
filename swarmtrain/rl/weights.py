"""Policy weights out of the swarm, by version: what a rollout peer loads after every step.

Version v of the policy is the model's parameters after the run applied steps 0..v-1
(`swarmtrain.train.versions`): version 0 is the initial weights, and a stage replica that
applied step s announces step s + 1 in its record, which is the version it serves. There is no
server: `fetch_version` asks, for every stage at once, a replica at that version for its
span's parameters ('weights' requests), in pieces that fit a frame, falls back to another
replica of the stage when one fails, is gone, or no longer holds the version, and puts the
spans together under the whole model's parameter names (`SwarmModel.state_dict` keys, the
trained parameters only: frozen ones never change, and the rollout peer builds them itself).

The pieces travel exact ('none': the parameters' own dtype, bit for bit) or compressed with a
registered codec: 'bf16' halves float32's bytes (a relative error of at most 2^-9 per value),
'int8' (blockwise absmax, block 256) takes about a quarter (an error of at most 1/254 of each
block's largest magnitude). Replicas keep only the newest few versions (2 by default): a fetch
of an older one fails with cause VERSION_GONE, naming the versions they hold; `latest_version`
is the newest one every stage serves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from swarmtrain.errors import BadFrameError, Cause, ConfigError, RemoteError
from swarmtrain.model.param_names import ParamSpec, model_param_name, run_param_specs
from swarmtrain.model.registry import NO_IMPORTS, ModelSources
from swarmtrain.swarm import SwarmNode, stage_replicas
from swarmtrain.train.versions import Piece
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.transport.in_turn import ask_in_turn
from swarmtrain.wire.codec import known_codecs
from swarmtrain.wire.frames import MAX_TENSORS, Frame
from swarmtrain.wire.messages import WeightsRequest
from swarmtrain.wire.records import RunManifest

Replicas = Callable[[], Awaitable[dict[int, list[tuple[str, int]]]]]
"""() -> for each stage, its serving replicas as (peer id, the step its record announces)."""


@dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """How a rollout peer fetches a policy version."""

    codec: str = "none"
    """'none': exact; or a registered codec ('bf16', 'int8', ...) for fewer bytes on the wire."""
    max_request_bytes: int = 64 * 2**20
    """Most parameter bytes (uncompressed) one request asks for; larger spans go in several
    requests, and a parameter larger than this in row ranges. At most the frame limit of both
    sides (`TransportConfig.max_frame_bytes`, 256 MiB by default)."""
    timeout_s: float = 120.0
    """Longest wait for one request's reply."""

    def __post_init__(self):
        if self.codec not in known_codecs():
            raise ConfigError(f"unknown codec {self.codec!r} for weights; choose one of {known_codecs()}")
        if self.max_request_bytes < 1 or not self.timeout_s > 0:
            raise ConfigError(
                f"max_request_bytes must be >= 1 and timeout_s > 0, got {self.max_request_bytes} and {self.timeout_s}"
            )


@dataclass(frozen=True, kw_only=True)
class FetchStats:
    """What fetching one policy version cost."""

    version: int
    codec: str
    wire_bytes: int
    """Tensor bytes received, as they came off the wire."""
    raw_bytes: int
    """Bytes of the parameters as fetched, decoded."""
    seconds: float
    """Wall time of the whole fetch (every stage at once)."""
    requests: int
    """Requests answered."""
    fallbacks: int
    """Requests that failed on one replica before another answered."""
    sources: tuple[str, ...]
    """Per stage, the replica that served its last piece."""

    @property
    def ratio(self) -> float:
        """raw_bytes / wire_bytes: what the codec saved."""
        return self.raw_bytes / max(self.wire_bytes, 1)


@dataclass(kw_only=True)
class PolicySource:
    """Where policy versions come from: a run, a transport to its stage replicas, and a view of
    which replica is at which step (`swarm_source` for a real swarm)."""

    manifest: RunManifest
    transport: TensorTransport
    replicas: Replicas
    specs: list[list[ParamSpec]] = field(default_factory=list)
    """Each stage's trained parameters (empty: from the manifest's model, on first use)."""
    sources: ModelSources = NO_IMPORTS
    """Where the model builder may come from (to read the parameters' names and shapes)."""

    def param_specs(self) -> list[list[ParamSpec]]:
        if not self.specs:
            self.specs = run_param_specs(self.manifest, self.sources)
        return self.specs


async def swarm_source(
    node: SwarmNode,
    run_id: str | None = None,
    *,
    transport: TensorTransport | None = None,
    sources: ModelSources = NO_IMPORTS,
) -> PolicySource:
    """A PolicySource for run `run_id` (None: the swarm's only run) through `node`'s DHT, over
    `transport` (default: a new one on the node's p2p handle)."""
    manifest = node.require_manifest(run_id)
    if transport is None:
        transport = TensorTransport(await node.p2p(), swarm_key=node.swarm_key)

    async def replicas() -> dict[int, list[tuple[str, int]]]:
        by_stage = stage_replicas(await node.peers_async(manifest.run_id))
        return {k: [(r.peer_id, r.step) for r in records] for k, records in by_stage.items()}

    return PolicySource(manifest=manifest, transport=transport, replicas=replicas, sources=sources)


async def latest_version(source: PolicySource) -> int | None:
    """The newest version every stage has a serving replica at (by their records, which lag
    a heartbeat); None while some stage has none."""
    by_stage = await source.replicas()
    newest = [
        max((step for _, step in by_stage.get(k, [])), default=None)
        for k in range(source.manifest.num_stages)
    ]
    return None if None in newest else min(newest)


def plan_requests(specs: list[ParamSpec], max_request_bytes: int) -> list[list[Piece]]:
    """The pieces of one stage's parameters, grouped into requests of at most
    `max_request_bytes` (uncompressed) and MAX_TENSORS pieces each; a parameter larger than
    that goes in row ranges. ConfigError if a single row is larger."""
    requests: list[list[Piece]] = [[]]
    used = 0
    for name, shape, dtype in specs:
        rows = shape[0] if len(shape) else 1
        row_bytes = (shape[1:].numel() if len(shape) else 1) * dtype.itemsize
        if row_bytes > max_request_bytes:
            raise ConfigError(
                f"one row of parameter {name!r} is {row_bytes} bytes, over max_request_bytes {max_request_bytes}"
            )
        start = 0
        while start < rows:
            room = (max_request_bytes - used) // row_bytes
            if room == 0 or len(requests[-1]) == MAX_TENSORS:
                requests.append([])
                used, room = 0, max_request_bytes // row_bytes
            end = min(rows, start + room)
            requests[-1].append((name, start, end))
            used += (end - start) * row_bytes
            start = end
    return [r for r in requests if r]


def candidates(replicas: list[tuple[str, int]], version: int) -> list[str]:
    """The replicas to ask for `version`, in order: at it, then those a little past it (they
    may keep it), then those short of it (their records may lag)."""

    def rank(replica: tuple[str, int]) -> tuple[int, int]:
        step = replica[1]
        return (0, 0) if step == version else (1, step - version) if step > version else (2, version - step)

    return [peer for peer, _ in sorted(replicas, key=rank)]


def _no_answer(stage: int, version: int, reasons: str, causes: set[Cause]) -> RemoteError:
    if Cause.VERSION_GONE in causes and Cause.WRONG_STEP not in causes:
        return RemoteError(
            f"version {version} is gone from stage {stage}'s replicas ({reasons}); fetch a newer one "
            "(latest_version)",
            cause=Cause.VERSION_GONE,
        )
    if Cause.WRONG_STEP in causes and Cause.VERSION_GONE not in causes:
        return RemoteError(
            f"version {version} is not yet applied by any replica of stage {stage} ({reasons})",
            cause=Cause.WRONG_STEP,
        )
    cause = Cause.UNAUTHORIZED if Cause.UNAUTHORIZED in causes else Cause.UNREACHABLE
    return RemoteError(f"no replica of stage {stage} gave version {version}: {reasons}", cause=cause)


@dataclass
class _StageFetch:
    tensors: dict[str, list[Tensor]] = field(default_factory=dict)
    wire_bytes: int = 0
    requests: int = 0
    fallbacks: int = 0
    source: str = ""


async def _fetch_stage(
    source: PolicySource,
    stage: int,
    specs: list[ParamSpec],
    version: int,
    peers: list[str],
    config: FetchConfig,
) -> _StageFetch:
    shapes = {name: (shape, dtype) for name, shape, dtype in specs}
    limit = min(config.max_request_bytes, source.transport.config.max_frame_bytes)
    out = _StageFetch()
    for name, shape, dtype in specs:  # nothing to ask for: a parameter with no rows
        if len(shape) and shape[0] == 0:
            out.tensors[name] = [torch.empty(shape, dtype=dtype)]
    for pieces in plan_requests(specs, limit):
        request = Frame(
            kind="weights",
            run_id=source.manifest.run_id,
            stage=stage,
            meta=WeightsRequest(
                version=version,
                codec=config.codec,
                names=tuple(p[0] for p in pieces),
                starts=tuple(p[1] for p in pieces),
                ends=tuple(p[2] for p in pieces),
            ).to_meta(),
        )

        async def take(_peer: str, reply: Frame, pieces=pieces) -> tuple[list[Tensor], int]:
            if reply.kind != "weights_data" or reply.step != version or len(reply.tensors) != len(pieces):
                raise BadFrameError(
                    f"a {reply.kind!r} reply of step {reply.step} does not answer the request"
                )
            got = []
            for i, (name, start, end) in enumerate(pieces):
                t, (shape, dtype) = reply.tensors.get(str(i)), shapes[name]
                want = shape if not len(shape) else (end - start, *shape[1:])
                if t is None or tuple(t.shape) != tuple(want) or t.dtype != dtype:
                    raise BadFrameError(f"piece {i} ({name!r}) is not {dtype} of shape {tuple(want)}")
                got.append(t)
            return got, reply.wire_nbytes

        if out.source in peers:  # the replica that answered last goes first
            peers = [out.source, *(p for p in peers if p != out.source)]
        answer = await ask_in_turn(
            source.transport,
            peers,
            handler_name(source.manifest.run_id),
            request,
            timeout_s=config.timeout_s,
            take=take,
        )
        if not answer.answered:
            causes = {e.cause for _, e in answer.failures if isinstance(e, RemoteError)}
            raise _no_answer(stage, version, answer.reasons(), causes)
        out.fallbacks += len(answer.failures)
        out.requests += 1
        out.source = answer.peer
        tensors, out.wire_bytes = answer.value[0], out.wire_bytes + answer.value[1]
        for (name, _, _), t in zip(pieces, tensors):
            out.tensors.setdefault(name, []).append(t)
    return out


async def fetch_version(
    source: PolicySource, version: int, config: FetchConfig | None = None
) -> tuple[dict[str, Tensor], FetchStats]:
    """Policy version `version`, keyed like the whole model's `state_dict` (trained parameters),
    and what fetching it cost (see the module docstring).

    Raises RemoteError: VERSION_GONE when every replica asked of some stage no longer holds it,
    WRONG_STEP when none has reached it yet, UNREACHABLE when some stage has no serving replica
    or none of them gave it (UNAUTHORIZED when they refused the caller).
    """
    config = config or FetchConfig()
    specs = source.param_specs()
    by_stage = await source.replicas()
    missing = [k for k in range(source.manifest.num_stages) if not by_stage.get(k)]
    if missing:
        raise RemoteError(
            f"no replica serves stage(s) {', '.join(map(str, missing))} of run {source.manifest.run_id!r}",
            cause=Cause.UNREACHABLE,
        )
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(
            _fetch_stage(source, k, specs[k], version, candidates(by_stage[k], version), config)
            for k in range(source.manifest.num_stages)
        ),
        return_exceptions=True,
    )
    seconds = time.perf_counter() - t0
    for r in results:
        if isinstance(r, BaseException):
            raise r
    state = {
        model_param_name(name): pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        for r in results
        for name, pieces in r.tensors.items()
    }
    stats = FetchStats(
        version=version,
        codec=config.codec,
        wire_bytes=sum(r.wire_bytes for r in results),
        raw_bytes=sum(t.nbytes for t in state.values()),
        seconds=seconds,
        requests=sum(r.requests for r in results),
        fallbacks=sum(r.fallbacks for r in results),
        sources=tuple(r.source for r in results),
    )
    return state, stats
