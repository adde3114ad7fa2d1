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

:meth:`GraphSnapshot.holds` compares them again (names by equality, everything
else by identity, but a Variable's metadata by equality, as the graph definition
compares it). While it holds, the walk would find the same graph
definition and the same Variable objects in the same order: a Param added,
removed or replaced, an attribute renamed, a mode switched (``model.eval()``),
a submodule swapped or a Variable's metadata changed all break it. What the Variables hold is not part of it (values change at every
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
from itertools import chain
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

    :meth:`holds` compares everything in a few passes that run in C (``map``,
    ``itertools.chain``), not a Python loop over nodes: every dict's and
    list's size, then every key (by equality, as a dict looks it up), value
    and item (by identity) against the flat records, in order (sizes first, so
    that nothing can move from one node to another unseen), then every
    Variable's metadata (one comparison of the lists of their dicts, by equality).

    Attributes:
        mappings: Each Module's ``vars`` and each dict (the live objects).
        lists: Each list.
        variables: Each Variable (its metadata is compared: ``Variable.get_metadata``).
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
        self.mappings: list[dict[Any, Any]] = []
        self.lists: list[list[Any]] = []
        self.variables: list[nnx.Variable] = []
        self.pytrees: list[tuple[Any, Any, tuple[Any, ...]]] = []
        self.followed = True
        self._sizes: tuple[int, ...] = ()
        self._keys: tuple[Any, ...] = ()
        self._values: tuple[Any, ...] = ()
        self._items: tuple[Any, ...] = ()
        self._metadata: list[dict[str, Any]] = []

    @classmethod
    def of(cls, model: Any) -> GraphSnapshot:
        """The snapshot of ``model``'s graph as it is now."""
        snapshot = cls()
        snapshot.followed = snapshot._record(model, set())
        mappings = snapshot.mappings
        snapshot._sizes = snapshot._sizes_now()
        snapshot._keys = tuple(chain.from_iterable(mappings))
        snapshot._values = tuple(chain.from_iterable(map(dict.values, mappings)))
        snapshot._items = tuple(chain.from_iterable(snapshot.lists))
        snapshot._metadata = [*map(_metadata, snapshot.variables)]
        return snapshot

    def holds(self) -> bool:
        """Whether every node still has what was recorded (module docstring)."""
        if not self.followed:
            return False
        mappings = self.mappings
        if self._sizes_now() != self._sizes:
            return False
        if not (tuple(chain.from_iterable(mappings)) == self._keys  # keys: equal is the same
                and _same(chain.from_iterable(map(dict.values, mappings)), self._values)
                and _same(chain.from_iterable(self.lists), self._items)
                and _equal(self._metadata, [*map(_metadata, self.variables)])):
            return False
        for node, treedef, values in self.pytrees:
            children, now = _one_level(node)
            if now != treedef or len(children) != len(values) or not _same(children, values):
                return False
        return True

    def _sizes_now(self) -> tuple[int, ...]:
        """The size of each recorded dict and list as it is now."""
        return (*map(len, self.mappings), *map(len, self.lists))

    def _record(self, node: Any, seen: set[int]) -> bool:
        """Records ``node`` and everything below it; ``False`` where a node cannot be
        followed."""
        if type(node) in _SCALARS or id(node) in seen:
            return True
        if isinstance(node, nnx.Variable):
            seen.add(id(node))
            self.variables.append(node)
            return True
        if isinstance(node, nnx.Pytree):
            seen.add(id(node))
            attributes = vars(node)  # the live dict: compared in place
            self.mappings.append(attributes)
            children: Any = attributes.values()
        elif nnx.graph.is_graph_node(node):
            return False  # a graph node type of its own: its flattening is not known here
        elif type(node) is list:
            seen.add(id(node))
            self.lists.append(node)
            children = node
        elif type(node) is dict:
            seen.add(id(node))
            self.mappings.append(node)
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


_metadata = operator.methodcaller("get_metadata")


def _same(values: Any, recorded: tuple[Any, ...]) -> bool:
    """Whether ``values`` are the ``recorded`` objects, in order (as many of them: the
    callers compare sizes first)."""
    return all(map(operator.is_, values, recorded))


def _equal(recorded: list[dict[str, Any]], now: list[dict[str, Any]]) -> bool:
    """Whether the Variables' metadata ``now`` equals the ``recorded`` (values the same
    object are equal without a comparison; a value whose comparison is not a bool, an array,
    has changed)."""
    try:
        return recorded == now
    except (TypeError, ValueError):
        return False


def _is_pytree(node: Any) -> bool:
    """Whether ``node`` is a JAX pytree node (a container), not a leaf."""
    return not jax.tree_util.treedef_is_leaf(jax.tree.structure(node))
