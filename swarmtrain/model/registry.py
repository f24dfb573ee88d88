"""Model builders by name: the registry a run manifest's `model` field resolves through.

A builder is a function of keyword options that returns a `SwarmModel`. A run's manifest
names it, and the manifest comes from the DHT, where anyone can write: so a peer builds only
code it chose itself. A builder comes from

- the registry: swarmtrain's built-ins ('tiny-gpt', 'hf-causal-lm') and the
  `register_builder` calls of the peer's own code;
- an installed package that declares it as an entry point in group 'swarmtrain.models'
  (`name = package.module:function`), loaded by name when a run names it;
- an import path 'package.module:function' that the peer allows (`ModelSources.allow`,
  `--allow-model PATTERN`). The run's owner allows its own model by choosing it.

Any other name or import path is refused before anything is imported.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from importlib.metadata import entry_points
from typing import Any

import torch

from swarmtrain.errors import ConfigError, UnknownModelError
from swarmtrain.model.swarm_model import SwarmModel

Builder = Callable[..., SwarmModel]

ENTRY_POINT_GROUP = "swarmtrain.models"
"""Entry point group in which installed packages offer builders by name."""

_BUILDERS: dict[str, Builder] = {}
_LOADED: dict[str, Builder] = {}
"""Builders this process took from outside its registry (an entry point, an allowed import
path), by the name or path that reached them. One stays resolvable once loaded: its module has
run, so refusing it later would protect nothing."""


@dataclass(frozen=True, kw_only=True)
class ModelSources:
    """Which import paths a peer lets a run name as its model, besides its registry and the
    installed entry points (which it always takes)."""

    allow: tuple[str, ...] = ()
    """Patterns of import paths 'package.module:function' this peer may import and call, in
    fnmatch syntax ('mylab.models:*'); --allow-model. Empty: no import path at all."""

    def __post_init__(self):
        if isinstance(self.allow, str):
            raise ConfigError(f"allow must be a tuple of patterns, got the string {self.allow!r}")
        for pattern in self.allow:
            if not isinstance(pattern, str) or ":" not in pattern:
                raise ConfigError(
                    f"--allow-model {pattern!r} is not a pattern of import paths: write "
                    "'package.module:function', or a pattern such as 'mylab.models:*'"
                )

    def allows(self, path: str) -> bool:
        """Whether import path `path` matches one of the allowed patterns."""
        return any(fnmatchcase(path, pattern) for pattern in self.allow)

    def allowing(self, ref: str) -> ModelSources:
        """These sources plus model `ref` itself, if it is an import path: for the process whose
        owner chose `ref` (the coordinator given --model). A valid import path holds no pattern
        characters (`resolve_builder` checks its form before matching), so it allows only itself."""
        return ModelSources(allow=(*self.allow, ref)) if ":" in ref else self


NO_IMPORTS = ModelSources()
"""The registry and installed entry points only: no import path is imported."""


def register_builder(name: str) -> Callable[[Builder], Builder]:
    """Decorator: register a builder under `name`. Registering a different function twice raises."""

    def register(fn: Builder) -> Builder:
        known = _BUILDERS.get(name)
        if known is not None and known is not fn:
            raise ConfigError(
                f"model name {name!r} is already registered to {known.__module__}.{known.__name__}"
            )
        _BUILDERS[name] = fn
        return fn

    return register


def _load_builtin_builders() -> None:
    # Imported here, not at the top: gpt.py and hf.py import this module to register themselves.
    # hf.py imports transformers only when a model is built.
    import swarmtrain.model.gpt  # noqa: F401
    import swarmtrain.model.hf  # noqa: F401


def registered_models() -> list[str]:
    """The registered builder names, sorted (not the installed entry points: `installed_models`)."""
    _load_builtin_builders()
    return sorted(_BUILDERS)


def installed_models() -> list[str]:
    """Names of the builders installed packages offer (entry points in group 'swarmtrain.models'),
    sorted; reading them imports nothing."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names) if names else "none"


def _where_builders_come_from() -> str:
    return (
        f"builders come from swarmtrain's registry ({_names(registered_models())}), installed "
        f"packages' entry points in group {ENTRY_POINT_GROUP!r} ({_names(installed_models())}), "
        "or import paths 'package.module:function' this peer allows with --allow-model PATTERN"
    )


def _check_import_path(ref: str) -> tuple[str, str]:
    module_name, _, attr = ref.partition(":")
    if not (all(part.isidentifier() for part in module_name.split(".")) and attr.isidentifier()):
        raise UnknownModelError(
            f"model {ref!r}: an import path looks like 'package.module:function' (Python identifiers)"
        )
    return module_name, attr


def _from_entry_point(name: str) -> Builder | None:
    found = list(entry_points(group=ENTRY_POINT_GROUP, name=name))
    if not found:
        return None
    if len({ep.value for ep in found}) > 1:
        offers = "; ".join(f"{ep.value} ({ep.dist.name if ep.dist else 'unknown package'})" for ep in found)
        raise UnknownModelError(
            f"model {name!r}: installed packages offer different builders under that name in group "
            f"{ENTRY_POINT_GROUP!r}: {offers}; uninstall all but one"
        )
    ep = found[0]
    package = ep.dist.name if ep.dist else "an installed package"
    try:
        builder = ep.load()
    except Exception as e:
        raise UnknownModelError(
            f"model {name!r}: the entry point {ep.value!r} of {package} failed to load: {e}"
        ) from e
    if not callable(builder):
        raise UnknownModelError(
            f"model {name!r}: the entry point {ep.value!r} of {package} is a {type(builder).__name__}, "
            "not a callable builder"
        )
    return builder


def _import_builder(ref: str, module_name: str, attr: str) -> Builder:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UnknownModelError(f"model {ref!r}: cannot import module {module_name!r}: {e}") from e
    if not hasattr(module, attr):
        raise UnknownModelError(f"model {ref!r}: module {module_name!r} has no attribute {attr!r}")
    builder = getattr(module, attr)
    if not callable(builder):
        raise UnknownModelError(
            f"model {ref!r}: {module_name}.{attr} is a {type(builder).__name__}, not a callable builder"
        )
    return builder


def resolve_builder(ref: str, sources: ModelSources = NO_IMPORTS, *, named_by: str = "") -> Builder:
    """The builder `ref` names, taken only from where `sources` lets this peer take builders.

    `ref` is a registered name, an installed entry point's name, or an import path
    'package.module:function' that `sources` allows (or that this process loaded before).
    `named_by` says who chose `ref`, for the refusal ("the manifest of run 'demo'"). Raises
    UnknownModelError, before importing anything, for an unknown name or an import path that
    `sources` does not allow; and for a module that fails to import, an attribute that is
    missing or not callable, or an entry point that fails to load.
    """
    _load_builtin_builders()
    if ref in _BUILDERS:
        return _BUILDERS[ref]
    if ref in _LOADED:
        return _LOADED[ref]
    if ":" not in ref:
        builder = _from_entry_point(ref)
        if builder is None:
            raise UnknownModelError(f"unknown model {ref!r}: {_where_builders_come_from()}")
    else:
        module_name, attr = _check_import_path(ref)
        if not sources.allows(ref):
            head = (
                f"{named_by} names the import path {ref!r}, which"
                if named_by
                else f"model {ref!r} is an import path"
            )
            raise UnknownModelError(
                f"{head} this peer does not allow: importing "
                f"it runs its code here, so allow it only if you trust whoever chose it (for a run, "
                f"its owner), with --allow-model {ref!r} or a pattern such as --allow-model "
                f"'{module_name}:*' (from Python: ModelSources(allow=...)); {_where_builders_come_from()}"
            )
        builder = _import_builder(ref, module_name, attr)
    _LOADED[ref] = builder
    return builder


def _check_options(ref: str, builder: Builder, config: Mapping[str, Any]) -> bool:
    """Raise ConfigError if `config` does not fit the builder's signature.

    Returns False when the signature cannot tell (it takes **kwargs), True when it checked.
    """
    sig = inspect.signature(builder)
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return False
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in config:
        if key not in takes:
            raise ConfigError(
                f"model {ref!r} does not take option {key!r}; it takes: {', '.join(takes) or 'no options'}"
            )
    try:
        sig.bind(**config)
    except TypeError as e:
        raise ConfigError(f"model {ref!r}: {e}") from None
    return True


def build_model(
    ref: str,
    config: Mapping[str, Any],
    *,
    device: str | torch.device = "meta",
    sources: ModelSources = NO_IMPORTS,
) -> SwarmModel:
    """Build model `ref` with keyword options `config`, constructing its tensors on `device`.

    The default, the meta device, costs no memory or time: stages materialise only the parts
    they hold. `ref` resolves as in `resolve_builder` under `sources`. Raises UnknownModelError
    if `ref` does not resolve or is not allowed, ConfigError for options the builder does not
    take or rejects, or if the builder does not return a SwarmModel.
    """
    builder = resolve_builder(ref, sources)
    if not isinstance(config, Mapping):
        raise ConfigError(f"model {ref!r}: options must be a mapping, got {type(config).__name__}")
    checked = _check_options(ref, builder, config)
    try:
        with torch.device(device):
            model = builder(**config)
    except TypeError as e:
        if checked:
            raise
        # A **kwargs builder that cannot say what it takes: its TypeError is our best message.
        raise ConfigError(f"model {ref!r} rejected its options: {e}") from e
    if not isinstance(model, SwarmModel):
        raise ConfigError(f"model {ref!r}: the builder returned a {type(model).__name__}, not a SwarmModel")
    return model
