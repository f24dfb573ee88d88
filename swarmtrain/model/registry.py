"""Model builders by name: the registry a run manifest's `model` field resolves through.

A builder is a function of keyword options that returns a `SwarmModel`. It is referred to by a
registered name ('tiny-gpt') or by an import path ('package.module:function'), so a run can use
a model that ships outside swarmtrain as long as every peer can import it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from swarmtrain.errors import ConfigError, UnknownModelError
from swarmtrain.model.swarm_model import SwarmModel

Builder = Callable[..., SwarmModel]

_BUILDERS: dict[str, Builder] = {}


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
    # Imported here, not at the top: gpt.py imports this module to register itself.
    import swarmtrain.model.gpt  # noqa: F401


def registered_models() -> list[str]:
    """The registered builder names, sorted."""
    _load_builtin_builders()
    return sorted(_BUILDERS)


def resolve_builder(ref: str) -> Builder:
    """The builder `ref` names: a registered name or an import path 'package.module:function'.

    Raises UnknownModelError saying what did not resolve: an unregistered name, a module that
    fails to import, or an attribute that is missing or not callable.
    """
    if ":" not in ref:
        names = registered_models()
        if ref in _BUILDERS:
            return _BUILDERS[ref]
        raise UnknownModelError(
            f"unknown model {ref!r}: registered models are {', '.join(repr(n) for n in names)}; "
            "or give an import path 'package.module:function' to a builder that returns a SwarmModel"
        )
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UnknownModelError(f"model {ref!r}: an import path looks like 'package.module:function'")
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


def build_model(ref: str, config: Mapping[str, Any], *, device: str | torch.device = "meta") -> SwarmModel:
    """Build model `ref` with keyword options `config`, constructing its tensors on `device`.

    The default, the meta device, costs no memory or time: stages materialise only the parts
    they hold. Raises UnknownModelError if `ref` does not resolve, ConfigError for options the
    builder does not take or rejects, or if the builder does not return a SwarmModel.
    """
    builder = resolve_builder(ref)
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
