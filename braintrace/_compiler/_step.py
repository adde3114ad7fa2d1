"""Tracing one step of a stateful NNX module to a flat jaxpr with named leaves."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex_core
from flax import nnx

from braintrace._compiler._flatten import flatten_jaxpr, walk_eqns
from braintrace._compiler._modules import (
    NO_MODULES,
    ModuleMap,
    eqn_module_paths,
    module_classes,
    module_scopes,
)
from braintrace._hidden import HiddenState
from braintrace._primitives import decomposed_in, silent_fallback

__all__ = ["TracedStep", "split_model", "trace_function_step", "trace_model_step"]


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One model step as a flat jaxpr over ``[*params, *hidden, *other, *x]`` leaves.

    Attributes:
        closed_jaxpr: The flat jaxpr returning ``[*y, *params, *hidden, *other]``.
        graphdef: The model's graph definition (``None`` for a pure function).
        param_paths / hidden_paths / other_paths: Leaf paths (``'layer.kernel'``).
        num_outputs: Number of output leaves.
        out_treedef: Tree structure of the step output.
        notes: What the normalisation pass changed.
        warnings: Warnings raised while tracing (e.g. a vmapped ETP primitive).
        modules: The module each equation was traced in, and the modules' classes.
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
    modules: ModuleMap


def differentiable_hidden(path: Any, node: Any) -> bool:
    """Whether ``node`` is a :class:`HiddenState` with a floating (or complex) value.

    Integer and boolean hidden states (step counters, refractory flags) carry
    no gradient: they are kept with the other, non-differentiable state.
    """
    del path
    return isinstance(node, HiddenState) and jax.numpy.issubdtype(
        jax.numpy.result_type(node.get_value()), jax.numpy.inexact)


def split_model(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State, nnx.State]:
    """``nnx.split`` into Params, differentiable hidden states and everything else."""
    return nnx.split(model, nnx.Param, differentiable_hidden, ...)


def leaf_paths(state: Any, root: str = "") -> tuple[str, ...]:
    """Dotted paths of a state's leaves, in ``jax.tree`` leaf order.

    ``root`` names a leaf that is the whole tree (a bare array).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return tuple(_path_name(path) or root for path, _ in flat)


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
            inside the step. An error raised by the model itself (e.g. a layer's
            input-shape check) propagates with a note naming the example shapes
            and the hidden states.
    """
    graphdef, params, hidden, other = split_model(model)
    param_paths, hidden_paths, other_paths = (leaf_paths(s) for s in (params, hidden, other))
    name = type(model).__name__
    if not hidden_paths:
        others = (f" Its other Variables ({', '.join(repr(p) for p in other_paths)}) are not "
                  "HiddenStates; declare recurrent state as braintrace.HiddenState."
                  if other_paths else "")
        raise ValueError(
            f"{name} has no braintrace.HiddenState, so there is nothing to carry eligibility "
            "traces through time. Keep recurrent state in HiddenState variables (the layers in "
            "braintrace.layers do), or wrap a cell in braintrace.layers.Stateful." + others)
    if not param_paths:
        raise ValueError(f"{name} has no nnx.Param: there is nothing to train.")
    _check_real(name, "hidden state", hidden_paths, hidden)
    _check_real(name, "Param", param_paths, params)

    def step(params, hidden, other, x):
        m = nnx.merge(graphdef, params, hidden, other, copy=True)
        with module_scopes(m):  # each equation records the module it runs in
            y = m(x)
        _, p2, h2, o2 = split_model(m)
        return y, p2, h2, o2

    closed, out_shape, caught_messages = _trace(step, (params, hidden, other, example_x),
                                                name, hidden_paths, hidden)
    y_shape = out_shape[0]
    out_leaves, out_treedef = jax.tree_util.tree_flatten(y_shape)
    n_out = len(out_leaves)
    _check_hidden_out(name, hidden_paths, hidden, out_shape[2])
    traced = _flatten(closed, graphdef, param_paths, hidden_paths, other_paths, n_out,
                      out_treedef, example_x, caught_messages, module_classes(model))
    # After inlining (nnx.jit, nnx.remat pass Params through a call and out again).
    jaxpr = traced.closed_jaxpr.jaxpr
    for k, path in enumerate(param_paths):
        if jaxpr.outvars[n_out + k] is not jaxpr.invars[k]:
            raise ValueError(
                f"{name} writes the Param '{path}' inside its step. Params must stay constant "
                "within a step (the optimiser updates them); keep changing values in a "
                "HiddenState or another nnx.Variable.")
    return traced


def trace_function_step(fn: Callable[..., Any], params: Any, hidden: Any,
                        example_x: Any) -> TracedStep:
    """Traces a pure step ``fn(params, hidden, x) -> (hidden, y)`` to a flat jaxpr.

    Leaf paths come from the pytrees (``{'w': ...}`` gives ``'w'``; a bare
    array is called ``'params'`` / ``'hidden'``).

    Raises:
        ValueError: ``hidden`` or ``params`` has no leaves, or ``fn`` returns
            hidden state of another structure, shape or dtype.
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    param_paths = leaf_paths(params, "params")
    hidden_paths = leaf_paths(hidden, "hidden")
    if not hidden_paths:
        raise ValueError(
            f"{name}: `hidden` has no array leaves, so there is nothing to carry eligibility "
            "traces through time. Pass the recurrent state as `hidden`.")
    if not param_paths:
        raise ValueError(f"{name}: `params` has no array leaves: there is nothing to train.")
    _check_real(name, "hidden state", hidden_paths, hidden)
    _check_real(name, "Param", param_paths, params)

    def step(params, hidden, other, x):
        new_hidden, y = fn(params, hidden, x)
        return y, params, new_hidden, other

    closed, out_shape, caught_messages = _trace(step, (params, hidden, (), example_x), name,
                                                hidden_paths, hidden)
    y_shape, _, new_hidden, _ = out_shape
    expected = jax.tree_util.tree_structure(hidden)
    if jax.tree_util.tree_structure(new_hidden) != expected:
        raise ValueError(
            f"{name} must return (hidden, y) with hidden structured like the `hidden` it "
            f"received ({expected}); got {jax.tree_util.tree_structure(new_hidden)}.")
    _check_hidden_out(name, hidden_paths, hidden, new_hidden)
    out_leaves, out_treedef = jax.tree_util.tree_flatten(y_shape)
    return _flatten(closed, None, param_paths, hidden_paths, (), len(out_leaves), out_treedef,
                    example_x, caught_messages)


def _check_real(name: str, kind: str, paths: tuple[str, ...], tree: Any) -> None:
    """Raises for a complex-valued leaf: traces are kept real (they would lose the imaginary
    part, a silently wrong gradient)."""
    for path, leaf in zip(paths, jax.tree_util.tree_leaves(tree)):
        if jax.numpy.iscomplexobj(leaf):
            raise ValueError(
                f"{name}: {kind} '{path}' is complex ({jax.numpy.result_type(leaf)}); "
                "braintrace keeps eligibility traces real. Store the real and imaginary parts "
                "as two real variables (as braintrace.layers.LRU does with 'h_re' and 'h_im'; "
                "the compiler then traces them as two coupled states per unit).")


def _check_hidden_out(name: str, paths: tuple[str, ...], hidden: Any, new_hidden: Any) -> None:
    """Raises if a step changes the shape or dtype of a hidden state."""
    for path, old, new in zip(paths, jax.tree_util.tree_leaves(hidden),
                              jax.tree_util.tree_leaves(new_hidden)):
        old_shape, old_dtype = tuple(jax.numpy.shape(old)), jax.numpy.result_type(old)
        if (tuple(new.shape), new.dtype) == (old_shape, old_dtype):
            continue
        hint = ""
        if new.shape[1:] == old_shape and new.shape:
            hint = (f" The step broadcast it over a batch of {new.shape[0]}: batch the hidden "
                    f"states first (braintrace.init_states(model, batch_size={new.shape[0]})).")
        raise ValueError(
            f"{name} writes hidden state '{path}' with shape {tuple(new.shape)} and dtype "
            f"{new.dtype}, but it holds shape {old_shape} and dtype {old_dtype}; a step must "
            f"keep each hidden state's shape and dtype.{hint}")


def _trace(step, args, name, hidden_paths, hidden):
    """``make_jaxpr`` of ``step``; re-emits its warnings and annotates its errors."""
    try:
        with warnings.catch_warnings(record=True) as caught, silent_fallback():
            warnings.simplefilter("always")  # the fallback's plain ops: _decomposed
            closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*args)
    except Exception as error:
        x_shapes = [tuple(jax.numpy.shape(a)) for a in jax.tree_util.tree_leaves(args[-1])]
        states = ", ".join(f"'{p}' {tuple(jax.numpy.shape(h))}" for p, h in
                           zip(hidden_paths, jax.tree_util.tree_leaves(hidden)))
        error.add_note(
            f"braintrace.compile_graph: raised while tracing one step of {name} on an example "
            f"input of shape(s) {x_shapes}; hidden states: {states}.")
        raise
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return closed, out_shape, tuple(str(w.message) for w in caught)


def _flatten(closed, graphdef, param_paths, hidden_paths, other_paths, n_out, out_treedef,
             example_x, caught_messages, classes=None) -> TracedStep:
    n_p, n_h = len(param_paths), len(hidden_paths)
    x_leaves = jax.tree_util.tree_leaves(example_x)
    tracked = [True] * (n_p + n_h) + [False] * (len(other_paths) + len(x_leaves))
    names = [*param_paths, *hidden_paths, *other_paths,
             *(f"x[{i}]" for i in range(len(x_leaves)))]
    label = None if classes is None else ModuleMap(classes=classes, eqn_modules=()).label
    flat = flatten_jaxpr(closed, tracked, invar_names=names, module_label=label)
    modules = NO_MODULES if classes is None else ModuleMap(
        classes=classes, eqn_modules=eqn_module_paths(flat.closed_jaxpr.jaxpr))
    decomposed = _decomposed(flat.closed_jaxpr.jaxpr, modules)
    for message in decomposed:
        warnings.warn(message, UserWarning, stacklevel=2)
    return TracedStep(
        closed_jaxpr=flat.closed_jaxpr, graphdef=graphdef, param_paths=param_paths,
        hidden_paths=hidden_paths, other_paths=other_paths, num_outputs=n_out,
        out_treedef=out_treedef, notes=flat.notes,
        warnings=tuple(dict.fromkeys(caught_messages + decomposed)), modules=modules)


def _decomposed(jaxpr: jex_core.Jaxpr, modules: ModuleMap) -> tuple[str, ...]:
    """A warning for each ETP primitive that the step holds as plain ops, decomposed by
    ``vmap`` (:func:`~braintrace._primitives.decomposed_in`): the compiler cannot see it, so
    its weights get no trace. Only here is that true: a ``vmap`` outside a compiled step
    (of ``online_grad`` over stacked states) loses nothing and warns nothing."""
    where: dict[str, str] = {}
    for index, eqn in enumerate(jaxpr.eqns):
        inner = [e for sub in jex_core.jaxprs_in_params(eqn.params) for e in walk_eqns(sub)]
        for name in (n for e in (eqn, *inner) for n in decomposed_in(e.source_info.name_stack)):
            where.setdefault(name, modules.eqn_label(index, ""))
    return tuple(
        f"ETP primitive '{name}' is vmapped{f' in {label}' if label else ''} with no batched "
        "counterpart for these mapped operands, so it is decomposed into plain JAX ops: its "
        "weights drop out of eligibility-trace learning. Register a counterpart with "
        "braintrace.register_batched_counterpart, or map only x."
        for name, label in where.items())
