"""The leaves of one step: the named record the programs take, and the jaxpr's layout.

A flat step jaxpr takes ``[*params, *hidden, *other, *x]`` and returns
``[*y, *params, *hidden, *other]``. :class:`StepLayout` knows those counts and
paths and does all the slicing; :class:`StepLeaves` is the record of values
every run-time program takes.

Example:
    >>> from braintrace._compiler._layout import StepLayout, StepLeaves
    >>> layout = StepLayout(param_paths=('w',), hidden_paths=('h',), other_paths=(),
    ...                     num_outputs=1, out_treedef=None)
    >>> layout.split_outputs(['y', 'w', 'h2'])
    StepOutputs(y=['y'], hidden=['h2'], other=[])
    >>> StepLeaves(params=['w'], hidden=['h'], other=[], x=['x']).args()
    ['w', 'h', 'x']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["StepLayout", "StepLeaves", "StepOutputs"]


class StepLeaves(NamedTuple):
    """The input leaves of one step, by kind."""

    params: Sequence[Any]
    hidden: Sequence[Any]
    other: Sequence[Any]
    x: Sequence[Any]

    def args(self) -> list[Any]:
        """The jaxpr's arguments ``[*params, *hidden, *other, *x]``."""
        return [*self.params, *self.hidden, *self.other, *self.x]

    def with_hidden(self, hidden: Sequence[Any]) -> StepLeaves:
        """The same leaves with another hidden state."""
        return self._replace(hidden=list(hidden))


class StepOutputs(NamedTuple):
    """The output leaves of one step, by kind (Params, which pass through, are dropped)."""

    y: list[Any]
    hidden: list[Any]
    other: list[Any]


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Leaf paths of a step and the slicing of its jaxpr's inputs and outputs.

    Attributes:
        param_paths / hidden_paths / other_paths: Leaf paths (``'layer.kernel'``).
        num_outputs: Number of output leaves ``y``.
        out_treedef: Tree structure of the step output.
    """

    param_paths: tuple[str, ...]
    hidden_paths: tuple[str, ...]
    other_paths: tuple[str, ...]
    num_outputs: int
    out_treedef: Any

    @property
    def num_params(self) -> int:
        return len(self.param_paths)

    @property
    def num_hidden(self) -> int:
        return len(self.hidden_paths)

    def param_invars(self, jaxpr: Any) -> list[Any]:
        return list(jaxpr.invars[:self.num_params])

    def hidden_invars(self, jaxpr: Any) -> list[Any]:
        return list(jaxpr.invars[self.num_params:self.num_params + self.num_hidden])

    def other_invars(self, jaxpr: Any) -> list[Any]:
        start = self.num_params + self.num_hidden
        return list(jaxpr.invars[start:start + len(self.other_paths)])

    def input_invars(self, jaxpr: Any) -> list[Any]:
        return list(jaxpr.invars[self.num_params + self.num_hidden + len(self.other_paths):])

    def split_outputs(self, outs: Sequence[Any]) -> StepOutputs:
        """``[*y, *params, *hidden, *other]`` -> ``StepOutputs(y, hidden, other)``."""
        n_out, start = self.num_outputs, self.num_outputs + self.num_params
        return StepOutputs(list(outs[:n_out]), list(outs[start:start + self.num_hidden]),
                           list(outs[start + self.num_hidden:]))

    def hidden_outvars(self, jaxpr: Any) -> list[Any]:
        return self.split_outputs(jaxpr.outvars).hidden

    def other_outvars(self, jaxpr: Any) -> list[Any]:
        return self.split_outputs(jaxpr.outvars).other

    def invar_kinds(self, jaxpr: Any) -> dict[Any, tuple[str, str]]:
        """``{invar: (kind, path)}``: ``'Param'``, ``'hidden state'``,
        ``'non-Param Variable'`` or ``'input'``."""
        kinds = (["Param"] * self.num_params + ["hidden state"] * self.num_hidden
                 + ["non-Param Variable"] * len(self.other_paths))
        names = [*self.param_paths, *self.hidden_paths, *self.other_paths]
        return {v: (kinds[k], names[k]) if k < len(names) else ("input", f"x[{k - len(names)}]")
                for k, v in enumerate(jaxpr.invars)}
