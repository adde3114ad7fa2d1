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
before. Any other attribute value is one object to it: one changed in place (a
mutable configuration object whose fields are reassigned) is not seen, where
the walk would compare it by equality; Flax needs such static values hashable,
so keep them immutable (replace them to change them).
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np
from flax import nnx

__all__ = ["GraphSnapshot"]

_SCALARS = frozenset((str, int, float, bool, complex, type(None)))
_LEAVES = (type, np.dtype, jax.Array, np.ndarray)
"""Types that are never a pytree node (checked first: the general tests cost more)."""


def _one_level(node: Any) -> tuple[list[Any], Any]:
    return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)


class GraphSnapshot:
    """What Flax's walk of a model's graph reads, recorded to be compared by identity.

    Attributes:
        mappings: Each Module's ``vars`` and each dict (the live objects), with their keys
            and values as recorded.
        lists: Each list, with its items.
        variables: Each Variable, with its metadata's keys and values.
        pytrees: Each other pytree node, with its treedef and children (one level).
        followed: Whether every node could be followed (if not, the snapshot never holds).

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

    def __init__(self) -> None:
        self.mappings: list[tuple[dict[Any, Any], tuple[Any, ...], tuple[Any, ...]]] = []
        self.lists: list[tuple[list[Any], tuple[Any, ...]]] = []
        self.variables: list[tuple[nnx.Variable, tuple[Any, ...], tuple[Any, ...]]] = []
        self.pytrees: list[tuple[Any, Any, tuple[Any, ...]]] = []
        self.followed = True

    @classmethod
    def of(cls, model: Any) -> GraphSnapshot:
        """The snapshot of ``model``'s graph as it is now."""
        snapshot = cls()
        snapshot.followed = snapshot._record(model, set())
        return snapshot

    def holds(self) -> bool:
        """Whether every node still has what was recorded (module docstring)."""
        if not self.followed:
            return False
        same = _same
        for mapping, keys, values in self.mappings:
            if not (same(mapping, keys) and same(mapping.values(), values)):
                return False
        for items, values in self.lists:
            if not same(items, values):
                return False
        for variable, keys, values in self.variables:
            metadata = variable.get_metadata()
            if not (same(metadata, keys) and same(metadata.values(), values)):
                return False
        for node, treedef, values in self.pytrees:
            children, now = _one_level(node)
            if now != treedef or not same(children, values):
                return False
        return True

    def _record(self, node: Any, seen: set[int]) -> bool:
        """Records ``node`` and everything below it; ``False`` where a node cannot be
        followed."""
        if type(node) in _SCALARS or id(node) in seen:
            return True
        if isinstance(node, nnx.Variable):
            seen.add(id(node))
            metadata = node.get_metadata()
            self.variables.append((node, tuple(metadata), tuple(metadata.values())))
            return True
        if isinstance(node, nnx.Pytree):
            seen.add(id(node))
            attributes = vars(node)  # the live dict: compared in place
            self.mappings.append((attributes, tuple(attributes), tuple(attributes.values())))
            children: Any = attributes.values()
        elif nnx.graph.is_graph_node(node):
            return False  # a graph node type of its own: its flattening is not known here
        elif type(node) is list:
            seen.add(id(node))
            self.lists.append((node, tuple(node)))
            children = node
        elif type(node) is dict:
            seen.add(id(node))
            self.mappings.append((node, tuple(node), tuple(node.values())))
            children = node.values()
        elif isinstance(node, tuple):
            children = node
        elif isinstance(node, _LEAVES) or not _is_pytree(node):
            return True
        else:
            seen.add(id(node))
            children, treedef = _one_level(node)
            self.pytrees.append((node, treedef, tuple(children)))
        return all(self._record(child, seen) for child in children)


def _same(values: Any, recorded: tuple[Any, ...]) -> bool:
    """Whether ``values`` are the ``recorded`` objects, in order."""
    return len(values) == len(recorded) and all(map(operator.is_, values, recorded))


def _is_pytree(node: Any) -> bool:
    """Whether ``node`` is a JAX pytree node (a container), not a leaf."""
    return not jax.tree_util.treedef_is_leaf(jax.tree.structure(node))
