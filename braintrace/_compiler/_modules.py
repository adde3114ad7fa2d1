"""Module terms for reports: which module of the model each equation and leaf belongs to.

While :func:`~braintrace.compile_graph` traces one step, every module of the
traced copy of the model runs its ``__call__`` inside ``jax.named_scope``
(:func:`module_scopes`), so each equation of the step's jaxpr carries the path
of the innermost module that was running (``rnn.cell.norm``). A
:class:`ModuleMap` holds those paths and each module's class, and names a
module, a Param or a state for a person: ``` `rnn.cell.norm` (nnx.LayerNorm)```.

The class swap is done on the traced copy only (``nnx.merge(..., copy=True)``),
never on the user's model, and the copy's classes are restored afterwards.

Example:
    >>> from braintrace._compiler._modules import ModuleMap
    >>> modules = ModuleMap(classes={"": "Net", "rnn": "RecurrentSpiking",
    ...                              "rnn.neuron": "LIF"}, eqn_modules=())
    >>> modules.module_of("rnn.neuron.v")
    'rnn.neuron'
    >>> modules.label("rnn.neuron")
    '`rnn.neuron` (LIF)'
    >>> modules.leaf_label("rnn.kernel")
    '`rnn.kernel` (a Param of `rnn` (RecurrentSpiking))'
    >>> ModuleMap(classes={"": "Net", "lstm": "OptimizedLSTMCell",
    ...                    "lstm.dense_h": "_PromotingLinear"}, eqn_modules=()).label("lstm.dense_h")
    '`lstm.dense_h` (in `lstm` (OptimizedLSTMCell))'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.extend.core as jex_core
from flax import nnx

__all__ = ["ModuleMap", "class_label", "eqn_module_paths", "module_classes", "module_scopes"]

SCOPE_PREFIX = "module:"
_PATHS: contextvars.ContextVar[Mapping[int, str]] = contextvars.ContextVar(
    "braintrace_module_paths", default=MappingProxyType({}))
_SCOPED: dict[type, type | None] = {}


def class_label(cls: type) -> str:
    """``'nnx.LayerNorm'`` for a Flax NNX class, the bare class name otherwise."""
    module = getattr(cls, "__module__", "") or ""
    return f"nnx.{cls.__name__}" if module.startswith("flax.") else cls.__name__


def _is_private(class_label: str) -> bool:
    """Whether a class label names a private class (``_PromotingLinear``, ``nnx._Cell``)."""
    return class_label.rsplit(".", 1)[-1].startswith("_")


def _path_name(path: Iterable[Any]) -> str:
    return ".".join(str(part) for part in path)


def _modules(root: nnx.Module) -> list[tuple[str, nnx.Module]]:
    return [(_path_name(path), node) for path, node in nnx.iter_graph(root)
            if isinstance(node, nnx.Module)]


def module_classes(root: nnx.Module) -> dict[str, str]:
    """``{module path: class label}`` of every module of ``root`` (``''`` is the root)."""
    return {path: class_label(type(node)) for path, node in _modules(root)}


def _scoped_class(cls: type) -> type | None:
    """A subclass of ``cls`` whose ``__call__`` runs in a named scope of the module's path
    (``None`` for a class that cannot be subclassed: its equations keep the enclosing scope)."""
    if cls not in _SCOPED:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            path = _PATHS.get().get(id(self))
            call = super(scoped, self).__call__
            if path is None:
                return call(*args, **kwargs)
            with jax.named_scope(SCOPE_PREFIX + path):
                return call(*args, **kwargs)

        try:
            scoped = type(cls.__name__, (cls,), {"__call__": __call__,
                                                 "__qualname__": cls.__qualname__,
                                                 "__module__": cls.__module__})
        except TypeError:  # a final class, or one whose subclasses need arguments
            scoped = None
        _SCOPED[cls] = scoped
    return _SCOPED[cls]


@contextlib.contextmanager
def module_scopes(root: nnx.Module) -> Iterator[None]:
    """Runs every module of ``root`` (a private copy) in a named scope of its path.

    ``root``'s modules get a subclass of their own class for the duration
    (same name, same behaviour, ``__call__`` wrapped in ``jax.named_scope``);
    their classes are restored on exit.
    """
    nodes = [(path, node) for path, node in _modules(root)
             if callable(node) and _scoped_class(type(node)) is not None]
    token = _PATHS.set({id(node): path for path, node in nodes})
    originals = [(node, type(node)) for _, node in nodes]
    try:
        for node, cls in originals:
            object.__setattr__(node, "__class__", _scoped_class(cls))
        yield
    finally:
        for node, cls in originals:
            object.__setattr__(node, "__class__", cls)
        _PATHS.reset(token)


def eqn_module_paths(jaxpr: jex_core.Jaxpr) -> tuple[str | None, ...]:
    """Per equation, the path of the innermost module scope it was traced in (or ``None``)."""
    out = []
    for eqn in jaxpr.eqns:
        scopes = [s[len(SCOPE_PREFIX):] for s in str(eqn.source_info.name_stack).split("/")
                  if s.startswith(SCOPE_PREFIX)]
        out.append(scopes[-1] if scopes else None)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ModuleMap:
    """The model's modules as a report names them.

    Attributes:
        classes: ``{module path: class label}`` (``''`` is the model itself);
            empty for a pure step function.
        eqn_modules: Per equation of the flat step, the module path it was
            traced in (``None`` outside every module, or for a pure function).
    """

    classes: Mapping[str, str]
    eqn_modules: tuple[str | None, ...]

    def label(self, module: str) -> str:
        """``'`rnn.cell` (GRUCell)'``; the root is ``'the model (Net)'``.

        A module of a private class (``_PromotingLinear``, a library's implementation
        detail) is named by its path and the nearest enclosing module of a public
        class: ``'`rnn.cell.dense_h` (in `rnn.cell` (OptimizedLSTMCell))'``.
        """
        cls = self.classes.get(module)
        if cls and _is_private(cls):
            owner = self._public_owner(module)
            if module == "":
                return "the model"
            return f"`{module}`" if owner is None else f"`{module}` (in {self.label(owner)})"
        if module == "":
            return f"the model ({cls})" if cls else "the model"
        return f"`{module}` ({cls})" if cls else f"`{module}`"

    def _public_owner(self, module: str) -> str | None:
        """The nearest module enclosing ``module`` whose class is public (``None``: none)."""
        parts = module.split(".") if module else []
        for end in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:end])
            cls = self.classes.get(prefix)
            if cls and not _is_private(cls):
                return prefix
        return None

    def module_of(self, leaf_path: str) -> str | None:
        """The innermost module holding a Param or state path (``None`` without modules)."""
        parts = leaf_path.split(".")
        for end in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.classes:
                return prefix
        return None

    def leaf_label(self, leaf_path: str) -> str:
        """``'`lru2.C_im` (a Param of `lru2` (LRU))'``: a leaf and the module holding it."""
        module = self.module_of(leaf_path)
        if module is None:
            return f"`{leaf_path}`"
        return f"`{leaf_path}` (a Param of {self.label(module)})"

    def eqn_module(self, eqn_index: int) -> str | None:
        """The module path equation ``eqn_index`` was traced in."""
        if eqn_index < len(self.eqn_modules):
            return self.eqn_modules[eqn_index]
        return None

    def eqn_label(self, eqn_index: int, fallback: str) -> str:
        """The label of the module an equation was traced in, or ``fallback``."""
        module = self.eqn_module(eqn_index)
        return fallback if module is None else self.label(module)


NO_MODULES = ModuleMap(classes={}, eqn_modules=())
"""The module map of a pure step function: no modules."""
