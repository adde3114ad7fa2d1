"""The sparse ETP primitive: a linear map over a fixed list of connections.

A fixed connectivity of ``nnz`` synapses ``k`` from input ``pre[k]`` to output
``post[k]`` carries one trainable weight each, ``weight (nnz,)``:

.. math::

    y[o] = \\sum_{k:\\, post[k] = o} w[k]\\, x[pre[k]] \\; (+\\, b[o])

computed as a sum over the connections grouped by output (a gather per slot,
``_sparse_kernels.py``), never as a dense ``(I, O)`` matrix and without a scatter.
Registered as ``etp_sparse`` (``x: (I,)``) and ``etp_sparse_batched``
(``x: (B, I)``). The connectivity is a static parameter of the equation
(:class:`Connectivity`), as the rules need it.

Rules (per sample, cotangent ``d: (O,)``):

.. math::

    \\mathrm{xy\\_to\\_dw}: \\quad dw[k] = x[pre[k]]\\, d[post[k]], \\qquad db = d

    \\mathrm{dt\\_to\\_t}: \\quad \\epsilon_w[k] \\mapsto \\epsilon_w[k]\\, d[post[k]],
    \\qquad \\epsilon_b[o] \\mapsto \\epsilon_b[o]\\, d[o]

Each weight feeds one output unit, so the D-RTRL trace is ``(nnz, S)`` per
sample: memory and time scale with ``nnz``, not with ``I·O``. Sums over many
rows (a batch, a block of steps) are written out a group of rows at a time, so
no ``(rows, nnz)`` temporary is made.

Event-driven input: for boolean ``x`` (spikes) and a bound ``max_events`` on
the active inputs per sample, :func:`sparse_matmul` sums only the rows of
active presynaptic inputs: the connections are kept in a padded per-input
layout (``fan_out`` slots per input), the indices of the active inputs are
gathered and only their rows are scattered into ``y``, ``max_events × fan_out``
work per sample instead of ``nnz``. It equals the dense-input path exactly (the
rules are the same); a sample with more than ``max_events`` active inputs gets
a NaN output rather than a silently truncated one. On accelerators, where a
scatter costs several gathers, the same values come from the dense-input path
(NaN likewise past ``max_events``): every sum of the primitive is a gather there.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from braintrace._platform import by_platform
from braintrace._primitives._register import register_pair
from braintrace._primitives._rules import (
    ETPRules,
    sum_leading,
    zeros_like_output,
    zeros_like_params,
)
from braintrace._primitives._sparse_cells import Cells, cells
from braintrace._primitives._sparse_kernels import ByOutput, by_output, group_by, sum_rows
from braintrace._primitives._sparse_product import sparse_product_p, weight_pullback
from braintrace._primitives._sparse_slices import Slices, slices
from braintrace._primitives._sparse_tiles import Tiles, gather_tiles, pair_tiles

__all__ = ["SPARSE_RULES", "Connectivity", "etp_sparse_batched_p", "etp_sparse_p",
           "sparse_matmul"]


class Connectivity:
    """A fixed, hashable list of connections ``pre[k] -> post[k]`` between ``I`` and ``O`` units.

    Built from a boolean mask ``(I, O)`` (:meth:`from_mask`, connections in
    row-major order) or from index arrays (:meth:`from_indices`, order kept, each
    pair once); the constructor itself takes any list, repeated pairs included
    (their weights add). Hashing and equality use the content, so equal
    connectivities reuse compiled programs. Built with it, once: each output's
    incoming and each input's outgoing connections in slices of one width
    (:attr:`incoming`, :attr:`outgoing`), the tables through which accelerators
    compute the product and its transpose as gathers.

    Example:
        >>> import numpy as np
        >>> from braintrace._primitives._sparse import Connectivity
        >>> c = Connectivity.from_mask(np.array([[True, False], [True, True]]))
        >>> c.pre.tolist(), c.post.tolist(), c.nnz
        ([0, 1, 1], [0, 0, 1], 3)
        >>> c == Connectivity.from_indices([0, 1, 1], [0, 0, 1], 2, 2)
        True
    """

    def __init__(self, pre: np.ndarray, post: np.ndarray, num_in: int, num_out: int):
        self._set_connections(pre, post, num_in, num_out)
        self.incoming: Slices = slices(self.post, self.num_out)
        """Each output's incoming connections, in slices (``_sparse_slices.py``): the
        accelerators' table of the product."""
        self.outgoing: Slices = slices(self.pre, self.num_in)
        """Each input's outgoing connections, in slices: the accelerators' table of the
        product's transpose (the ``x``-cotangent)."""

    def _set_connections(self, pre: np.ndarray, post: np.ndarray, num_in: int, num_out: int
                         ) -> None:
        self.pre = np.asarray(pre, np.int32)
        self.post = np.asarray(post, np.int32)
        self.num_in, self.num_out = int(num_in), int(num_out)
        self.pre.setflags(write=False)
        self.post.setflags(write=False)
        digest = hashlib.sha1(self.pre.tobytes() + b"|" + self.post.tobytes()).hexdigest()
        self._key = (self.num_in, self.num_out, digest)

    @classmethod
    def from_mask(cls, mask: ArrayLike) -> Connectivity:
        """Connections where the boolean ``mask (I, O)`` is true, in row-major order."""
        mask = np.asarray(mask)
        if mask.ndim != 2 or mask.dtype != np.bool_:
            raise ValueError(f"connectivity mask must be a boolean (in, out) array, got dtype "
                             f"{mask.dtype} and shape {mask.shape}.")
        pre, post = np.nonzero(mask)
        return cls(pre, post, *mask.shape)

    @classmethod
    def from_indices(cls, pre: ArrayLike, post: ArrayLike, num_in: int, num_out: int
                     ) -> Connectivity:
        """Connections ``pre[k] -> post[k]``; each pair at most once."""
        pre, post = np.asarray(pre), np.asarray(post)
        if pre.ndim != 1 or pre.shape != post.shape or not np.issubdtype(pre.dtype, np.integer) \
                or not np.issubdtype(post.dtype, np.integer):
            raise ValueError(f"connectivity (pre, post) must be two integer index arrays of one "
                             f"length, got shapes {pre.shape} and {post.shape}.")
        if pre.size and (pre.min() < 0 or pre.max() >= num_in or post.min() < 0
                         or post.max() >= num_out):
            raise ValueError(f"connectivity indices out of range: pre must lie in [0, {num_in}) "
                             f"and post in [0, {num_out}).")
        pairs = pre.astype(np.int64) * num_out + post  # one integer per (pre, post) pair
        if np.unique(pairs).size != pre.size:  # no Python object per connection
            raise ValueError("connectivity lists a (pre, post) pair more than once; give each "
                             "connection once (its weight is the sum).")
        return cls(pre, post, num_in, num_out)

    @property
    def nnz(self) -> int:
        """The number of connections (of trainable weights)."""
        return int(self.pre.size)

    @functools.cached_property
    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The per-input layout: ``(post, k)`` of shape ``(I + 1, fan_out)``, padded.

        Row ``i`` lists the connections leaving input ``i``; padding slots (and
        the extra row ``I``, used for absent events) point to output ``O``
        (dropped by the scatter) and weight ``nnz`` (a zero appended to ``w``).
        """
        post, index = group_by(self.pre, self.post, self.num_in, self.nnz)
        post[post < 0] = self.num_out
        return np.concatenate([post, np.full((1, post.shape[1]), self.num_out, np.int32)]), \
            np.concatenate([index, np.full((1, index.shape[1]), self.nnz, np.int32)])

    @functools.cached_property
    def by_output(self) -> ByOutput | None:
        """The connections grouped by output (``_sparse_kernels.ByOutput``), or ``None``
        when the fan-ins differ so much that padding them would more than triple the work."""
        return by_output(self.pre, self.post, self.num_in, self.num_out)

    def cells(self, side: str, chunk: int, block: int) -> Cells | None:
        """The ``'incoming'`` (sources ``pre``, targets ``post``) or ``'outgoing'`` connections
        cut into cells of ``chunk`` source rows by ``block`` target rows for the TPU kernels
        (``_sparse_cells.py``), or ``None`` when too uneven; built once per arguments."""
        cache = self.__dict__.setdefault("_cells", {})
        if (side, chunk, block) not in cache:
            sources, targets, counts = ((self.pre, self.post, (self.num_in, self.num_out))
                                        if side == "incoming" else
                                        (self.post, self.pre, (self.num_out, self.num_in)))
            cache[side, chunk, block] = cells(sources, targets, *counts, chunk, block)
        return cache[side, chunk, block]

    def tiles(self, side: str, chunk: int, block: int, pack: int = 1,
              own: bool = False) -> Tiles | None:
        """The ``'incoming'`` or ``'outgoing'`` connections in the staged kernels' lane tiles
        (``_sparse_tiles.py``): ``'gather'`` tiles of ``chunk`` source rows by ``block``
        target rows, or ``None`` when too uneven; ``side='pair'``: the incoming connections
        in ``'pair'`` tiles of ``chunk`` source rows (one index set per chunk; ``own``: of its
        own connections alone) when they are in output order (else ``None``); built once per
        arguments. ``pack``: tiles with that many sources per table row."""
        cache = self.__dict__.setdefault("_tiles", {})
        key = (side, chunk, block, pack, own)
        if key not in cache:
            if side == "pair":
                fan_in = self.nnz // max(self.num_out, 1)
                cache[key] = (
                    pair_tiles(self.pre, self.num_in, self.num_out, fan_in, block, chunk, pack,
                               own)
                    if self.nnz and self.in_output_order else None)
            else:
                sources, targets, counts = ((self.pre, self.post, (self.num_in, self.num_out))
                                            if side == "incoming" else
                                            (self.post, self.pre, (self.num_out, self.num_in)))
                cache[key] = gather_tiles(sources, targets, *counts, chunk, block, pack)
        return cache[key]

    @property
    def in_output_order(self) -> bool:
        """Whether ``post = repeat(arange(O), F)``: connection ``k`` is slot ``(k // F, k % F)``."""
        layout = self.incoming
        return (len(layout.items) == 1 and layout.first[0] == 0 and layout.order is None
                and layout.items[0].shape[0] == self.num_out)

    @functools.cached_property
    def transposed(self) -> Connectivity:
        """The same connections from ``O`` to ``I`` (``post -> pre``, same order); its tables
        are these, swapped."""
        other = object.__new__(Connectivity)
        other._set_connections(self.post, self.pre, self.num_out, self.num_in)
        other.incoming, other.outgoing = self.outgoing, self.incoming
        return other

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Connectivity) and self._key == other._key

    def __repr__(self) -> str:
        return f"Connectivity(in={self.num_in}, out={self.num_out}, nnz={self.nnz})"


def _dense_input_product(x, weight, conn: Connectivity):
    """``y[..., o] = Σ_{k: post[k]=o} w[k]·x[..., pre[k]]`` (``_sparse_product.py``)."""
    rows = x.reshape(-1, conn.num_in).astype(weight.dtype)
    y = sparse_product_p.bind(rows, weight, connectivity=conn)
    return y.reshape(*x.shape[:-1], conn.num_out)


def _event_product(x, weight, conn: Connectivity, max_events: int):
    """The rows of the first ``max_events`` active inputs of each sample, scattered into ``y``."""
    post, index = (jnp.asarray(a) for a in conn.rows)
    padded_w = jnp.concatenate([weight, jnp.zeros((1,), weight.dtype)])

    def one(spikes):
        (active,) = jnp.nonzero(spikes, size=max_events, fill_value=conn.num_in)
        targets, weights = post[active], padded_w[index[active]]
        y = jnp.zeros((conn.num_out + 1,), weight.dtype).at[targets.reshape(-1)].add(
            weights.reshape(-1))
        overflow = jnp.count_nonzero(spikes) > max_events
        return jnp.where(overflow, jnp.nan, y[:conn.num_out])

    lead = x.shape[:-1]
    y = jax.vmap(one)(x.reshape(-1, conn.num_in))
    return y.reshape(*lead, conn.num_out)


def _counted_product(x, weight, conn: Connectivity, max_events: int):
    """The dense-input product, NaN for a sample with more than ``max_events`` active inputs:
    the event-driven path's values on accelerators, where its scatter is the slow part."""
    y = _dense_input_product(x, weight, conn)
    overflow = jnp.count_nonzero(x, axis=-1, keepdims=True) > max_events
    return jnp.where(overflow, jnp.nan, y)


def _sparse_impl(x, weight, *bias, has_bias: bool, connectivity: Connectivity,
                 max_events: int | None):
    del has_bias
    if x.dtype == jnp.bool_ and max_events is not None:
        options = {"conn": connectivity, "max_events": max_events}
        y = by_platform(cpu=functools.partial(_event_product, **options),
                        accelerator=functools.partial(_counted_product, **options))(x, weight)
    else:
        y = _dense_input_product(x, weight, connectivity)
    if bias:
        y = y + bias[0]
    return y


def _sparse_layout(params) -> dict[str, int]:
    return {"weight": 1, "bias": 2} if params["has_bias"] else {"weight": 1}


def sparse_xy_to_dw(x, d, theta, *, connectivity: Connectivity, **params
                    ) -> dict[str, jax.Array]:
    """Pullback at ``(x, θ)``: ``dw[k] = Σ_lead x[..., pre[k]]·d[..., post[k]]``, ``db = Σ_lead d``.

    Summed over the leading rows a group of rows at a time
    (``_sparse_product.weight_pullback``): never a ``(rows, nnz)`` temporary.
    """
    del params
    weight, conn = theta["weight"], connectivity
    x2 = x.reshape(-1, conn.num_in).astype(weight.dtype)
    d2 = d.reshape(-1, conn.num_out).astype(weight.dtype)
    grads = {"weight": weight_pullback(x2, d2, conn)}
    if "bias" in theta:
        grads["bias"] = sum_leading(d).astype(theta["bias"].dtype)
    return grads


def _scale_weights(d: jax.Array, trace: jax.Array, conn: Connectivity) -> jax.Array:
    """``trace[..., k]·d[..., post[k]]``; a broadcast when the connections are in output order."""
    if conn.in_output_order:
        table = trace.reshape(*trace.shape[:-1], conn.num_out, -1)
        return (table * d[..., :, None]).reshape(trace.shape)
    return trace * jnp.take(d, conn.post, axis=-1)


def sparse_dt_to_t(d, trace, *, connectivity: Connectivity, **params) -> dict[str, jax.Array]:
    """``ε_w[..., k]·d[..., post[k]]`` and ``ε_b[..., o]·d[..., o]``."""
    del params
    return {key: _scale_weights(d, value, connectivity) if key == "weight" else value * d
            for key, value in trace.items()}


def sparse_contract(d, trace, *, connectivity: Connectivity, **params) -> dict[str, jax.Array]:
    """``Σ_lead sparse_dt_to_t(d, trace)``: on the CPU summed a group of rows at a time
    (``sum_rows``), elsewhere as one reduction over the rows that XLA fuses with the scaling
    (``platform.by_platform``)."""
    out = {}
    for key, value in trace.items():
        scale = functools.partial(_scale_one, key=key, connectivity=connectivity, **params)
        lead = jnp.broadcast_shapes(d.shape[:-1], value.shape[:-1])
        if not lead:
            out[key] = scale(d, value)
            continue
        d2 = jnp.broadcast_to(d, (*lead, d.shape[-1])).reshape(-1, d.shape[-1])
        t2 = jnp.broadcast_to(value, (*lead, value.shape[-1])).reshape(-1, value.shape[-1])
        out[key] = by_platform(cpu=functools.partial(sum_rows, scale),
                               accelerator=lambda d2, t2: jnp.sum(scale(d2, t2), axis=0))(d2, t2)
    return out


def _scale_one(d: jax.Array, value: jax.Array, *, key: str, connectivity: Connectivity,
               **params) -> jax.Array:
    """:func:`sparse_dt_to_t` of the one trace ``value`` of Param ``key``."""
    return sparse_dt_to_t(d, {key: value}, connectivity=connectivity, **params)[key]


SPARSE_RULES = ETPRules(
    xy_to_dw=sparse_xy_to_dw,
    dt_to_t=sparse_dt_to_t,
    init_drtrl=zeros_like_params,
    init_pp=functools.partial(zeros_like_output, dtype_of="weight"),
    contract=sparse_contract,
)
"""The sparse rules: a ``(nnz, S)`` trace per sample, scaled at each connection's output."""

etp_sparse_p, etp_sparse_batched_p = register_pair(
    "etp_sparse", _sparse_impl, SPARSE_RULES, trainable_invars_fn=_sparse_layout)


def sparse_matmul(
    x: ArrayLike,
    weight: ArrayLike,
    connectivity: Connectivity,
    bias: ArrayLike | None = None,
    *,
    max_events: int | None = None,
) -> jax.Array:
    """``y[o] = Σ_{k: post[k]=o} w[k]·x[pre[k]] + b[o]`` as one ETP op.

    Args:
        x: Input ``(..., I)``; real, integer or boolean.
        weight: One weight per connection, ``(nnz,)``.
        connectivity: The fixed connections (:class:`Connectivity`).
        bias: Optional bias ``(O,)``.
        max_events: With boolean ``x``: take the event-driven path, reading at
            most this many active inputs per sample (a sample with more gets a
            NaN output). ``None``: the dense-input path.

    Returns:
        The output ``(..., O)``.

    Example:
        >>> import jax.numpy as jnp
        >>> import braintrace
        >>> from braintrace._primitives._sparse import Connectivity
        >>> conn = Connectivity.from_indices([0, 2], [1, 1], num_in=3, num_out=2)
        >>> braintrace.sparse_matmul(jnp.array([1.0, 5.0, 2.0]), jnp.array([1.0, 3.0]), conn)
        Array([0., 7.], dtype=float32)
        >>> spikes = jnp.array([True, True, False])
        >>> braintrace.sparse_matmul(spikes, jnp.array([1.0, 3.0]), conn, max_events=2)
        Array([0., 1.], dtype=float32)
    """
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    if not all(hasattr(connectivity, a) for a in ("pre", "post", "rows", "nnz")):
        raise TypeError("braintrace.sparse_matmul: connectivity must be a Connectivity, got "
                        f"{type(connectivity).__name__}.")
    if weight.shape != (connectivity.nnz,) or x.ndim < 1 or x.shape[-1] != connectivity.num_in:
        raise ValueError(
            f"braintrace.sparse_matmul: x of shape {x.shape} and weight of shape {weight.shape} "
            f"do not match {connectivity}; expected x (..., {connectivity.num_in}) and weight "
            f"({connectivity.nnz},).")
    events = int(max_events) if max_events is not None and x.dtype == jnp.bool_ else None
    operands = [x, weight] if bias is None else [x, weight, jnp.asarray(bias)]
    params = {"has_bias": bias is not None, "connectivity": connectivity, "max_events": events}
    if x.ndim == 1:
        return etp_sparse_p.bind(*operands, **params)
    lead = x.shape[:-1]
    operands[0] = x.reshape(-1, x.shape[-1])
    y = etp_sparse_batched_p.bind(*operands, **params)
    return y.reshape(*lead, y.shape[-1])
