"""`swarmtrain export`: the current model of a run, out of the swarm into a directory.

It joins the swarm as a client, asks one serving replica of every stage for its parameters,
and keeps them only if every stage answered at the same step (a step being applied moves the
stages one after another: it asks again until they agree). It writes `model.safetensors` with
every parameter under its swarm name and `swarmtrain.json` with what builds the model
(`swarmtrain.train.archive`); for a builder with a native format (a Hugging Face folder) the
native files too, so `from_pretrained` loads the result. `load_exported` builds it back in one
process.

Reading a stage's parameters is for the run's owner, its trainers and its stages' members:
the command uses this machine's trainer key (`--identity` for another).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from swarmtrain.errors import SwarmError
from swarmtrain.model import ModelSources, build_model
from swarmtrain.model.hf import BUILDER as HF_BUILDER
from swarmtrain.model.hf import save_native
from swarmtrain.model.param_names import model_param_name, stage_param_names
from swarmtrain.model.registry import NO_IMPORTS
from swarmtrain.swarm import NodeConfig, SwarmNode, stage_replicas
from swarmtrain.train.archive import (
    EXPORT_FORMAT,
    MODEL_FILE,
    RUN_FORMAT,
    read_meta,
    read_tensors,
    write_model_dir,
)
from swarmtrain.train.checkpoint import to_files
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.transport.in_turn import ask_in_turn
from swarmtrain.wire.frames import Frame

logger = logging.getLogger(__name__)

STATE_TIMEOUT_S = 120.0


NATIVE_DIR = "hf"
"""Where an export of a Hugging Face model also writes it in transformers' own layout."""


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    num_params: int
    native: Path | None = None
    """The model in its native layout (a Hugging Face folder), if its builder has one."""


async def _fetch_all(node: SwarmNode, manifest, timeout_s: float) -> tuple[int, list[dict]]:
    transport = TensorTransport(await node.p2p(), swarm_key=node.swarm_key)
    deadline, last = time.monotonic() + timeout_s, "no stage answered"
    while time.monotonic() < deadline:
        by_stage = stage_replicas(await node.peers_async(manifest.run_id))
        missing = [k for k in range(manifest.num_stages) if not by_stage.get(k)]
        if missing:
            last = f"no peer serves stage(s) {', '.join(map(str, missing))}"
            await asyncio.sleep(1.0)
            continue

        async def fetch(stage: int, records: list) -> Frame:
            frame = Frame(kind="state", run_id=manifest.run_id, stage=stage)
            peers = [r.peer_id for r in records]
            answer = await ask_in_turn(
                transport, peers, handler_name(manifest.run_id), frame, timeout_s=STATE_TIMEOUT_S
            )
            if not answer.answered:
                raise SwarmError(f"no replica of stage {stage} gave its parameters ({answer.reasons()})")
            return answer.value

        try:
            replies = await asyncio.gather(*(fetch(k, by_stage[k]) for k in range(manifest.num_stages)))
        except SwarmError as e:
            last = str(e)
            await asyncio.sleep(1.0)
            continue
        steps = {r.step for r in replies}
        if len(steps) == 1:
            return steps.pop(), [r.tensors for r in replies]
        last = f"the stages answered at different steps {sorted(steps)} (a step was being applied)"
        await asyncio.sleep(0.2)
    raise SwarmError(f"could not export run {manifest.run_id!r} within {timeout_s:.0f} s: {last}")


def export_model(
    node_config: NodeConfig,
    run_id: str | None,
    out: Path | str,
    *,
    resumable: bool = False,
    timeout_s: float = 120.0,
    sources: ModelSources = NO_IMPORTS,
) -> Exported:
    """Write run `run_id`'s current model to `out` (see the module docstring); `resumable`: a
    run checkpoint, with the optimizer state and the manifest (`coordinator --resume`)."""
    node = SwarmNode(node_config)
    try:
        manifest = node.require_manifest(run_id)
        step, states = asyncio.run(_fetch_all(node, manifest, timeout_s))
    finally:
        node.shutdown()
    params, optimizer = {}, {}
    for stage, state in enumerate(states):
        stage_params, stage_optim = to_files(state, stage_param_names(manifest, stage, sources))
        params.update(stage_params)
        optimizer.update(stage_optim)
    meta = {
        "format": RUN_FORMAT if resumable else EXPORT_FORMAT,
        "run_id": manifest.run_id,
        "step": step,
        "model": manifest.model,
        "model_config": dict(manifest.model_config),
        "num_blocks": manifest.num_blocks,
        "loss": manifest.loss,
    }
    if resumable:
        meta["manifest"] = manifest.to_dict()
    where = write_model_dir(out, params=params, meta=meta, optimizer=optimizer if resumable else None)
    native = None
    if manifest.model == HF_BUILDER:  # and as a folder transformers loads: from_pretrained(OUT/hf)
        native = save_native(params, manifest.model_config, where / NATIVE_DIR)
    return Exported(out=where, step=step, num_params=sum(t.numel() for t in params.values()), native=native)


def load_exported(where: Path | str, *, sources: ModelSources = NO_IMPORTS) -> nn.Module:
    """The model of an exported directory (or a run checkpoint), built in this process on the CPU
    with the exported parameters (ConfigError if they do not fit the builder's model)."""
    meta = read_meta(where)
    model = build_model(meta["model"], meta["model_config"], device="cpu", sources=sources)
    names = {}
    for key, part in model.parts():
        for name, _ in part.named_parameters():
            names[f"{key}.{name}"] = model_param_name(f"{key}.{name}")
    tensors = read_tensors(where, names, file=MODEL_FILE)
    model.load_state_dict({names[k]: v for k, v in tensors.items()}, strict=False)
    return model.eval()
