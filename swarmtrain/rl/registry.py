"""Task builders by name: where an RL run's task comes from.

A task builder is a function of keyword options that returns a `Task`
(`swarmtrain.rl.tasks`). As with model builders (`swarmtrain.model.registry`), a run names its
task, and a peer builds only code it chose itself. A builder comes from

- the registry: swarmtrain's built-ins ('add', 'sort', 'reverse') and the `register_task`
  calls of the peer's own code;
- an installed package that declares it as an entry point in group 'swarmtrain.tasks'
  (`name = package.module:function`), loaded by name when a run names it;
- an import path 'package.module:function' that the peer allows (`TaskSources.allow`, the
  task counterpart of --allow-model).

Any other name or import path is refused, in one line saying what to pass, before anything
is imported.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from swarmtrain.errors import ConfigError

if TYPE_CHECKING:
    from swarmtrain.rl.tasks import Task

TaskBuilder = Callable[..., "Task"]

ENTRY_POINT_GROUP = "swarmtrain.tasks"
"""Entry point group in which installed packages offer task builders by name."""

_BUILDERS: dict[str, TaskBuilder] = {}
_LOADED: dict[str, TaskBuilder] = {}
"""Builders taken from outside the registry (an entry point, an allowed import path), by the
name or path that reached them; once loaded their module has run, so they stay resolvable."""


@dataclass(frozen=True, kw_only=True)
class TaskSources:
    """Which import paths a peer lets a run name as its task, besides its registry and the
    installed entry points (which it always takes)."""

    allow: tuple[str, ...] = ()
    """Patterns of import paths 'package.module:function' this peer may import and call, in
    fnmatch syntax ('mylab.tasks:*'). Empty: no import path at all."""

    def __post_init__(self):
        if isinstance(self.allow, str):
            raise ConfigError(f"task allow must be a tuple of patterns, got the string {self.allow!r}")
        for pattern in self.allow:
            if not isinstance(pattern, str) or ":" not in pattern:
                raise ConfigError(
                    f"task allow pattern {pattern!r} is not a pattern of import paths: write "
                    "'package.module:function', or a pattern such as 'mylab.tasks:*'"
                )

    def allows(self, path: str) -> bool:
        """Whether import path `path` matches one of the allowed patterns."""
        return any(fnmatchcase(path, pattern) for pattern in self.allow)


def register_task(name: str) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator: register task builder `fn(**options) -> Task` under `name`.

    Registering a different function under a taken name raises ConfigError; the function is
    returned unchanged.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ConfigError(f"task name {name!r} must be a non-empty string without ':'")

    def register(fn: TaskBuilder) -> TaskBuilder:
        known = _BUILDERS.get(name)
        if known is not None and known is not fn:
            raise ConfigError(
                f"task name {name!r} is already registered to {known.__module__}.{known.__name__}"
            )
        _BUILDERS[name] = fn
        return fn

    return register


def _load_builtin_tasks() -> None:
    import swarmtrain.rl.tasks  # noqa: F401  (registers the built-ins; it imports this module)


def registered_tasks() -> list[str]:
    """The registered task names, sorted (installed entry points not included)."""
    _load_builtin_tasks()
    return sorted(_BUILDERS)


def _where_tasks_come_from() -> str:
    installed = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    return (
        f"tasks come from the registry ({', '.join(map(repr, registered_tasks()))}), installed "
        f"entry points in group {ENTRY_POINT_GROUP!r} ({', '.join(map(repr, installed)) or 'none'}), "
        "or import paths 'package.module:function' this peer allows (TaskSources(allow=...))"
    )


def _entry_point_builder(name: str) -> TaskBuilder | None:
    found = list(entry_points(group=ENTRY_POINT_GROUP, name=name))
    if not found:
        return None
    if len({ep.value for ep in found}) > 1:
        raise ConfigError(
            f"task {name!r}: installed packages offer different builders under that name in group "
            f"{ENTRY_POINT_GROUP!r} ({', '.join(sorted(ep.value for ep in found))}); uninstall all but one"
        )
    try:
        return found[0].load()
    except Exception as e:
        raise ConfigError(f"task {name!r}: the entry point {found[0].value!r} failed to load: {e}") from e


def _import_builder(ref: str) -> TaskBuilder:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"task {ref!r}: cannot import module {module_name!r}: {e}") from e
    if not hasattr(module, attr):
        raise ConfigError(f"task {ref!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def resolve_task(ref: str, sources: TaskSources = TaskSources()) -> TaskBuilder:
    """The task builder `ref` names, taken only from where `sources` lets this peer take builders.

    `ref` is a registered name, an installed entry point's name, or an import path
    'package.module:function' that `sources` allows. Raises ConfigError, before importing
    anything, for an unknown name or an import path `sources` does not allow; and for a module
    that fails to import, or an attribute that is missing or not callable.
    """
    _load_builtin_tasks()
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"task must be a name or an import path, got {ref!r}")
    if ref in _BUILDERS:
        return _BUILDERS[ref]
    if ref in _LOADED:
        return _LOADED[ref]
    if ":" not in ref:
        builder = _entry_point_builder(ref)
        if builder is None:
            raise ConfigError(f"unknown task {ref!r}: {_where_tasks_come_from()}")
    else:
        module_name, _, attr = ref.partition(":")
        if not (all(p.isidentifier() for p in module_name.split(".")) and attr.isidentifier()):
            raise ConfigError(f"task {ref!r}: an import path looks like 'package.module:function'")
        if not sources.allows(ref):
            raise ConfigError(
                f"task {ref!r} is an import path this peer does not allow: importing it runs its code "
                f"here, so allow it only if you trust whoever chose it, with TaskSources(allow=({ref!r},)) "
                f"or a pattern such as '{module_name}:*'"
            )
        builder = _import_builder(ref)
    if not callable(builder):
        raise ConfigError(f"task {ref!r} is a {type(builder).__name__}, not a callable task builder")
    _LOADED[ref] = builder
    return builder


def build_task(
    ref: str, options: Mapping[str, Any] | None = None, sources: TaskSources = TaskSources()
) -> Task:
    """Build task `ref` (see `resolve_task`) with keyword `options`.

    Raises ConfigError for a task that does not resolve or is not allowed, options the builder
    does not take, or a builder that does not return a Task.
    """
    from swarmtrain.rl.tasks import Task

    builder = resolve_task(ref, sources)
    options = dict(options or {})
    try:
        inspect.signature(builder).bind(**options)
    except TypeError as e:
        takes = ", ".join(inspect.signature(builder).parameters) or "no options"
        raise ConfigError(
            f"task {ref!r} does not take options {sorted(options)} ({e}); it takes: {takes}"
        ) from None
    task = builder(**options)
    if not isinstance(task, Task):
        raise ConfigError(f"task {ref!r}: the builder returned a {type(task).__name__}, not a Task")
    return task
