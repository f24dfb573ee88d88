"""Stage checkpoints on disk: one stage's parameters, optimizer state and step, atomically.

A stage checkpoint is a directory `<root>/<run id>/stage-<k>/step-<N>/` holding

- `params.safetensors`: the stage's parameters under their swarm names ('block.3.attn.qkv.weight',
  'embed.tok.weight', 'head.proj.weight': the part key, then the name inside the part);
- `optimizer.safetensors`: the optimizer state of each parameter, '<parameter>.<state>'
  ('block.3.attn.qkv.weight.exp_avg'; AdamW's 'step' counters are 0-d tensors);
- `meta.json`: format, run id, stage, step, the blocks it holds, the model and its options,
  the optimizer settings, a digest of the parameters.

Nothing in it needs swarmtrain to read: `safetensors.torch.load_file` and `json.load` do.
A checkpoint is written into a temporary directory beside its final place, every file and the
directory fsync'd, then renamed into place (and the parent fsync'd): a reader sees a whole
checkpoint or none, whatever kills the writer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from swarmtrain.errors import ConfigError

FORMAT = "swarmtrain-stage-checkpoint/1"
PARAMS_FILE = "params.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def stage_dir(root: Path | str, run_id: str, stage: int) -> Path:
    return Path(root) / run_id / f"stage-{stage}"


def step_dir(root: Path | str, run_id: str, stage: int, step: int) -> Path:
    return stage_dir(root, run_id, stage) / f"step-{step:08d}"


def to_files(state: dict[str, Tensor], param_names: list[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A runner's `export_state()` ('param.NAME', 'opt.I.STATE') as the two files' tensors, named
    by parameter (`param_names[I]` is the I-th parameter's name)."""
    params, optim = {}, {}
    for key, value in state.items():
        if key.startswith("param."):
            params[key.removeprefix("param.")] = value.contiguous()
        else:
            _, index, name = key.split(".", 2)
            optim[f"{param_names[int(index)]}.{name}"] = value.contiguous()
    return params, optim


def from_files(
    params: dict[str, Tensor], optim: dict[str, Tensor], param_names: list[str]
) -> dict[str, Tensor]:
    """The inverse of `to_files`: a state `StageRunner.import_state` takes. ConfigError when the
    files do not hold this stage's parameters."""
    if set(params) != set(param_names):
        missing, extra = sorted(set(param_names) - set(params)), sorted(set(params) - set(param_names))
        raise ConfigError(
            f"the checkpoint does not hold this stage's parameters (missing {missing[:3]}, "
            f"unexpected {extra[:3]}): it belongs to another model or another stage split"
        )
    state = {f"param.{k}": v for k, v in params.items()}
    index = {name: i for i, name in enumerate(param_names)}
    for key, value in optim.items():
        name, _, what = key.rpartition(".")
        if name not in index:
            raise ConfigError(f"the checkpoint's optimizer state {key!r} names no parameter of this stage")
        state[f"opt.{index[name]}.{what}"] = value
    return state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_stage_checkpoint(
    root: Path | str,
    *,
    run_id: str,
    stage: int,
    step: int,
    state: dict[str, Tensor],
    param_names: list[str],
    meta: dict,
) -> tuple[Path, int]:
    """Write one stage checkpoint atomically; returns (its directory, bytes written). An existing
    checkpoint of the same step is left as it is (replicas hold identical state)."""
    final = step_dir(root, run_id, stage, step)
    if final.exists():
        return final, 0
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    params, optim = to_files(state, param_names)
    save_file(params, str(tmp / PARAMS_FILE))
    save_file(optim, str(tmp / OPTIMIZER_FILE))
    body = {"format": FORMAT, "run_id": run_id, "stage": stage, "step": step} | meta
    (tmp / META_FILE).write_text(json.dumps(body, indent=1, sort_keys=True))
    written = 0
    for name in (PARAMS_FILE, OPTIMIZER_FILE, META_FILE):
        _fsync(tmp / name)
        written += (tmp / name).stat().st_size
    _fsync(tmp)
    try:
        tmp.rename(final)
    except OSError:  # another replica on this machine wrote the same step first
        shutil.rmtree(tmp, ignore_errors=True)
        return final, 0
    _fsync(final.parent)
    return final, written


def stage_checkpoint_steps(root: Path | str, run_id: str, stage: int) -> list[int]:
    """The steps of the whole checkpoints of `stage` under `root`, oldest first."""
    where = stage_dir(root, run_id, stage)
    if not where.is_dir():
        return []
    steps = []
    for entry in where.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and (entry / META_FILE).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


@dataclass(frozen=True)
class StageCheckpoint:
    """One stage checkpoint read back: its meta and the tensors of its two files."""

    meta: dict
    params: dict[str, Tensor]
    optim: dict[str, Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def read_stage_checkpoint(root: Path | str, run_id: str, stage: int, step: int) -> StageCheckpoint:
    """ConfigError, naming the directory, if it is missing or not a stage checkpoint."""
    where = step_dir(root, run_id, stage, step)
    try:
        meta = json.loads((where / META_FILE).read_text())
        params = load_file(str(where / PARAMS_FILE))
        optim = load_file(str(where / OPTIMIZER_FILE))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} is not a readable stage checkpoint: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{where / META_FILE} is not a {FORMAT} file")
    return StageCheckpoint(meta=meta, params=params, optim=optim)


def prune_stage_checkpoints(root: Path | str, run_id: str, stage: int, keep: int) -> list[int]:
    """Delete all but the newest `keep` checkpoints of `stage`; returns the steps kept."""
    steps = stage_checkpoint_steps(root, run_id, stage)
    for step in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(root, run_id, stage, step), ignore_errors=True)
    return steps[-keep:] if keep > 0 else steps


def checkpoint_state(checkpoint: StageCheckpoint, param_names: list[str]) -> dict[str, Tensor]:
    """A checkpoint's tensors as the state `StageRunner.import_state` takes."""
    return from_files(checkpoint.params, checkpoint.optim, param_names)


def nbytes(state: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
