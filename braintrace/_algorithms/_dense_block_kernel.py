"""D-RTRL's block update of a dense trace in one pass over it: a Pallas TPU kernel.

At the end of a block of ``K`` steps, D-RTRL's time-blocked rule
(``_d_rtrl._input_block``) reads a dense relation's per-sample trace ``ε (B, I, O)`` twice,
once for the gradient term of the trace entering the block and once to advance it:

.. math::

    c = \\sum_b \\varepsilon_b \\operatorname{diag}(\\beta_{0,b}), \\qquad
    \\varepsilon_b \\leftarrow \\varepsilon_b \\operatorname{diag}(\\lambda_{0,b})
    + x_b^\\top g_b,

``β_0, λ_0 (B, O)`` scaling the output axis, ``x (K, B, I)`` the block's inputs and
``g (K, B, O)`` their gains (``x_b (K, I)``, ``g_b (K, O)``: sample ``b``'s). XLA computes
the two in separate fusions, each reading the whole trace (compiled for a TPU v5e, GRU
hidden 1,024, batch 64: 768 MiB each, per block). The kernel reads each ``(I_t, O_t)`` tile
of ``ε_b`` once, adds ``ε_b β_{0,b}`` into the tile of ``c`` (held across the batch, the
grid's innermost axis), and writes ``ε_b λ_{0,b} + x_b^\\top g_b`` in its place: the trace
read once and written once per block, the floor of ``benchmarks/_floor.py``.

:func:`reference` is the same update in plain JAX (XLA's formulation, and the tests'
oracle); :func:`tile_sizes` says whether a trace's shape tiles. Imported on use (Pallas is
not needed off a TPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["INPUT_TILES", "OUTPUT_TILES", "block_update", "reference", "tile_sizes"]

INPUT_TILES = (512, 256, 128)
"""Tile rows ``I_t`` tried in order: the first that divides ``I``."""

OUTPUT_TILES = (1024, 512, 256, 128)
"""Tile columns ``O_t`` tried in order: the first that divides ``O``."""


def tile_sizes(inputs: int, outputs: int) -> tuple[int, int] | None:
    """``(I_t, O_t)`` for a trace ``(B, inputs, outputs)``, or ``None`` where a side has no
    tile (the kernel does not apply).

    Example:
        >>> from braintrace._algorithms._dense_block_kernel import tile_sizes
        >>> tile_sizes(1024, 3072), tile_sizes(384, 128), tile_sizes(100, 128)
        ((512, 1024), (128, 128), None)
    """
    rows = next((t for t in INPUT_TILES if inputs % t == 0), None)
    columns = next((t for t in OUTPUT_TILES if outputs % t == 0), None)
    return None if rows is None or columns is None else (rows, columns)


def _compute_dtype(*arrays: jax.Array):
    """At least float32: a bfloat16 trace is widened for the update and its sum."""
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def reference(eps: jax.Array, lam0: jax.Array, beta0: jax.Array, x: jax.Array,
              gain: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ε_new, c)`` in plain JAX: ``ε_new`` in ``ε``'s dtype, ``c`` in the compute dtype
    (at least float32).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._dense_block_kernel import reference
        >>> eps = jnp.ones((2, 3, 4))
        >>> new, c = reference(eps, 2 * jnp.ones((2, 4)), jnp.ones((2, 4)),
        ...                    jnp.ones((5, 2, 3)), jnp.ones((5, 2, 4)))
        >>> float(new[0, 0, 0]), float(c[0, 0])  # 1·2 + 5 steps of 1·1; two samples
        (7.0, 2.0)
    """
    dtype = _compute_dtype(eps, lam0, beta0, x, gain)
    e = eps.astype(dtype)
    c = jnp.einsum("bio,bo->io", e, beta0.astype(dtype))
    step = jnp.einsum("kbi,kbo->bio", x.astype(dtype), gain.astype(dtype))
    return (e * lam0.astype(dtype)[:, None, :] + step).astype(eps.dtype), c


def _kernel(eps_ref, lam_ref, beta_ref, x_ref, gain_ref, new_ref, c_ref, *, dtype):
    """One tile of one sample (module docstring); ``c``'s tile stays across the batch."""

    @pl.when(pl.program_id(2) == 0)
    def _():
        c_ref[...] = jnp.zeros(c_ref.shape, c_ref.dtype)

    e = eps_ref[0].astype(dtype)  # (I_t, O_t)
    c_ref[...] += e * beta_ref[0].astype(dtype)  # (1, O_t) along the output axis
    step = jnp.dot(x_ref[0].astype(dtype), gain_ref[0].astype(dtype),
                   preferred_element_type=dtype, precision=jax.lax.Precision.HIGHEST)
    new_ref[0] = (e * lam_ref[0].astype(dtype) + step).astype(new_ref.dtype)


def block_update(eps: jax.Array, lam0: jax.Array, beta0: jax.Array, x: jax.Array,
                 gain: jax.Array, *, interpret=False) -> tuple[jax.Array, jax.Array]:
    """:func:`reference` by the kernel (module docstring), ``ε``'s buffer updated in place;
    its shape must tile (:func:`tile_sizes`).

    Example:
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithms._dense_block_kernel import block_update, reference
        >>> eps = jnp.arange(2 * 128 * 128.0).reshape(2, 128, 128) / 1e4
        >>> args = (jnp.full((2, 128), 0.5), jnp.ones((2, 128)), jnp.ones((3, 2, 128)),
        ...         jnp.ones((3, 2, 128)))
        >>> got, want = block_update(eps, *args, interpret=True), reference(eps, *args)
        >>> all(bool(jnp.allclose(a, b)) for a, b in zip(got, want))
        True
    """
    batch, inputs, outputs = eps.shape
    steps = x.shape[0]
    tiles = tile_sizes(inputs, outputs)
    if tiles is None:
        raise ValueError(f"a trace of shape {eps.shape} does not tile: its inputs must be a "
                         f"multiple of {INPUT_TILES[-1]}, its outputs of {OUTPUT_TILES[-1]}.")
    rows, columns = tiles
    dtype = _compute_dtype(eps, lam0, beta0, x, gain)
    x_t = jnp.transpose(x, (1, 2, 0))  # (B, I, K): each sample's x_bᵀ
    gain_b = jnp.swapaxes(gain, 0, 1)  # (B, K, O)
    tile = pl.BlockSpec((1, rows, columns), lambda i, j, b: (b, i, j))
    along = pl.BlockSpec((1, 1, columns), lambda i, j, b: (b, 0, j))
    bytes_ = 2 * rows * columns * (2 * eps.dtype.itemsize + jnp.dtype(dtype).itemsize) + 2 * (
        rows + columns) * max(steps, 8) * jnp.dtype(dtype).itemsize
    call = pl.pallas_call(
        functools.partial(_kernel, dtype=dtype),
        grid=(inputs // rows, outputs // columns, batch),
        in_specs=[tile, along, along,
                  pl.BlockSpec((1, rows, steps), lambda i, j, b: (b, i, 0)),
                  pl.BlockSpec((1, steps, columns), lambda i, j, b: (b, 0, j))],
        out_specs=[tile, pl.BlockSpec((rows, columns), lambda i, j, b: (i, j))],
        out_shape=[jax.ShapeDtypeStruct(eps.shape, eps.dtype),
                   jax.ShapeDtypeStruct((inputs, outputs), dtype)],
        input_output_aliases={0: 0}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=int(bytes_ + 8 * 2**20)))
    along_rows = lambda a: a.reshape(batch, 1, outputs)
    return tuple(call(eps, along_rows(lam0), along_rows(beta0), x_t, gain_b))

