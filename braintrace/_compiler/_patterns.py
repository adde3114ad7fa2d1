"""Structural unit patterns of one step, per sample: who can influence whom.

For SnAp's sparsity (``_algorithms/_snap.py``), two boolean patterns over the
``N`` hidden units of one sample (every hidden leaf flattened, in order):

* ``adjacency[n, m]``: ``h^t_n`` may depend on ``h^{t-1}_m``;
* ``immediate[r][n, j]``: ``h^t_n`` may depend on unit ``j`` of relation
  ``r``'s output ``y`` (one sample's units).

Both come from position maps (``_positions.py``): elementwise and
data-movement operations are followed exactly; a value computed by an
operation that mixes positions (a matmul, a reduction, another ETP
operation) is taken to depend on every unit of its sample. So the patterns
are structural and conservative (a superset of the Jacobians' non-zeros),
never read off numbers.

Example:
    >>> import numpy as np
    >>> from braintrace._compiler._patterns import reach
    >>> adjacency = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool)  # a chain 0 → 1 → 2
    >>> reach(adjacency, np.eye(3, dtype=bool)[:, :1], steps=1)[:, 0].tolist()
    [True, True, False]
"""

from __future__ import annotations

import math

import jax.extend.core as jex_core
import numpy as np

from braintrace._compiler._graph import ETraceGraph
from braintrace._compiler._positions import propagate
from braintrace._compiler._walk import is_var, reached

__all__ = ["reach", "unit_patterns"]


def _sample_sources(shape: tuple[int, ...], batched: bool, offset: int) -> np.ndarray:
    """A position map whose entries are per-sample unit indices (plus ``offset``)."""
    sample = shape[1:] if batched else shape
    units = offset + np.arange(math.prod(sample), dtype=np.int64).reshape(sample)
    return np.broadcast_to(units, shape)[..., None].copy()


def _dependence(jaxpr: jex_core.Jaxpr, sources: dict, targets: list, sizes: list[int],
                width: int, batched: bool) -> np.ndarray:
    """``(Σ sizes, width)``: which source units each target unit of one sample depends on."""
    mixing: list[int] = []
    env = propagate(jaxpr, sources, on_mixing=lambda i, _: mixing.append(i),
                    max_sources=max(width, 1))
    dense, _ = reached(jaxpr, [v for i in mixing for v in jaxpr.eqns[i].outvars if is_var(v)])
    rows = []
    for var, size in zip(targets, sizes):
        block = np.zeros((size, width), bool)
        if is_var(var) and var in dense:
            block[:] = True
        elif is_var(var) and var in env:
            m = env[var]
            m = (m[0] if batched else m).reshape(size, -1)
            for unit, deps in enumerate(m):
                block[unit, deps[deps >= 0]] = True
        rows.append(block)
    return np.concatenate(rows, axis=0)


def unit_patterns(graph: ETraceGraph, batched: bool) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(adjacency (N, N), [immediate (N, |y_r|)])`` of one sample (module docstring)."""
    jaxpr = graph.jaxpr
    hidden_in = graph.layout.hidden_invars(jaxpr)
    hidden_out = graph.layout.hidden_outvars(jaxpr)
    lead = 1 if batched else 0
    sizes = [math.prod(v.aval.shape[lead:]) for v in hidden_in]
    offsets = np.cumsum([0, *sizes])
    n = int(offsets[-1])
    sources = {v: _sample_sources(tuple(v.aval.shape), batched, int(o))
               for v, o in zip(hidden_in, offsets)}
    adjacency = _dependence(jaxpr, sources, hidden_out, sizes, n, batched)
    immediate = []
    for r in graph.relations:
        y = graph.relation_output_var(r.eqn_index)
        y_batched = batched and r.batched
        width = math.prod(y.aval.shape[1 if y_batched else 0:])
        source = {y: _sample_sources(tuple(y.aval.shape), y_batched, 0)}
        immediate.append(_dependence(jaxpr, source, hidden_out, sizes, width, batched))
    return adjacency, immediate


def reach(adjacency: np.ndarray, start: np.ndarray, steps: int) -> np.ndarray:
    """Units reachable from ``start`` ``(N, K)`` within ``steps`` steps of ``adjacency``."""
    out = start.astype(bool)
    for _ in range(steps):
        out = out | (adjacency.astype(np.int64) @ out.astype(np.int64) > 0)
    return out
