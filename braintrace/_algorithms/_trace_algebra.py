"""Trace algebra shared by the algorithms: dtypes, per-sample maps, sums, state mixing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from braintrace._compiler import ETraceGraph, Relation, batch_shards

__all__ = ["SAMPLE_BLOCK", "batch_split", "group_signal", "is_batched", "merge_steps",
           "mix_states", "operand_structs", "param_dtypes", "per_sample", "sum_over_samples",
           "tree_sum"]


def batch_split() -> bool:
    """Whether the program being traced runs on several devices (a mesh is set).

    The drivers trace a data-parallel program under its mesh
    (``jax.sharding.use_abstract_mesh``); the batch axis is then split over
    the devices, and a rule must not slice single samples out of it (XLA would
    move other devices' rows, inside the time loop) but reduce over the whole
    axis, which XLA partitions.

    Example:
        >>> from braintrace._algorithms._trace_algebra import batch_split
        >>> batch_split()
        False
    """
    return batch_shards() > 1


def is_batched(graph: ETraceGraph) -> bool:
    """Whether the step is batched (its relations' primitives carry a leading batch axis)."""
    return any(r.batched for r in graph.relations)


def operand_structs(graph: ETraceGraph) -> list[dict[str, jax.ShapeDtypeStruct]]:
    """Each relation's trainable operands ``θ`` as shapes and dtypes (for abstract evaluation)."""
    eqns = graph.jaxpr.eqns
    return [{key: jax.ShapeDtypeStruct(eqns[r.eqn_index].invars[i].aval.shape,
                                       eqns[r.eqn_index].invars[i].aval.dtype)
             for key, i in r.operands.items()} for r in graph.relations]


def param_dtypes(graph: ETraceGraph, relation: Relation) -> dict[str, Any]:
    """``{key: dtype}``: the dtype of the Param(s) each trainable operand is computed from.

    An operand may be a promoted copy of its Param (e.g. a float32 kernel used
    in a float64 matmul); traces are kept in the Param's dtype, not the
    operand's. An operand computed from several Params gets their result type;
    one computed from none keeps the operand's dtype.
    """
    avals = {path: v.aval for path, v in zip(graph.param_paths,
                                              graph.jaxpr.invars[:graph.num_params])}
    eqn = graph.jaxpr.eqns[relation.eqn_index]
    out = {}
    for key, position in relation.operands.items():
        paths = relation.param_paths.get(key, ())
        out[key] = (jnp.result_type(*(avals[p].dtype for p in paths)) if paths
                    else eqn.invars[position].aval.dtype)
    return out


def merge_steps(relation: Relation, a: jax.Array, *, sample_major: bool = False) -> jax.Array:
    """A block's ``(K, B, ...)`` stack as ``(K·B, ...)`` rows for one product over steps and
    samples (unchanged for a relation without a batch axis); sample-major, ``(B·K, ...)``,
    when the batch is split over devices (:func:`batch_split`) or ``sample_major`` (the order
    of the rows is the product's to choose: it sums over them).

    Example:
        >>> import jax.numpy as jnp
        >>> from types import SimpleNamespace
        >>> from braintrace._algorithms._trace_algebra import merge_steps
        >>> merge_steps(SimpleNamespace(batched=True), jnp.zeros((4, 2, 3))).shape
        (8, 3)
    """
    if not relation.batched:
        return a
    if sample_major or batch_split():  # a split batch axis stays the leading one
        a = jnp.swapaxes(a, 0, 1)
    return a.reshape(-1, *a.shape[2:])


def per_sample(fn: Callable[..., Any], relation: Relation) -> Callable[..., Any]:
    """``jax.vmap(fn)`` over the leading batch axis when the relation is batched."""
    return jax.vmap(fn) if relation.batched else fn


#: Samples summed in one unrolled expression by :func:`sum_over_samples`.
SAMPLE_BLOCK = 16


def tree_sum(terms: list[Any]) -> Any:
    """Pairwise sum of a list of pytrees (a balanced tree of adds).

    Example:
        >>> from braintrace._algorithms._trace_algebra import tree_sum
        >>> float(tree_sum([{"w": 1.0}, {"w": 2.0}, {"w": 4.0}])["w"])
        7.0
    """
    while len(terms) > 1:
        pairs = [jax.tree.map(jnp.add, terms[k], terms[k + 1]) for k in range(0, len(terms) - 1, 2)]
        terms = pairs + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def sum_over_samples(fn: Callable[..., Any], *batched: Any) -> Any:
    """``Σ_b fn(*[a[b] for a in batched])``: a per-sample function summed over the batch.

    Every leaf of ``batched`` carries the batch on its leading axis. Samples are
    summed in blocks of :data:`SAMPLE_BLOCK` written out as one expression,
    which XLA fuses into a single elementwise pass over the block; blocks are
    accumulated by a loop. On CPU this is several times faster than a
    reduction over the leading axis of a large trace (which XLA:CPU walks
    with a stride of the whole sample) and than a loop over single samples
    (whose per-iteration overhead dominates). When the batch is split over
    ``n`` devices (:func:`batch_split`), the batch is first grouped as
    ``(n, B / n)``, one group per device: each device sums its own samples so,
    then XLA sums the ``n`` partial sums across the devices; no sample moves
    between devices.

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._trace_algebra import sum_over_samples
        >>> a = jnp.arange(40.0).reshape(20, 2)
        >>> sum_over_samples(lambda row: row * 2, a).tolist()
        [760.0, 800.0]
    """
    shards = batch_shards()
    size = jax.tree.leaves(batched)[0].shape[0]
    if shards > 1:
        if size % shards:  # groups the devices do not hold: one reduction XLA partitions
            per_group = jax.vmap(fn)(*batched)
        else:
            grouped = jax.tree.map(lambda a: a.reshape(shards, size // shards, *a.shape[1:]),
                                   batched)
            per_group = jax.vmap(lambda *group: _sum_unrolled(fn, *group))(*grouped)
        return jax.tree.map(lambda a: jnp.sum(a, axis=0), per_group)
    return _sum_unrolled(fn, *batched)


def _sum_unrolled(fn: Callable[..., Any], *batched: Any) -> Any:
    """:func:`sum_over_samples` on one device: blocks of unrolled adds."""
    size = jax.tree.leaves(batched)[0].shape[0]

    def block(start: int | jax.Array, count: int) -> Any:
        rows = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, count), batched)
        return tree_sum([fn(*jax.tree.map(lambda a, k=k: a[k], rows)) for k in range(count)])

    if size <= SAMPLE_BLOCK:
        return block(0, size)
    blocks, rest = divmod(size, SAMPLE_BLOCK)
    total = jax.lax.fori_loop(
        1, blocks, lambda i, acc: jax.tree.map(jnp.add, acc, block(i * SAMPLE_BLOCK, SAMPLE_BLOCK)),
        block(0, SAMPLE_BLOCK))
    if rest:
        total = jax.tree.map(jnp.add, total, block(blocks * SAMPLE_BLOCK, rest))
    return total


def mix_states(dt_to_t: Callable[..., Any], d: jax.Array, trace: Any, **params: Any) -> Any:
    """``out[..., s] = Σ_{s'} dt_to_t(d[..., s, s'], trace[..., s'])``, states on the last axis.

    Applies an ``(S, S)`` per-unit matrix to a trace whose last axis holds
    the ``S`` states, through the primitive's ``dt_to_t`` rule. The result keeps
    the trace's dtype (``D`` may be wider, e.g. float32 hidden state and
    bfloat16 Params).
    """
    num_states = d.shape[-1]
    take = lambda s: jax.tree.map(lambda e: e[..., s], trace)
    rows = []
    for s in range(num_states):
        total = None
        for s2 in range(num_states):
            term = dt_to_t(d[..., s, s2], take(s2), **params)
            total = term if total is None else jax.tree.map(jnp.add, total, term)
        rows.append(total)
    mixed = jax.tree.map(lambda *r: jnp.stack(r, axis=-1), *rows)
    return jax.tree.map(lambda m, t: m.astype(t.dtype), mixed, trace)


def group_signal(graph: ETraceGraph, delta: Sequence[jax.Array], group: int) -> jax.Array:
    """Stacks the per-leaf learning signals of a group: ``(*V, S)``."""
    g = graph.groups[group]
    return jnp.stack([delta[k] for k in g.leaves], axis=-1)
