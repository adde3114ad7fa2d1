"""Constant index maps between flat positions, run as reshapes where they can be.

The compiler records where each relation's output ``y`` lands in its hidden
group (and which colour of the Jacobian tangents reads it) as NumPy index
arrays. Applied with a gather (or a segment sum), XLA:CPU runs them element
by element inside the step's loop fusions; measured on a GRU (hidden 256,
batch 16) the three gathers of ``Df`` cost more than the step's matrix
products. Almost every layer's map is *affine* in a multi-index of the
output: ``index[p] = Σ_a stride_a · i_a(p)`` for a factorisation of the
output positions into axes ``i_a`` (a GRU's ``y[b, g·H + j]`` reads hidden
``[b, j]`` of colour ``g``: axes ``(b, g, j)`` with strides ``(H, 0, 1)``
into the hidden units, ``(H, B·H, 1)`` into the colours' stacked responses).
Such a map is a reshape of the source into the non-zero-stride axes, a
transpose into the output's order and a broadcast along the zero-stride axes
(for a sum into the targets: a sum over them). Every other map (a partial or
masked one, or one not affine) keeps the gather.

:class:`FlatMap` finds the axes once, from the NumPy array, and checks them
by rebuilding the whole index, so both paths give the same values.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._platform import by_platform

__all__ = ["TILED_REPEATS", "FlatMap"]

TILED_REPEATS = 8
"""The most copies of a repeated axis that :meth:`FlatMap._tiled` concatenates."""


def _affine_axes(index: np.ndarray) -> list[tuple[int, int]] | None:
    """``(size, stride)`` per axis, innermost first, with ``index[p] = index[0] + Σ stride·i``.

    Each axis is the longest run of the next-outer step that keeps one
    stride; ``None`` when the runs do not tile the positions or the rebuilt
    index differs.
    """
    total = index.size
    axes: list[tuple[int, int]] = []
    block = 1
    while block < total:
        starts = index[::block] - index[0]
        stride = int(starts[1])
        run = starts == stride * np.arange(starts.size)
        size = int(run.size if run.all() else np.argmin(run))
        while (total // block) % size:  # a run that overshoots an axis: shorten to a divisor
            size -= 1
        if size == 1:
            return None
        axes.append((size, stride))
        block *= size
    rebuilt = np.full(1, index[0], np.int64) if total else np.zeros(0, np.int64)
    for size, stride in axes:  # each axis found is outside the ones before it
        rebuilt = (stride * np.arange(size)[:, None] + rebuilt[None, :]).reshape(-1)
    if rebuilt.size != total or not np.array_equal(rebuilt, index):
        return None
    return axes


def _tiles_source(axes: list[tuple[int, int]], first: int, source_size: int) -> bool:
    """Whether the moving axes (non-zero stride) are the source's axes, row-major, each once.

    A reversed axis (negative stride) starts at its far end, so ``first`` must be
    ``Σ (size - 1)·|stride|`` over the reversed axes.
    """
    expected = 1
    for stride, size in sorted((abs(stride), size) for size, stride in axes if stride):
        if stride != expected:
            return False
        expected *= size
    start = sum((size - 1) * -stride for size, stride in axes if stride < 0)
    return expected == source_size and first == start


@dataclasses.dataclass(frozen=True, eq=False)
class FlatMap:
    """A constant map from ``index.size`` flat output positions into ``source_size`` ones.

    ``index[p]`` is the source position of output position ``p``, ``-1`` for none.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> from braintrace._compiler._index_maps import FlatMap
        >>> index = np.tile(np.arange(3), 2)          # outputs (2, 3) read sources (3,)
        >>> m = FlatMap.of(index, source_size=3)
        >>> m.is_reshape
        True
        >>> m.take(jnp.array([1.0, 2.0, 3.0])).tolist()
        [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
        >>> m.sum_into(jnp.arange(6.0)).tolist()     # the transpose: sums over the copies
        [3.0, 5.0, 7.0]
    """

    index: np.ndarray
    source_size: int
    axes: tuple[tuple[int, int], ...] | None
    """Output axes outermost first as ``(size, stride)``; ``None``: use the gather."""

    @classmethod
    def of(cls, index: np.ndarray, source_size: int) -> FlatMap:
        """Plans the map: the reshape form when ``index`` is a full affine map, else a gather."""
        index = np.asarray(index, np.int64).reshape(-1)
        axes = _affine_axes(index) if index.size and index.min() >= 0 else None
        if axes is not None:
            axes = [(size, stride) for size, stride in axes if size > 1]
            if not _tiles_source(axes, int(index[0]), source_size):
                axes = None
        return cls(index, int(source_size), None if axes is None else tuple(reversed(axes)))

    @property
    def is_reshape(self) -> bool:
        """Whether the map runs as reshape, transpose and broadcast (no gather)."""
        return self.axes is not None

    def _source_axes(self) -> tuple[list[int], list[int], list[int]]:
        """Source dims (row-major); per moving output axis its source axis; the reversed ones.

        The last list holds the positions, among the moving output axes, that run backwards.
        """
        assert self.axes is not None
        moving = [stride for _, stride in self.axes if stride]
        order = sorted((abs(s) for s in moving), reverse=True)
        sizes = {abs(stride): size for size, stride in self.axes if stride}
        return ([sizes[s] for s in order], [order.index(abs(s)) for s in moving],
                [k for k, s in enumerate(moving) if s < 0])

    @functools.cached_property
    def is_identity(self) -> bool:
        """Whether the map reads every source position in order (a reshape)."""
        return self.index.size == self.source_size and np.array_equal(
            self.index, np.arange(self.source_size))

    def take(self, values: jax.Array, *, feeds_large: bool = False) -> jax.Array:
        """``out[p] = values[index[p]]`` (zeros where ``index`` is ``-1``), leading axis flat.

        ``feeds_large``: the result feeds a much larger elementwise computation (a trace
        update broadcasting it over the inputs). XLA:CPU fuses a reshape, transpose or
        broadcast into that consumer and redoes its index arithmetic for every element
        there (measured on a GRU's per-step D-RTRL update: 3x slower), while it keeps a
        gather apart; so in programs lowered for the CPU every map but the identity then
        runs as a gather. XLA:TPU gathers single elements one at a time (the same GRU's
        ``(16, 256) -> (16, 768)`` map: 84 µs per step as a gather), so elsewhere the
        reshape form runs (:func:`~braintrace._platform.by_platform`).
        """
        if self.axes is None:
            return self._gather(values)
        accelerator = self._tiled if self.repeats_outside else self._spread
        if feeds_large and not self.is_identity:
            return by_platform(cpu=self._gather, accelerator=accelerator)(values)
        if self.repeats_outside:
            return by_platform(cpu=self._spread, accelerator=accelerator)(values)
        return self._spread(values)

    @functools.cached_property
    def repeats_outside(self) -> bool:
        """Whether a repeated axis (stride 0) of at most :data:`TILED_REPEATS` copies lies
        outside a moving one (a GRU's gates: ``y[b, g·H + j]`` reads ``[b, j]``)."""
        axes = self.axes or ()
        return any(not stride and size <= TILED_REPEATS and any(s for _, s in axes[a + 1:])
                   for a, (size, stride) in enumerate(axes))

    def _gather(self, values: jax.Array) -> jax.Array:
        """:meth:`take` as a gather (zeros where ``index`` is ``-1``)."""
        tail = values.shape[1:]
        mask = (self.index >= 0).reshape(-1, *([1] * len(tail)))
        return jnp.where(mask, values[np.maximum(self.index, 0)], 0)

    def _spread(self, values: jax.Array) -> jax.Array:
        """:meth:`take` of an affine map: reshape, transpose, flip and broadcast."""
        tail = values.shape[1:]
        dims, perm, reversed_axes = self._source_axes()
        moved = jnp.flip(jnp.transpose(values.reshape(*dims, *tail),
                                       (*perm, *range(len(dims), len(dims) + len(tail)))),
                         reversed_axes)
        ones = [size if stride else 1 for size, stride in self.axes]
        spread = jnp.broadcast_to(moved.reshape(*ones, *tail),
                                  (*[size for size, _ in self.axes], *tail))
        return spread.reshape(self.index.size, *tail)

    def _tiled(self, values: jax.Array) -> jax.Array:
        """:meth:`_spread` with each repeated axis of at most :data:`TILED_REPEATS` copies that
        lies outside another made by concatenating its copies along the axis inside it.

        A broadcast makes the repeated axis a dimension of its own, and XLA:TPU tiles the
        two innermost dimensions of an array: a GRU's ``(B, H) -> (B, 3H)`` map as
        ``(B, 3, H)`` puts the 3 copies inside tiles of 4 rows and the reshape to ``(B, 3H)``
        moves every element again (measured on a TPU v5e, hidden 1024, batch 64: 2.7 µs per
        step of the per-step ES-D-RTRL's 25.8). Concatenated along ``H`` the copies are
        whole tiles.
        """
        tail = values.shape[1:]
        dims, perm, reversed_axes = self._source_axes()
        cur = jnp.flip(jnp.transpose(values.reshape(*dims, *tail),
                                     (*perm, *range(len(dims), len(dims) + len(tail)))),
                       reversed_axes)
        groups = [[a] for a, (_, stride) in enumerate(self.axes) if stride]  # per dim of cur
        for a in reversed(range(len(self.axes))):
            size, stride = self.axes[a]
            if stride:
                continue
            inner = next((g for g, axes in enumerate(groups) if axes[0] == a + 1), None)
            if inner is not None and size <= TILED_REPEATS:
                cur = jnp.concatenate([cur] * size, axis=inner)
                groups[inner] = [a, *groups[inner]]
            else:  # an innermost repeat (each value in place), or many copies: a broadcast
                at = sum(1 for axes in groups if axes[0] < a)
                cur = jnp.broadcast_to(jnp.expand_dims(cur, at),
                                       (*cur.shape[:at], size, *cur.shape[at:]))
                groups.insert(at, [a])
        return cur.reshape(self.index.size, *tail)

    def sum_into(self, values: jax.Array) -> jax.Array:
        """The transpose of :meth:`take`: ``out[s] = Σ_{p: index[p] = s} values[p]``."""
        tail = values.shape[1:]
        if self.axes is None:
            target = np.where(self.index >= 0, self.index, self.source_size)
            return jax.ops.segment_sum(values, target,
                                       num_segments=self.source_size + 1)[:self.source_size]
        spread = values.reshape(*[size for size, _ in self.axes], *tail)
        summed = jnp.sum(spread, axis=tuple(a for a, (_, stride) in enumerate(self.axes)
                                             if not stride))
        dims, perm, reversed_axes = self._source_axes()
        inverse = np.argsort(perm)
        moved = jnp.transpose(jnp.flip(summed, reversed_axes),
                              (*inverse, *range(len(dims), len(dims) + len(tail))))
        return moved.reshape(self.source_size, *tail)
