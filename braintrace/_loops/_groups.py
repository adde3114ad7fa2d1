"""Several time steps per iteration of a loop on accelerators.

A loop over time runs :func:`step_group` steps per iteration of its ``lax.scan``
(:func:`scan_grouped`): unrolled in the iteration's body, their per-step outputs stacked
once per iteration. On the CPU, one step per iteration.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["STEP_GROUP", "scan_grouped", "stack_group", "step_group"]

STEP_GROUP = 8
"""Steps per loop iteration on accelerators (:func:`step_group`)."""


def step_group(length: int) -> int:
    """How many steps of a loop over ``length`` steps each iteration runs and stacks.

    XLA:TPU lays a block's stacked per-step values out for the products that read them
    after the loop, with the step axis inside its tiles of 8 rows: stacking one step then
    rewrites part of every tile (measured on a TPU v5e, hidden 256, batch 16: 2.5 µs per
    step for a GRU's ``(16, 768)`` value, 16 µs for a readout's ``(16, 10)``, 40-75% of the
    step). :data:`STEP_GROUP` steps stacked at once fill whole tiles (D-RTRL on a two-layer
    LIF network: 21.5 -> 4.8 µs per step on the device; ES-D-RTRL on a GRU: 5.9 -> 2.9).
    The per-step loop stacks only the losses, but each iteration of a loop costs the
    device time of its own (the per-step ES-D-RTRL on a two-layer LIF network at hidden
    256, batch 16: its loop took 0.85 µs per step more than its body's ops, 13%; writing
    each step's loss into the ``(T,)`` losses another 0.14 µs). A loop of at most
    :data:`STEP_GROUP` steps runs as one group (131,072 neurons take blocks of 3), a
    longer one in groups of its largest divisor up to that. On the CPU, whose layouts are
    row-major, one step per iteration (grouping only adds compile time there). Chosen by
    the default backend when the loop is traced.
    """
    if jax.default_backend() == "cpu":
        return 1
    return max(g for g in range(1, min(STEP_GROUP, length) + 1) if length % g == 0)


def stack_group(values: list[jax.Array], steps_second: bool = False) -> jax.Array:
    """One group's per-step values ``(*shape)`` stacked: ``(g, *shape)``, or with
    ``steps_second`` ``(shape[0], g, *shape[1:])`` (scalars: ``(g,)`` either way).

    XLA lays a concatenation out with its concatenated axis major, so a stack along the
    second axis still holds the steps one after another in memory (whole tiles); the loop's
    stacked buffer keeps that order, and a product that reads the block sample by sample
    (ES-D-RTRL's decayed sums) reorders it once per block, fused into its own read. Stacked
    along the first axis, the same buffer took the layout that product reads, with the step
    axis inside its tiles, and every loop iteration wrote its group transposed (a GRU at
    hidden 1024, batch 64 on a TPU v5e: two ``(8, 64, 3072)`` transposing writes per
    iteration, 3.3 µs per step). A value the steps only slice from the loop's inputs keeps
    the first axis: its stack is the input group as laid out.

    Example:
        >>> import jax.numpy as jnp
        >>> values = [jnp.zeros((2, 3)), jnp.ones((2, 3))]
        >>> stack_group(values).shape, stack_group(values, steps_second=True).shape
        ((2, 2, 3), (2, 2, 3))
        >>> stack_group(values, steps_second=True)[0].tolist()
        [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    return jnp.stack(values, axis=1 if steps_second and values[0].ndim else 0)


def _steps_first(a: jax.Array, steps_second: bool) -> jax.Array:
    """Stacked groups ``(n, g, *shape)`` (``steps_second``: ``(n, shape[0], g, *shape[1:])``)
    as ``(n·g, *shape)``."""
    if steps_second and a.ndim > 2:
        a = jnp.swapaxes(a, 1, 2)
    return a.reshape(-1, *a.shape[2:])


def scan_grouped(step: Any, start: Any, inputs: Any, steps_second: Any = False
                 ) -> tuple[Any, Any]:
    """``jax.lax.scan(step, start, inputs)``, :func:`step_group` steps per iteration.

    ``steps_second``: a prefix of ``step``'s outputs (a bool per subtree) naming the
    outputs each group stacks with :func:`stack_group`'s ``steps_second``; the outputs are
    returned steps first either way.

    Example:
        >>> import jax.numpy as jnp
        >>> total, seen = scan_grouped(lambda c, x: (c + x, c), 0.0, jnp.arange(4.0))
        >>> float(total), seen.tolist()
        (6.0, [0.0, 0.0, 1.0, 3.0])
    """
    length = jax.tree.leaves(inputs)[0].shape[0]
    group = step_group(length)
    if group == 1:
        return jax.lax.scan(step, start, inputs)

    shapes = []  # each output's per-step shape, read while the loop's body is traced

    def steps(state, grouped):
        outs = []
        for k in range(group):
            state, out = step(state, jax.tree.map(lambda a, k=k: a[k], grouped))
            outs.append(out)
        shapes[:] = [jnp.shape(o) for o in jax.tree.leaves(outs[0])]
        return state, jax.tree.map(
            lambda flag, *sub: jax.tree.map(
                lambda *o: stack_group([_without_unit_tail(v) for v in o], flag), *sub),
            steps_second, *outs)

    split = lambda a: a.reshape(length // group, group, *a.shape[1:])
    state, stacked = jax.lax.scan(steps, start, jax.tree.map(split, inputs))
    stacked = jax.tree.map(
        lambda flag, sub: jax.tree.map(lambda a: _steps_first(a, flag), sub),
        steps_second, stacked)
    leaves, tree = jax.tree.flatten(stacked)
    return state, tree.unflatten([a.reshape(a.shape[0], *shape)
                                  for a, shape in zip(leaves, shapes, strict=True)])


def _without_unit_tail(value: jax.Array) -> jax.Array:
    """``value`` without its trailing axes of length 1, for stacking: a value of one state
    per unit, ``(B, N, 1)`` or ``D``'s ``(B, N, 1, 1)``, would otherwise be laid out with a
    unit axis in its tiles' rows (XLA:TPU's ``T(1,128)``), and each iteration's write of its
    group copied the loop's whole stacked buffer (D-RTRL on a two-layer LIF network at
    hidden 1024, batch 64, compiled for a TPU v5e: writes of 42-47k estimated cycles each,
    where the in-place writes of ``(B, N)`` tiles take 96, and three whole copies of the
    stacks, 369k each). The stacked steps get their axes back after the loop."""
    shape = jnp.shape(value)
    kept = len(shape)
    while kept > 1 and shape[kept - 1] == 1:
        kept -= 1
    return value if kept == len(shape) else jnp.reshape(value, shape[:kept])
