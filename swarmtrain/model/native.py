"""A model's weights in its native checkpoint format: safetensors under the names the model's
own library gives them ('transformer.h.3.attn.c_attn.weight'), not swarm names
('block.3.layer.attn.c_attn.weight').

A `SwarmModel` with a native format says how the names correspond (`SwarmModel.native_names`).
With that, a stage reads just its own tensors from a checkpoint folder (safetensors files are
read tensor by tensor, so a stage of a large model never reads the rest), and a trained state
is written back under native names. Nothing here knows a particular library: swarmtrain.model.hf
supplies the names for Hugging Face models and the config and tokenizer files around them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from swarmtrain.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
"""A sharded checkpoint's index: {"weight_map": {tensor name: file name}}."""


class HasParts(Protocol):
    """A `SwarmModel` or a `StageModule`: (part key, module) pairs and the native names of their tensors."""

    native_names: Mapping[str, str] | None

    def parts(self) -> list[tuple[str, nn.Module]]: ...


def _short(names: Iterable[str], limit: int = 8) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """Native tensor name -> the safetensors file in `folder` that holds it.

    Reads `model.safetensors.index.json` if the checkpoint is sharded, else the headers of the
    folder's *.safetensors files (no tensor data). Raises ConfigError if `folder` is not a
    directory, holds no safetensors, or its index names files that are not there.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"checkpoint folder {str(folder)!r} does not exist or is not a directory")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a safetensors index with a 'weight_map': {e}") from None
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise ConfigError(f"{index} names shards that are not in the folder: {_short(absent)}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ConfigError(
            f"checkpoint folder {str(folder)!r} holds no *.safetensors weights (nor {INDEX_FILE})"
        )
    files = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), shard))
    return files


def load_native_weights(
    module: HasParts, folder: str | Path, *, native_names: Mapping[str, str] | None = None
) -> list[str]:
    """Copy the tensors of `module`'s parts from the native checkpoint in `folder`; returns the
    native names read, in reading order.

    `module` is a StageModule or a SwarmModel (anything with `parts()`); its parameters and
    persistent buffers, named '{part key}.{name}', are looked up in `native_names` (default:
    `module.native_names`). Only those tensors are read; each is cast to its parameter's dtype.
    Two parameters may share one native name (an embedding that a tied checkpoint stores once
    serves an untied head too). Raises ConfigError, before changing anything, naming tensors
    the model has no native name for, names the checkpoint lacks, and shape mismatches.
    """
    names = module.native_names if native_names is None else native_names
    if not names:
        raise ConfigError(
            f"{type(module).__name__} has no native names: its builder defines no checkpoint format to load"
        )
    targets: dict[str, list[tuple[str, Tensor]]] = {}  # native name -> (swarm name, tensor) to fill
    unnamed = []
    for key, part in module.parts():
        for name, tensor in part.state_dict().items():
            swarm = f"{key}.{name}"
            if swarm not in names:
                unnamed.append(swarm)
            else:
                targets.setdefault(names[swarm], []).append((swarm, tensor))
    if unnamed:
        raise ConfigError(f"the model gives no native name for {_short(unnamed)}")
    files = checkpoint_files(folder)
    missing = [n for n in targets if n not in files]
    if missing:
        raise ConfigError(f"checkpoint {str(folder)!r} lacks tensors {_short(missing)}")
    by_file: dict[Path, list[str]] = {}
    for native in targets:
        by_file.setdefault(files[native], []).append(native)
    mismatched = []
    for path, natives in by_file.items():
        with safe_open(path, framework="pt") as f:
            for native in natives:
                shape = tuple(f.get_slice(native).get_shape())
                mismatched += [
                    f"{swarm} {tuple(t.shape)} vs {native} {shape}"
                    for swarm, t in targets[native]
                    if tuple(t.shape) != shape
                ]
    if mismatched:
        raise ConfigError(f"checkpoint {str(folder)!r} has other shapes than the model: {_short(mismatched)}")
    read = []
    with torch.no_grad():
        for path, natives in by_file.items():
            with safe_open(path, framework="pt") as f:
                for native in natives:
                    value = f.get_tensor(native)
                    for _, tensor in targets[native]:
                        tensor.copy_(value)
                    read.append(native)
    return read


def save_native_tensors(
    state: Mapping[str, Tensor], native_names: Mapping[str, str], path: str | Path
) -> None:
    """Write `state` {swarm name: tensor} to the safetensors file `path` under native names.

    `state` must hold exactly the tensors `native_names` names, and no two of them may share a
    native name. Raises ConfigError naming what is missing, unknown or doubled.
    """
    missing = [n for n in native_names if n not in state]
    unknown = [n for n in state if n not in native_names]
    if missing or unknown:
        problems = ([f"missing {_short(missing)}"] if missing else []) + (
            [f"unknown {_short(unknown)}"] if unknown else []
        )
        raise ConfigError(f"the state does not fit the model's native names: {'; '.join(problems)}")
    if len(set(native_names.values())) != len(native_names):
        doubled = sorted({n for n in native_names.values() if list(native_names.values()).count(n) > 1})
        raise ConfigError(f"several tensors map to one native name ({_short(doubled)}): untie them first")
    out = {native_names[name]: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(out, str(path), metadata={"format": "pt"})
