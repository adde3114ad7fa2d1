"""The one entry point of the loops: run a sequence with the loop chosen for it."""

from __future__ import annotations

from typing import Any

import jax

from braintrace._loops._blocked import run_blocked
from braintrace._loops._context import LoopContext
from braintrace._loops._per_step import ScanCarry, run_per_step
from braintrace._loops._spec import Blocked, LoopSpec, PerStep, Windowed
from braintrace._loops._windowed import run_windowed
from braintrace._primitives import silent_fallback

__all__ = ["run"]


def run(ctx: LoopContext, spec: LoopSpec, carry: ScanCarry, xs: Any, ys: Any,
        weights: jax.Array, signal_inputs: Any = None, *, finish: bool = True,
        reaches: jax.Array | None = None) -> tuple[ScanCarry, jax.Array]:
    """Runs ``Σ_t w_t L_t`` over a sequence (time axis leading) with the loop ``spec``.

    Args:
        ctx: The context (rules, loss, Params, operands).
        spec: The loop (:func:`~braintrace._loops.choose_loop`).
        carry: The state entering the sequence: nothing pending, except that the
            per-step loop also takes a carry it returned with ``finish=False``.
        xs, ys: Inputs and targets, time axis leading.
        weights: ``(T,)`` weights ``w_t``.
        signal_inputs: The learning signal's per-step inputs (per-step loop only), or ``None``.
        finish: ``False``: the per-step loop leaves its last trace update pending
            (:func:`~braintrace._loops.finish_carry` applies it); other loops
            always finish.
        reaches: With a mask (weights that may be 0): whether each position is at or
            before a scored step of its sample (``braintrace._loops.reaches_scored`` of
            the whole sequence's weights, shaped as ``weights``); the loop then replaces
            what the mask ignores in each step's inputs and targets as it reads them
            (``braintrace._loops.ignore_masked``), never in a copy of the whole
            sequence. ``None``: no mask, the inputs are read as they are.

    Returns:
        ``(carry, losses)``: the carry after the last step (nothing pending; its sums give
        the gradients through ``param_gradients``) and each step's loss ``(T,)``.
    """
    if signal_inputs is not None and not isinstance(spec, PerStep):
        raise ValueError("A learning signal with per-step inputs runs in the per-step loop.")
    with silent_fallback():  # a step compiled already: a vmap of it loses nothing
        return _run(ctx, spec, carry, xs, ys, weights, signal_inputs, finish, reaches)


def _run(ctx, spec, carry, xs, ys, weights, signal_inputs, finish, reaches):
    """:func:`run` (its arguments)."""
    if isinstance(spec, PerStep):
        return run_per_step(ctx, carry, xs, ys, weights, signal_inputs, finish=finish,
                            reaches=reaches)
    if isinstance(spec, Blocked):
        return run_blocked(ctx, carry, xs, ys, weights, spec.size, reaches=reaches)
    if isinstance(spec, Windowed):
        return run_windowed(ctx, carry, xs, ys, weights, spec.size, reaches=reaches)
    raise TypeError(f"Unknown loop {spec!r}.")
