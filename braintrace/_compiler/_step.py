"""Tracing one step of a stateful NNX module to a flat jaxpr with named leaves."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.extend.core as jex_core
from flax import nnx

from braintrace._compiler._flatten import flatten_jaxpr
from braintrace._hidden import HiddenState

__all__ = ["TracedStep", "split_model", "trace_model_step"]


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One model step as a flat jaxpr over ``[*params, *hidden, *other, *x]`` leaves.

    Attributes:
        closed_jaxpr: The flat jaxpr returning ``[*y, *params, *hidden, *other]``.
        graphdef: The model's graph definition.
        param_paths / hidden_paths / other_paths: Leaf paths (``'layer.kernel'``).
        num_outputs: Number of output leaves.
        out_treedef: Tree structure of the step output.
        notes: What the normalisation pass changed.
        warnings: Warnings raised while tracing (e.g. a vmapped ETP primitive).
    """

    closed_jaxpr: jex_core.ClosedJaxpr
    graphdef: Any
    param_paths: tuple[str, ...]
    hidden_paths: tuple[str, ...]
    other_paths: tuple[str, ...]
    num_outputs: int
    out_treedef: Any
    notes: tuple[str, ...]
    warnings: tuple[str, ...]


def split_model(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State, nnx.State]:
    """``nnx.split(model, nnx.Param, HiddenState, ...)``."""
    return nnx.split(model, nnx.Param, HiddenState, ...)


def leaf_paths(state: nnx.State) -> tuple[str, ...]:
    """Dotted paths of a state's leaves, in ``jax.tree`` leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return tuple(_path_name(path) for path, _ in flat)


def _path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value":
            continue
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        parts.append(str(name))
    return ".".join(parts)


def trace_model_step(model: nnx.Module, example_x: Any) -> TracedStep:
    """Traces ``model(example_x)`` (one time step) to a flat jaxpr.

    Raises:
        ValueError: The model has no HiddenState or no Param, or writes a Param
            inside the step.
    """
    graphdef, params, hidden, other = split_model(model)
    param_paths, hidden_paths, other_paths = (leaf_paths(s) for s in (params, hidden, other))
    name = type(model).__name__
    if not hidden_paths:
        raise ValueError(
            f"{name} has no braintrace.HiddenState, so there is nothing to carry eligibility "
            "traces through time. Keep recurrent state in HiddenState variables (the layers in "
            "braintrace.layers do), or wrap a cell in a stateful layer.")
    if not param_paths:
        raise ValueError(f"{name} has no nnx.Param: there is nothing to train.")

    def step(params, hidden, other, x):
        m = nnx.merge(graphdef, params, hidden, other, copy=True)
        y = m(x)
        _, p2, h2, o2 = split_model(m)
        return y, p2, h2, o2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        closed, out_shape = jax.make_jaxpr(step, return_shape=True)(params, hidden, other,
                                                                     example_x)
    caught_messages = tuple(str(w.message) for w in caught)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    y_shape = out_shape[0]
    out_leaves, out_treedef = jax.tree_util.tree_flatten(y_shape)
    n_out, n_p = len(out_leaves), len(param_paths)
    jaxpr = closed.jaxpr
    for k, path in enumerate(param_paths):
        if jaxpr.outvars[n_out + k] is not jaxpr.invars[k]:
            raise ValueError(
                f"{name} writes the Param '{path}' inside its step. Params must stay constant "
                "within a step (the optimiser updates them); keep changing values in a "
                "HiddenState or another nnx.Variable.")
    n_h = len(hidden_paths)
    x_leaves = jax.tree_util.tree_leaves(example_x)
    tracked = [True] * (n_p + n_h) + [False] * (len(other_paths) + len(x_leaves))
    names = [*param_paths, *hidden_paths, *other_paths,
             *(f"x[{i}]" for i in range(len(x_leaves)))]
    flat = flatten_jaxpr(closed, tracked, invar_names=names)
    return TracedStep(
        closed_jaxpr=flat.closed_jaxpr, graphdef=graphdef, param_paths=param_paths,
        hidden_paths=hidden_paths, other_paths=other_paths, num_outputs=n_out,
        out_treedef=out_treedef, notes=flat.notes, warnings=caught_messages)
