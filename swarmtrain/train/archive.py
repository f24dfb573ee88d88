"""Whole-model files: a run's checkpoint (every stage at one step) and an exported model.

A directory holding

- `model.safetensors`: every parameter under its swarm name ('embed.tok.weight',
  'block.3.attn.qkv.weight', 'head.proj.weight');
- `optimizer.safetensors` (run checkpoints only): the optimizer state, '<parameter>.<state>';
- `swarmtrain.json`: the format, the step, and what builds the model (builder name, its
  options, block count, the run's loss) — with the whole manifest for a run checkpoint, so
  `coordinator --resume DIR` can start the run again from it.

Nothing in it needs swarmtrain to read. A stage peer started with `--init-from DIR` (or a run
resumed from one) reads only its own parameters' tensors from `model.safetensors`
(`read_tensors`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from swarmtrain.errors import ConfigError

if TYPE_CHECKING:
    from swarmtrain.model.swarm_model import SwarmModel

EXPORT_FORMAT = "swarmtrain-export/1"
RUN_FORMAT = "swarmtrain-run-checkpoint/1"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "swarmtrain.json"


def write_model_dir(
    out: Path | str,
    *,
    params: dict[str, Tensor],
    meta: dict,
    optimizer: dict[str, Tensor] | None = None,
) -> Path:
    """Write `params` (and `optimizer`) and `meta` into `out` atomically (a temporary directory
    beside it, renamed into place; an existing `out` is replaced only once the new one is whole)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in params.items()}, str(tmp / MODEL_FILE))
    if optimizer is not None:
        save_file({k: v.contiguous() for k, v in optimizer.items()}, str(tmp / OPTIMIZER_FILE))
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def save_model(
    model: SwarmModel, out: Path | str, *, builder: str, config: dict, loss: str | None = None
) -> Path:
    """Write a whole model built in this process (`build_model(builder, config)`) to `out` as an
    export: `coordinator --init-from OUT` (`LocalSwarmConfig.init_from`) starts a run from it,
    `load_exported` reads it back. Returns `out`."""
    params = {
        f"{key}.{name}": p.detach().cpu()
        for key, part in model.parts()
        for name, p in part.named_parameters()
    }  # swarm names ('block.3.attn.w'), as a run's export holds them
    meta = {
        "format": EXPORT_FORMAT,
        "run_id": "local",
        "step": 0,
        "model": builder,
        "model_config": dict(config),
        "num_blocks": model.num_blocks,
        "loss": loss,
    }
    return write_model_dir(out, params=params, meta=meta)


def read_meta(where: Path | str) -> dict:
    """`swarmtrain.json` of a model directory; ConfigError naming the directory otherwise."""
    path = Path(where) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{where} is not a swarmtrain model directory ({META_FILE}: {e}): give a directory "
            "written by `swarmtrain export` or by a coordinator's --checkpoint-dir"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") not in (EXPORT_FORMAT, RUN_FORMAT):
        raise ConfigError(f"{path} is not a {EXPORT_FORMAT} or {RUN_FORMAT} file")
    return meta


def read_tensors(where: Path | str, names: Iterable[str], *, file: str = MODEL_FILE) -> dict[str, Tensor]:
    """Only the tensors `names` of `where/file` (the others are never read); ConfigError naming
    the missing ones."""
    path = Path(where) / file
    names = list(names)
    try:
        with safe_open(str(path), framework="pt") as f:
            have = set(f.keys())
            missing = [n for n in names if n not in have]
            if missing:
                raise ConfigError(
                    f"{path} lacks {len(missing)} tensor(s) this stage needs, e.g. {missing[:3]}: "
                    "it holds another model or another model configuration"
                )
            return {n: f.get_tensor(n) for n in names}
    except (OSError, ValueError) as e:  # safetensors' own errors are ValueError subclasses or OSError
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot read {path}: {e}") from None


def optimizer_names(where: Path | str) -> list[str]:
    """The tensor names of a run checkpoint's optimizer file (empty for an export)."""
    path = Path(where) / OPTIMIZER_FILE
    if not path.is_file():
        return []
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def stage_init_state(
    where: Path | str, param_names: list[str], *, resume: bool
) -> tuple[dict[str, Tensor], int]:
    """A stage's starting state from a model directory: its parameters (only its own tensors are
    read) and, when `resume`, its optimizer state and the directory's step; as the state
    `StageRunner.import_state` takes, and the step to start at."""
    from swarmtrain.train.checkpoint import from_files

    meta = read_meta(where)
    params = read_tensors(where, param_names)
    if not resume:
        return {f"param.{k}": v for k, v in params.items()}, 0
    if meta["format"] != RUN_FORMAT:
        raise ConfigError(
            f"{where} is an exported model, not a run checkpoint: it has no optimizer state to resume"
        )
    own = set(param_names)
    names = [n for n in optimizer_names(where) if n.rpartition(".")[0] in own]
    optim = read_tensors(where, names, file=OPTIMIZER_FILE)
    return from_files(params, optim, param_names), int(meta["step"])
