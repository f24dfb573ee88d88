"""Microbatches: the (inputs, loss inputs) form trainers send, training text (as bytes, or
token ids from a model's tokenizer), and the random-window batches drawn from it.

The default corpus is the source of Python's standard library: it is on every machine that
runs swarmtrain, so a demo swarm needs no download. It is identical across peers only when
they run the same Python version; trainers each draw their own batches, so that is enough.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from swarmtrain.errors import ConfigError

if TYPE_CHECKING:
    from swarmtrain.model import ModelSources
    from swarmtrain.wire.records import RunManifest


def loss_inputs_of(item: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """One microbatch as (inputs, {name: tensor}): the named tensors the run's loss takes.

    A user's batch iterator may yield `(inputs, targets)`, which is `(inputs, {'targets':
    targets})`, or `(inputs, {name: tensor})` for a loss that takes more (e.g. 'targets' and
    'weights'). Raises ConfigError saying what is wrong with any other item. Which names the
    run's loss takes, and their shapes, stage 0 checks.
    """
    form = "each microbatch must be (inputs, targets) or (inputs, {name: tensor})"
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ConfigError(
            f"{form}, got a {type(item).__name__}"
            + (f" of {len(item)}" if isinstance(item, tuple | list) else "")
        )
    x, rest = item
    if not isinstance(x, Tensor):
        raise ConfigError(f"{form}: the inputs are a {type(x).__name__}, not a tensor")
    if isinstance(rest, Tensor):
        return x, {"targets": rest}
    if not isinstance(rest, Mapping):
        raise ConfigError(f"{form}: the second item is a {type(rest).__name__}")
    for name, t in rest.items():
        if not isinstance(name, str):
            raise ConfigError(f"{form}: loss input names must be strings, got {name!r}")
        if not isinstance(t, Tensor):
            raise ConfigError(f"{form}: loss input {name!r} is a {type(t).__name__}, not a tensor")
    return x, dict(rest)


_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def _sorted_files(root: Path, *, suffix: str = "") -> list[Path]:
    """Files under `root` ending in `suffix`, sorted by relative path, skipping test, package and hidden dirs."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if f.endswith(suffix) and not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _concat(files: list[Path], max_bytes: int) -> bytes:
    chunks, size = [], 0
    for path in files:
        if size >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - size]
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)


def stdlib_text(max_bytes: int = 16 * 2**20) -> bytes:
    """The first `max_bytes` of the standard library's .py sources, concatenated in sorted path order."""
    return _concat(_sorted_files(Path(sysconfig.get_paths()["stdlib"]), suffix=".py"), max_bytes)


def _is_text(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" not in f.read(8192)


def load_text(source: str, *, max_bytes: int = 16 * 2**20) -> bytes:
    """Training bytes from `source`: 'stdlib', a text file, or a directory of text files.

    A directory's files (binary ones, holding NUL bytes, skipped) are concatenated in sorted
    path order. At most `max_bytes` are read. Raises ConfigError if `source` does not exist
    or holds no text.
    """
    if source == "stdlib":
        data = stdlib_text(max_bytes)
    else:
        path = Path(source).expanduser()
        if path.is_file():
            data = path.read_bytes()[:max_bytes]
        elif path.is_dir():
            data = _concat([p for p in _sorted_files(path) if _is_text(p)], max_bytes)
        else:
            raise ConfigError(f"text source {source!r} is neither 'stdlib' nor an existing file or directory")
    if not data:
        raise ConfigError(f"text source {source!r} holds no text: point it at a non-empty file or directory")
    return data


class TokenBatches:
    """An endless iterator of (tokens, targets) microbatches of random windows of `data`.

    `data` is bytes (each byte a token, for byte-level models such as tiny-gpt) or a 1-D
    integer tensor of token ids (a tokenizer's output). Each item is two int64 tensors of shape
    (microbatch_size, seq_len); targets are the tokens shifted left by one (the next token).
    Windows start at uniformly random offsets drawn from a torch.Generator seeded with `seed`,
    so the same data, sizes and seed give the same batches.
    """

    def __init__(self, data: bytes | Tensor, *, seq_len: int, microbatch_size: int, seed: int):
        for name, value in (("seq_len", seq_len), ("microbatch_size", microbatch_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(data, Tensor):
            if data.dim() != 1 or data.is_floating_point() or data.is_complex():
                raise ConfigError(f"token ids must be a 1-D integer tensor, got {data.dim()}-D {data.dtype}")
            unit = "tokens"
        else:
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
            unit = "bytes"
        if len(data) < seq_len + 1:
            raise ConfigError(
                f"the text holds {len(data)} {unit}, too few for windows of seq_len + 1 = {seq_len + 1}: "
                "use more text or a shorter seq_len"
            )
        self.data = data  # (N,)
        self.seq_len = seq_len
        self.microbatch_size = microbatch_size
        self._gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)  # (T+1,)

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        B, T = self.microbatch_size, self.seq_len
        starts = torch.randint(0, len(self.data) - T, (B,), generator=self._gen)  # (B,)
        windows = self.data[starts[:, None] + self._offsets[None, :]].long()  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)


def text_batches_for(
    manifest: RunManifest, source: str = "stdlib", *, models: ModelSources | None = None
) -> TokenBatches:
    """Microbatches of `source` text shaped for `manifest`'s model, in the run seed's order.

    Only token models (input: (seq_len,) integer ids) can be fed text; for any other model
    run a trainer from Python over your own data. The text becomes tokens through the model's
    `encode_text` (hf-causal-lm: the tokenizer in its folder), or byte by byte for a model
    without one (tiny-gpt). The manifest's model is built (on the meta device) only from where
    `models` (a `ModelSources`; None: no import path) lets this peer take builders.
    """
    from swarmtrain.model import ModelSources, build_model, resolve_builder

    models = models or ModelSources()
    resolve_builder(manifest.model, models, named_by=f"the manifest of run {manifest.run_id!r}")
    model = build_model(manifest.model, manifest.model_config, device="meta", sources=models)
    if len(model.input_shape) != 1 or model.input_dtype not in (torch.int64, torch.int32):
        raise ConfigError(
            f"model {manifest.model!r} does not take token ids, so `swarmtrain train` cannot feed it text: "
            "run a trainer from Python over your own data (see examples/custom_model.py)"
        )
    text = load_text(source)
    return TokenBatches(
        text if model.encode_text is None else model.encode_text(text),
        seq_len=model.input_shape[0],
        microbatch_size=manifest.batch.microbatch_size,
        seed=manifest.seed,
    )
