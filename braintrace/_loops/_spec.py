"""Which loop runs a sequence, chosen in one place.

Three loops run a sequence of ``T`` steps, all with memory independent of
``T`` (but for the window):

* :class:`PerStep`: one step at a time (``_per_step.py``);
* :class:`Blocked`: the traces advanced ``K`` steps at once (``_blocked.py``);
* :class:`Windowed`: exact reverse mode inside windows of ``K`` steps, the traces
  carrying credit across windows (``_windowed.py``); BPTT is one window over
  the whole sequence, truncated BPTT windows with no traces.

:func:`choose_loop` picks one from what the caller asks (``chunk_size``,
``block_size``) and what the algorithm's rules offer (a blocked form, windowed
mode, a learning signal of their own); nothing else decides it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from braintrace._algorithms import GraphRules
from braintrace._arguments import check_integer
from braintrace._loops._blocked import stacked_bytes_per_step

__all__ = ["BLOCK_MEMORY_BUDGET", "DEFAULT_BLOCK_SIZE", "MIN_DEFAULT_BLOCK_SIZE", "Blocked",
           "LoopSpec", "PerStep", "Windowed", "check_positive", "choose_loop",
           "default_block_size"]

DEFAULT_BLOCK_SIZE = 32
"""The most steps per block when the caller does not choose ``block_size`` and the rules have
a blocked form (:func:`default_block_size`)."""

MIN_DEFAULT_BLOCK_SIZE = 2
"""The fewest steps per default block: blocks of 2 merge each step's same-step and temporal
weight products at the per-step form's memory."""

BLOCK_MEMORY_BUDGET = 256 * 2**20
"""Bytes of stacked steps a default block may hold (:func:`default_block_size`)."""


@dataclasses.dataclass(frozen=True)
class PerStep:
    """The per-step loop."""

    defers: ClassVar[bool] = True
    """Its carry holds a step's trace update until the next step applies it."""


@dataclasses.dataclass(frozen=True)
class Blocked:
    """The time-blocked loop, ``size`` steps per block (the last block may be shorter)."""

    size: int
    defers: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class Windowed:
    """The windowed loop, ``size`` steps per window (``size`` divides the sequence length)."""

    size: int
    defers: ClassVar[bool] = False


LoopSpec = PerStep | Blocked | Windowed


def check_positive(name: str, value: Any, *, length: int | None = None) -> int:
    """``value`` as an int, after checking it is a positive integer (dividing ``length``).

    Raises:
        ArgumentTypeError: It is not an integer (a float or a bool is not one; NumPy
            integers are); a ``TypeError`` that is also a ``ValueError``.
        ValueError: It is below 1 or does not divide ``length``.
    """
    value = check_integer(name, value, minimum=1)
    if length is not None and length % value:
        raise ValueError(f"{name}={value} must divide the sequence length {length}.")
    return value


def default_block_size(rules: GraphRules, most: int = DEFAULT_BLOCK_SIZE) -> int:
    """Steps per block when the caller does not choose: as many as fit
    :data:`BLOCK_MEMORY_BUDGET`, between :data:`MIN_DEFAULT_BLOCK_SIZE` and ``most``
    (:data:`DEFAULT_BLOCK_SIZE` unless the caller has a longer stretch to cover, as the
    trainer's windows between two updates).

    ``K = clamp(⌊BLOCK_MEMORY_BUDGET / stacked bytes per step⌋, 2, most)``, the bytes per step
    counted from the graph's shapes (``_blocked.stacked_bytes_per_step``): a block holds ``K``
    steps of every relation's input and output-sized values, which for a large network (B 32,
    131,072 neurons: 64 MiB per step for ES-D-RTRL) would be gigabytes at ``K = 32``.

    Example:
        >>> from braintrace._loops import default_block_size
        >>> import braintrace, jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> default_block_size(braintrace.compile(model, 'd_rtrl', jnp.ones((3,))).rules)
        32
    """
    fits = BLOCK_MEMORY_BUDGET // max(stacked_bytes_per_step(rules), 1)
    return int(min(max(fits, MIN_DEFAULT_BLOCK_SIZE), most))


def choose_loop(rules: GraphRules, *, length: int, chunk_size: int | None = None,
                block_size: int | None = None) -> LoopSpec:
    """The loop that runs a sequence of ``length`` steps under ``rules``.

    Args:
        rules: The algorithm bound to the graph.
        length: The number of time steps.
        chunk_size: Windowed mode with windows of this many steps (dividing
            ``length``); ``None``: not windowed (BPTT then takes one window of
            ``length`` steps).
        block_size: Time blocks of the traces outside windowed mode; ``None``:
            :func:`default_block_size` (32 steps, fewer for a network whose
            stacked steps exceed 256 MiB, at least 2) where the rules have a
            blocked form, else the per-step loop (always, for rules that keep no
            traces: FPTT's).

    Raises:
        ValueError: An argument is not a positive int, ``chunk_size`` does not
            divide ``length``, or the rules do not support what is asked (the
            message names the algorithm and what to do).

    Example:
        >>> from braintrace._loops import Blocked, choose_loop
        >>> import braintrace, jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((3,)))
        >>> choose_loop(learner.rules, length=100)
        Blocked(size=32)
        >>> choose_loop(learner.rules, length=100, chunk_size=10)
        Windowed(size=10)
    """
    if chunk_size is not None:
        chunk_size = check_positive("chunk_size", chunk_size, length=length)
        if not rules.supports_windowed:
            raise ValueError(
                f"Algorithm '{rules.name}' with these settings is a single-step rule (e.g. "
                "EProp(feedback='random'), ThreeFactor, signal='fast'); call it without "
                "chunk_size.")
        return Windowed(chunk_size)
    if rules.needs_window:
        if rules.window is not None:
            raise ValueError(
                f"Algorithm '{rules.name}' injects synthetic gradients at window boundaries: "
                "pass chunk_size=K (windowed mode).")
        return Windowed(length)
    if block_size is None:
        return Blocked(default_block_size(rules)) if rules.supports_blocks else PerStep()
    block_size = check_positive("block_size", block_size)
    if not rules.traced:  # no traces to advance in blocks: every block size is per step
        return PerStep()
    if block_size > 1 and not rules.supports_blocks:
        raise ValueError(
            f"Algorithm '{rules.name}' has no time-blocked form for this model; pass "
            "block_size=1 (or leave it unset).")
    return Blocked(block_size) if block_size > 1 else PerStep()
