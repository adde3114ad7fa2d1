"""A model's graph as Flax last walked it, and a check in microseconds that it is unchanged.

A driver's call reads the model through Flax's walk of its graph (``nnx.split``:
the structure and mode as a graph definition, the Variables in path order),
which costs 0.1–0.3 ms on a small network, more than the rest of the call. A
:class:`GraphSnapshot` records what that walk reads from every node it visits,
as the objects themselves:

* a Module (any ``nnx.Pytree``): its attributes, ``vars(module)`` — names and
  values, its mode flags (``deterministic``, ``use_running_average``) and
  Flax's record of which attributes are data among them;
* a list or dict: its items; a tuple: nothing (it cannot change), only its items'
  own records; any other pytree: its one-level flattening (children and treedef);
* a Variable: its metadata (``Variable.get_metadata``).

:meth:`GraphSnapshot.holds` compares them again, by identity. While it holds,
the walk would find the same graph definition and the same Variable objects in
the same order: a Param added, removed or replaced, a mode switched
(``model.eval()``), a submodule swapped or a Variable's metadata changed all
break it. What the Variables hold is not part of it (values change at every
call; the drivers check their shapes and dtypes, see ``_model_state``). A node
it cannot follow (a graph node type registered outside Flax's ``nnx.Pytree``)
makes a snapshot that never holds, so such a model is walked at every call, as
before.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np
from flax import nnx

__all__ = ["GraphSnapshot"]

_OBJECT, _LIST, _DICT, _PYTREE, _VARIABLE = range(5)
_SCALARS = frozenset((str, int, float, bool, complex, type(None)))
_LEAVES = (type, np.dtype, jax.Array, np.ndarray)
"""Types that are never a pytree node (checked first: the general tests cost more)."""


def _same(values: Any, recorded: tuple[Any, ...]) -> bool:
    """Whether ``values`` are the ``recorded`` objects, in order."""
    return len(values) == len(recorded) and all(map(operator.is_, values, recorded))


def _one_level(node: Any) -> tuple[list[Any], Any]:
    return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)


class GraphSnapshot:
    """What Flax's walk of a model's graph reads, recorded to be compared by identity.

    Example:
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), layers.LIF(3))
        >>> snapshot = GraphSnapshot.of(model)
        >>> snapshot.holds()
        True
        >>> model.layers[0].kernel = nnx.Param(model.layers[0].kernel[...])  # replaced
        >>> snapshot.holds()
        False
    """

    def __init__(self, records: list[tuple[int, Any, tuple[Any, ...], tuple[Any, ...]]],
                 followed: bool):
        self._records = records
        self._followed = followed

    @classmethod
    def of(cls, model: Any) -> GraphSnapshot:
        """The snapshot of ``model``'s graph as it is now."""
        records: list[tuple[int, Any, tuple[Any, ...], tuple[Any, ...]]] = []
        followed = _record(model, records, set())
        return cls(records, followed)

    def holds(self) -> bool:
        """Whether every node still has what was recorded (module docstring)."""
        if not self._followed:
            return False
        for kind, node, keys, values in self._records:
            if kind == _OBJECT or kind == _DICT:
                if not (_same(node, keys) and _same(node.values(), values)):
                    return False
            elif kind == _LIST:
                if not _same(node, values):
                    return False
            elif kind == _VARIABLE:
                metadata = node.get_metadata()
                if not (_same(metadata, keys) and _same(metadata.values(), values)):
                    return False
            else:
                children, treedef = _one_level(node)
                if treedef != keys[0] or not _same(children, values):
                    return False
        return True


def _record(node: Any, records: list[Any], seen: set[int]) -> bool:
    """Records ``node`` and everything below it; ``False`` where a node cannot be followed."""
    if type(node) in _SCALARS or id(node) in seen:
        return True
    if isinstance(node, nnx.Variable):
        seen.add(id(node))
        metadata = node.get_metadata()
        records.append((_VARIABLE, node, tuple(metadata), tuple(metadata.values())))
        return True
    if isinstance(node, nnx.Pytree):
        seen.add(id(node))
        attributes = vars(node)  # the live dict: compared in place
        records.append((_OBJECT, attributes, tuple(attributes), tuple(attributes.values())))
        children: Any = attributes.values()
    elif nnx.graph.is_graph_node(node):
        return False  # a graph node type of its own: its flattening is not known here
    elif type(node) is list:
        seen.add(id(node))
        records.append((_LIST, node, (), tuple(node)))
        children = node
    elif type(node) is dict:
        seen.add(id(node))
        records.append((_DICT, node, tuple(node), tuple(node.values())))
        children = node.values()
    elif isinstance(node, tuple):
        children = node
    elif isinstance(node, _LEAVES) or not _is_pytree(node):
        return True
    else:
        seen.add(id(node))
        children, treedef = _one_level(node)
        records.append((_PYTREE, node, (treedef,), tuple(children)))
    return all(_record(child, records, seen) for child in children)


def _is_pytree(node: Any) -> bool:
    """Whether ``node`` is a JAX pytree node (a container), not a leaf."""
    return not jax.tree_util.treedef_is_leaf(jax.tree.structure(node))
