"""The eligibility-trace graph of one model step: frozen data, built by ``_build.py``.

The graph holds the flat jaxpr of one step, its :class:`StepLayout`, the
hidden groups, the traced relations, the exclusions and the approximations
(the records are in ``_records.py``). The run-time programs that evaluate it
(``forward``, ``jacobians``, ``operands``) are functions in ``_programs.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.extend.core as jex_core

from braintrace._compiler._layout import StepLayout
from braintrace._compiler._modules import ModuleMap
from braintrace._compiler._records import (
    Approximation,
    Exclusion,
    HiddenGroup,
    InputRelation,
    Relation,
)
from braintrace._compiler._walk import cast_source, producers

__all__ = ["ETraceGraph"]


REPORTER: list[Callable[[Any, Any, bool], str]] = []
"""The report writer (``_report.graph_report``, set by the package): the report compiles the
model in other scopes (``_alternatives``), which builds graphs, so this module does not import
it; the package's face joins the two."""


@dataclasses.dataclass(frozen=True, eq=False)
class ETraceGraph:
    """The compiled eligibility-trace graph of one model step.

    Produced by :func:`braintrace.compile_graph`; consumed by the algorithms.
    The step's jaxpr takes ``[*params, *hidden, *other, *x]`` leaves and returns
    ``[*y, *params, *hidden, *other]`` leaves (see :class:`StepLayout`).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
        >>> braintrace.init_states(model, 4)
        >>> graph = braintrace.compile_graph(model, jnp.ones((4, 2)))
        >>> [(g.paths, g.num_states) for g in graph.groups]
        [(('carry',), 1)]
        >>> [r.num_colours for r in graph.relations]
        [3, 3]
        >>> [a.kind for a in graph.approximations]  # the recurrent kernels couple units
        ['hidden-coupling']

    Attributes:
        jaxpr: The flat jaxpr of one step.
        consts: Values of its constvars.
        layout: Leaf paths and the slicing of the jaxpr's inputs and outputs.
        groups: The hidden groups.
        relations: The traced relations.
        exclusions: ETP operations (or targets) not traced, with reasons.
        cut_eqns: Equations whose derivative is ignored in ``D`` and ``Df``.
        etp_eqns: Every ETP equation.
        approximations: Where the traces are not the exact influence of a
            Param on the hidden state; empty when D-RTRL equals BPTT.
        scope: ``'diagonal'``, ``'coupled'`` or ``'full'``.
        modules: The module each equation runs in and the modules' classes
            (empty for a pure step function): the report's terms.
        notes: What the normalisation pass changed.
        warnings: What tracing the step warned about (e.g. a vmapped primitive).
    """

    jaxpr: jex_core.Jaxpr
    consts: tuple[Any, ...]
    layout: StepLayout
    groups: tuple[HiddenGroup, ...]
    relations: tuple[Relation, ...]
    exclusions: tuple[Exclusion, ...]
    cut_eqns: frozenset[int]
    etp_eqns: frozenset[int]
    approximations: tuple[Approximation, ...]
    scope: str
    modules: ModuleMap
    notes: tuple[str, ...]
    warnings: tuple[str, ...]

    def report(self, algorithm: Any = None, verbose: bool = False) -> str:
        """A person-readable report in the model's module terms.

        Short by default: the hidden groups, which Params learn by eligibility traces
        and which by their same-step gradient only, one sentence per approximation
        (what is approximate, what to do), the exact alternatives once, warnings.

        Args:
            algorithm: The algorithm the graph is compiled for (e.g.
                ``braintrace.UORO()``): the report then also lists what it
                approximates by construction on this model.
            verbose: The summary (each approximation with all its advice), then
                the details: groups, traced operations, every Param and why,
                equations, what the normalisation pass changed.
        """
        return REPORTER[0](self, algorithm, verbose)

    def __str__(self) -> str:
        return self.report()

    @property
    def param_paths(self) -> tuple[str, ...]:
        return self.layout.param_paths

    @property
    def hidden_paths(self) -> tuple[str, ...]:
        return self.layout.hidden_paths

    @property
    def other_paths(self) -> tuple[str, ...]:
        return self.layout.other_paths

    @property
    def num_outputs(self) -> int:
        return self.layout.num_outputs

    @property
    def out_treedef(self) -> Any:
        return self.layout.out_treedef

    @property
    def num_params(self) -> int:
        return self.layout.num_params

    @property
    def num_hidden(self) -> int:
        return self.layout.num_hidden

    @property
    def input_avals(self) -> list[tuple[tuple[int, ...], Any]]:
        """``(shape, dtype)`` of each input leaf ``x`` of one step."""
        return [(tuple(v.aval.shape), v.aval.dtype) for v in self.layout.input_invars(self.jaxpr)]

    @property
    def traced_eqns(self) -> frozenset[int]:
        """ETP equations with at least one relation."""
        return frozenset(r.eqn_index for r in self.relations)

    @property
    def traced_param_paths(self) -> tuple[str, ...]:
        """Params that learn (at least partly) by eligibility traces."""
        paths = {p for r in self.relations for p in r.all_param_paths}
        return tuple(p for p in self.param_paths if p in paths)

    @property
    def input_relations(self) -> tuple[InputRelation, ...]:
        """The relations of operations with an input ``x``."""
        return tuple(r for r in self.relations if isinstance(r, InputRelation))

    def relation_input_var(self, relation: InputRelation) -> Any:
        """The jaxpr variable of a relation's input ``x``."""
        eqn = self.jaxpr.eqns[relation.eqn_index]
        return eqn.invars[relation.primitive.x_invar_index]

    def new_state_vars(self) -> list[Any]:
        """Per hidden leaf, the jaxpr variable where its new value ``h^t`` is defined: its
        output variable, or the floating-point value that output casts (``_walk.cast_source``).

        A step computed wider than the state it writes (a float64 step into a float32 state,
        a float32 step into a bfloat16 one) reads that value, not its narrowed copy: the
        learning signal at ``h^t`` and every analysis of what reads the new state start
        there.
        """
        producer = producers(self.jaxpr)
        return [cast_source(self.jaxpr, v, producer)
                for v in self.layout.hidden_outvars(self.jaxpr)]

    def relation_output_var(self, eqn_index: int) -> Any:
        """The jaxpr variable of an ETP equation's output ``y``."""
        eqn = self.jaxpr.eqns[eqn_index]
        return eqn.outvars[eqn.primitive.y_outvar_index]
