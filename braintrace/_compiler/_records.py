"""The frozen records of an eligibility-trace graph: groups, relations, exclusions, approximations.

Data only: how they are found is in ``_groups.py``, ``_relations.py`` and
``_approximations.py``; how they are used at run time is in ``_programs.py``.
A relation is one of two final kinds: :class:`InputRelation` for an ETP
operation with an input ``x`` (dense, LoRA, ...) and :class:`ElementwiseRelation`
for one without (``y = fn(w)``, shaped like the hidden state).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from braintrace._compiler._batch_shards import batch_shards
from braintrace._compiler._index_maps import FlatMap
from braintrace._primitives import ETPPrimitive

__all__ = ["Approximation", "ElementwiseRelation", "Exclusion", "HiddenGroup", "InputRelation",
           "Relation"]


@dataclasses.dataclass(frozen=True)
class HiddenGroup:
    """Hidden states whose transitions couple elementwise.

    Attributes:
        index: Position of the group in ``ETraceGraph.groups``.
        leaves: Hidden-leaf indices of its states, in state order.
        paths: Their state paths (e.g. ``'layer.v'``).
        shape: The common shape ``V`` of the states (batch axis included).
        dtype: The dtype of the first state.
        colours: ``None`` when each ``h^t[v]`` depends on ``h^{t-1}`` only at
            position ``v``; otherwise flat position -> colour, where positions
            one output depends on have distinct colours, so one JVP per colour
            and state gives the exact per-position blocks of ``D``.
    """

    index: int
    leaves: tuple[int, ...]
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: Any
    colours: np.ndarray | None = dataclasses.field(default=None, compare=False)

    @property
    def num_states(self) -> int:
        """``S``, the number of states per position."""
        return len(self.leaves)

    @property
    def size(self) -> int:
        """``N``, the number of positions."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def num_colours(self) -> int:
        """The number of JVPs per state needed for ``D``."""
        return 1 if self.colours is None else int(self.colours.max(initial=0)) + 1

    @functools.cached_property
    def own_colour_map(self) -> FlatMap:
        """Position ``v`` -> row ``(colour(v), v)`` of the colours' stacked responses."""
        colours = np.zeros(self.size, np.int64) if self.colours is None else self.colours
        return FlatMap.of(colours.reshape(-1) * self.size + np.arange(self.size),
                          self.num_colours * self.size)


@dataclasses.dataclass(frozen=True, eq=False)
class InputRelation:
    """An ETP operation ``y = f(x, θ)`` with an input, feeding one hidden group.

    Attributes:
        index: Position in ``ETraceGraph.relations``.
        eqn_index: The ETP equation in the flat jaxpr.
        primitive: The ETP primitive.
        params: The equation parameters.
        group: Index of the hidden group it feeds.
        operands: ``{key: operand position}`` of its trainable inputs.
        param_paths: ``{key: Param paths}`` each operand is computed from.
        y_shape: Shape of the output ``y``.
        group_shape: Shape ``V`` of the group it feeds.
        x_shape: Shape of the input ``x``.
        y_to_hidden: Flat ``y`` position -> flat group position, ``-1`` where
            the unit feeds nothing. In the full scope (exact RTRL, SnAp, UORO)
            a relation has no unit map: ``-1`` throughout, and ``group`` is the
            first group its output reaches (see ``_full_relations.py``).
        colours: Flat ``y`` position -> colour; units of one colour feed
            distinct hidden units, so one JVP per colour gives ``Df``.
    """

    index: int
    eqn_index: int
    primitive: ETPPrimitive
    params: dict[str, Any]
    group: int
    operands: dict[str, int]
    param_paths: dict[str, tuple[str, ...]]
    y_shape: tuple[int, ...]
    group_shape: tuple[int, ...]
    x_shape: tuple[int, ...]
    y_to_hidden: np.ndarray
    colours: np.ndarray

    has_input = True

    @property
    def num_colours(self) -> int:
        """The number of JVPs needed for ``Df``."""
        return int(self.colours.max(initial=0)) + 1

    @property
    def batched(self) -> bool:
        """Whether ``x`` and ``y`` carry a leading batch axis."""
        return self.primitive.batched

    @property
    def all_param_paths(self) -> tuple[str, ...]:
        """Every Param the operands are computed from, sorted."""
        return tuple(sorted({p for ps in self.param_paths.values() for p in ps}))

    @functools.cached_property
    def hidden_map(self) -> FlatMap:
        """Flat ``y`` position -> the flat group position it feeds."""
        return FlatMap.of(self.y_to_hidden, int(np.prod(self.group_shape, dtype=np.int64)))

    @functools.cached_property
    def response_map(self) -> FlatMap:
        """Flat ``y`` position -> row ``(colour, unit fed)`` of the colours' stacked responses."""
        size = int(np.prod(self.group_shape, dtype=np.int64))
        index = np.where(self.y_to_hidden >= 0, self.colours * size + self.y_to_hidden, -1)
        return FlatMap.of(index, self.num_colours * size)

    def gather_hidden(self, value: jax.Array, *, feeds_large: bool = False) -> jax.Array:
        """Maps a group-shaped ``(*V, ...)`` array to ``y`` positions ``(*y, ...)``.

        Units that feed no hidden unit get zeros. ``feeds_large``: see
        :meth:`FlatMap.take`.
        """
        tail = value.shape[len(self.group_shape):]
        if self.y_shape == self.group_shape and self.hidden_map.is_identity:
            # Unit k of y feeds hidden unit k (a layer into its own neurons): nothing to
            # map. Also not through flat ``B·N`` positions, which GSPMD cannot keep split by
            # neuron: it gathered every block's stacked Jacobians whole onto each device.
            return value
        sample = self.sample_hidden_map
        if sample is not None and batch_shards() > 1:
            # The batch split over devices: one map per sample, so XLA keeps each device's
            # rows where they are (a gather of flat positions would gather the batch first).
            take = lambda v: sample.take(v.reshape(-1, *tail), feeds_large=feeds_large)
            return jax.vmap(take)(value).reshape(*self.y_shape, *tail)
        out = self.hidden_map.take(value.reshape(-1, *tail), feeds_large=feeds_large)
        return out.reshape(*self.y_shape, *tail)

    @functools.cached_property
    def sample_hidden_map(self) -> FlatMap | None:
        """:attr:`hidden_map` of one sample, when every sample's units feed their own sample's
        hidden units alike (else ``None``)."""
        if not self.batched or self.y_shape[:1] != self.group_shape[:1]:
            return None
        rows = self.y_to_hidden.reshape(self.y_shape[0], -1)
        size = int(np.prod(self.group_shape[1:], dtype=np.int64))
        own = np.where(rows >= 0, rows - size * np.arange(rows.shape[0])[:, None], -1)
        if not ((own == own[:1]).all() and (own < size).all() and (rows < 0).sum() == (
                own < 0).sum()):
            return None
        return FlatMap.of(own[0], size)


@dataclasses.dataclass(frozen=True, eq=False)
class ElementwiseRelation:
    """An ETP operation ``y = fn(θ)`` without input (a time constant), feeding one group.

    Attributes:
        index: Position in ``ETraceGraph.relations``.
        eqn_index: The ETP equation in the flat jaxpr.
        primitive: The ETP primitive.
        params: The equation parameters.
        group: Index of the hidden group it feeds.
        operands: ``{key: operand position}`` of its trainable inputs.
        param_paths: ``{key: Param paths}`` each operand is computed from.
        y_shape: Shape of the output ``y``.
        group_shape: Shape ``V`` of the group it feeds.
        hidden_to_y: Flat group position -> the flat ``y`` position it reads,
            ``-1`` for none (throughout in the full scope, as ``InputRelation``).
    """

    index: int
    eqn_index: int
    primitive: ETPPrimitive
    params: dict[str, Any]
    group: int
    operands: dict[str, int]
    param_paths: dict[str, tuple[str, ...]]
    y_shape: tuple[int, ...]
    group_shape: tuple[int, ...]
    hidden_to_y: np.ndarray

    has_input = False
    num_colours = 1
    batched = False

    @property
    def all_param_paths(self) -> tuple[str, ...]:
        """Every Param the operands are computed from, sorted."""
        return tuple(sorted({p for ps in self.param_paths.values() for p in ps}))

    @functools.cached_property
    def y_map(self) -> FlatMap:
        """Flat group position -> the flat ``y`` position it reads."""
        return FlatMap.of(self.hidden_to_y, int(np.prod(self.y_shape, dtype=np.int64)))

    def scatter_to_y(self, value: jax.Array) -> jax.Array:
        """Sums a group-shaped ``(*V,)`` array into the ``y`` positions each unit reads."""
        return self.y_map.sum_into(value.reshape(-1)).reshape(self.y_shape)


Relation = InputRelation | ElementwiseRelation
"""A traced ETP operation feeding one hidden group (in the full scope: the hidden state as a
whole): one of the two final kinds."""


EXCLUSION_KINDS = ("operand-not-from-params", "reads-several-outputs", "feeds-several-units",
                   "batch-mismatch", "through-etp-only", "through-mixing-only", "readout",
                   "opaque-body")


@dataclasses.dataclass(frozen=True)
class Exclusion:
    """An ETP operation (or one of its targets) that is not traced online.

    Its Params get their exact same-step gradient only (at this site).

    Attributes:
        eqn_index: The ETP equation (or the opaque equation hiding one).
        primitive: Its name.
        param_paths: The Params it reads.
        kind: Why, as data: one of :data:`EXCLUSION_KINDS`.
        detail: The specifics for a person (the operation, group or operand).
        via: For ``'through-etp-only'`` and ``'through-mixing-only'``: the
            operations the output reaches hidden state through (empty otherwise).
    """

    eqn_index: int
    primitive: str
    param_paths: tuple[str, ...]
    kind: str
    detail: str
    via: tuple[int, ...] = ()

    @property
    def reason(self) -> str:
        """The person-readable reason."""
        return self.detail


@dataclasses.dataclass(frozen=True)
class Approximation:
    """A place where a gradient is not BPTT's: the traces of the graph, or the algorithm.

    Attributes:
        kind: Of the graph: ``'hidden-coupling'``, ``'moved-positions'``,
            ``'output-mixing'``, ``'untraced-path'``, ``'carried-state'``,
            ``'sample-mixing'`` (see ``_approximations.py``); of an algorithm
            that approximates by construction: its own kind (e.g.
            ``'factorised-traces'``, ``'random-estimate'``).
        param_paths: The Params whose gradient it affects.
        detail: Which operations (equation numbers) and states, for the details.
        summary: One plain sentence in module terms: what is approximate and
            what to do (a strict-exact alternative).
        short: The summary without the advice it shares with the graph's other
            approximations (the strict-exact alternatives, which a short report
            gives once); empty when the summary has no shared advice.
    """

    kind: str
    param_paths: tuple[str, ...]
    detail: str
    summary: str
    short: str = ""

    def describe(self) -> str:
        """One line: the Params, the kind and the detail."""
        return f"{', '.join(self.param_paths)}: {self.kind}: {self.detail}"
