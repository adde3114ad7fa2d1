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

from braintrace._algorithms import GATHER_BOUND, GraphRules
from braintrace._arguments import check_integer
from braintrace._loops._blocked import stacked_bytes_per_step
from braintrace._platform import tpu_formulations

__all__ = ["BLOCK_MEMORY_BUDGET", "BLOCK_SPEED_BUDGET", "DEFAULT_BLOCK_SIZE",
           "MIN_DEFAULT_BLOCK_SIZE", "TRACE_BOUND_BLOCK_SIZE", "TRACE_BOUND_RATIO", "Blocked",
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

BLOCK_SPEED_BUDGET = 32 * 2**20
"""On a TPU, the bytes of stacked steps a default block stays within for speed, where shorter
blocks cost the traces little (:func:`default_block_size`): a block's stacked values are
written once and read back by its trace update, and past this size that costs more than the
merged matrix products save. On a TPU v5e (``benchmarks/results/throughput_tpu_h1024_blocks.json``,
ES-D-RTRL inside a jit step, GRU and LIF hidden 1024, batch 64, T 100): 8 steps per block
(26 / 16 MiB stacked) ran at 0.88x / 0.87x BPTT's time, 16 steps (52 / 32 MiB) at 1.04x /
0.95x, 32 steps at 1.05x / 0.94x; at hidden 256 (T 1000, ``throughput_tpu_h256_blocks.json``;
7 / 4 MiB at 32 steps) 32 steps were fastest (0.76x / 0.82x; 8 steps 0.85x / 0.99x).

Not where the traces are large: a block reads and writes them once, so ``K`` steps per block
cost ``2·Tr/K`` bytes per step for traces of ``Tr`` bytes (D-RTRL at hidden 1024, batch 64:
817 MiB of traces, 51 MiB per step at ``K = 32``, 204 MiB at ``K = 8``). Nor in a network with a
sparse relation: its blocks also merge each step's sums over gathered rows, which pay per row
read. 131,072 ALIF neurons, batch 32, T 30 (64 MiB per step;
``scale_tpu_131k_speed_budget.json``): 3 steps per block, the memory budget's, 0.201 s per
update, 2 steps 0.218 s (another run, whose record was cut short: 4 steps 0.211 s, 6 steps
0.204 s)."""


TRACE_BOUND_BLOCK_SIZE = 64
"""On a TPU, the most steps per default block where the traces bound the step: read and
written once per block, at ``DEFAULT_BLOCK_SIZE`` steps they would cost
:data:`TRACE_BOUND_RATIO` times the bytes per step that a step stacks, or more
(``2·Tr / 32 >= 3·s``). Given the sequence's length, such blocks are as long as the memory
budget, this and the length allow, then evened out over the blocks that needs
(:func:`default_block_size`). On a TPU v5e (D-RTRL inside a jit step, hidden 1024, batch 64,
T 100, 817 / 787 MiB of traces, 3.8 / 4.0 MiB stacked per step; device time per step,
``benchmarks/results/throughput_tpu_h1024_long_blocks_gru.json`` and ``_snn.json`` against
``throughput_tpu_h1024_jit_device.json``): two blocks of 50 steps took 93.6 us (GRU) and
119.0 us (LIF) against 149.8 and 144.9 in blocks of 32 (three and a tail of 4: four passes
over the traces), with bfloat16 traces 70.4 / 78.6 against 102.5 / 111.0; blocks of 25 (LIF)
150.7. At hidden 256, batch 16, T 1000 (``throughput_tpu_h256_long_blocks.json``), blocks of
63 took 3.4 us (GRU) and 4.3 us (LIF) against 4.5 and 4.8 in blocks of 32."""

TRACE_BOUND_RATIO = 3
"""How many times a step's stacked bytes the traces' bytes per step (at ``DEFAULT_BLOCK_SIZE``
steps a block) must be for :data:`TRACE_BOUND_BLOCK_SIZE`'s longer blocks. Every network
measured at or above it ran faster in longer blocks (D-RTRL): 12 to 14 (hidden 1024, batch
64, float32 traces), 6.1 to 6.8 (the same in bfloat16) and 3.2 (LIF) to 3.9 (GRU) (hidden 256,
batch 16, float32: 15 MiB of traces, 0.24 MiB stacked per step). Below it nothing was
timed (hidden 256 with bfloat16 traces: 1.6 to 2.0; ES-D-RTRL's traces of ``B·(I + O)``
values: 0.02 to 0.05): such networks keep blocks of 32."""


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


def default_block_size(rules: GraphRules, most: int = DEFAULT_BLOCK_SIZE,
                       length: int | None = None) -> int:
    """Steps per block when the caller does not choose: as many as fit
    :data:`BLOCK_MEMORY_BUDGET` (and, on a TPU, :data:`BLOCK_SPEED_BUDGET`), between
    :data:`MIN_DEFAULT_BLOCK_SIZE` and ``most`` (:data:`DEFAULT_BLOCK_SIZE` unless the caller
    has a longer stretch to cover, as the trainer's windows between two updates); on a TPU,
    where the traces bound the step and the sequence's ``length`` is given, up to
    :data:`TRACE_BOUND_BLOCK_SIZE`, evened out over the blocks (below).

    With ``s`` the stacked bytes per step, counted from the graph's shapes
    (``_blocked.stacked_bytes_per_step``): ``K = clamp(⌊BLOCK_MEMORY_BUDGET / s⌋, 2, most)``;
    where the programs are a TPU's (``_platform.tpu_formulations``), no relation is a sparse
    one (``_algorithms.GATHER_BOUND``), and the traces' bytes ``Tr`` (``GraphRules.trace_bytes``) read
    and written once per block of ``k`` steps add no more per step than a step stacks,
    ``2·Tr / k <= s`` with ``k`` the largest power of two at most ``⌊BLOCK_SPEED_BUDGET / s⌋``
    (and at least 2), ``⌊BLOCK_MEMORY_BUDGET / s⌋`` is first lowered to ``k``. But first,
    where ``2·Tr / most >= TRACE_BOUND_RATIO·s`` (the traces' bytes per step at ``most``
    steps are many times a step's stacks: :data:`TRACE_BOUND_RATIO`), ``length`` is given
    and ``L = min(⌊BLOCK_MEMORY_BUDGET / s⌋, TRACE_BOUND_BLOCK_SIZE, length)`` exceeds
    ``most``: ``n = ⌈length / L⌉`` blocks (the
    fewest passes over the traces) of ``K = ⌈length / n⌉`` steps (T = 100 in two blocks of
    50, not 64 and a tail of 36).
    A block holds ``K`` steps of every relation's input and output-sized values, which for a
    large network (B 32, 131,072 neurons: 64 MiB per step for ES-D-RTRL) would be gigabytes at
    ``K = 32``. Every ``K`` gives the per-step form's gradients.

    Example:
        >>> from braintrace._loops import default_block_size
        >>> import braintrace, jax.numpy as jnp
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)), layers.LIF(4))
        >>> default_block_size(braintrace.compile(model, 'd_rtrl', jnp.ones((3,))).rules)
        32
    """
    per_step = max(stacked_bytes_per_step(rules), 1)
    fits = BLOCK_MEMORY_BUDGET // per_step
    if tpu_formulations() and not any(r.primitive in GATHER_BOUND for r in rules.relations):
        longest = min(fits, TRACE_BOUND_BLOCK_SIZE, length or 0)
        if 2 * rules.trace_bytes >= TRACE_BOUND_RATIO * most * per_step and longest > most:
            return -(-length // -(-length // longest))  # ⌈T / n⌉, n = ⌈T / longest⌉ blocks
        fast = max(_power_of_two_at_most(BLOCK_SPEED_BUDGET // per_step), MIN_DEFAULT_BLOCK_SIZE)
        if 2 * rules.trace_bytes <= fast * per_step:
            fits = min(fits, fast)
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
            stacked steps exceed 256 MiB, at least 2; on a TPU up to 64 where the
            traces bound the step) where the rules have a blocked form, else the
            per-step loop (always, for rules that keep no traces: FPTT's).

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
        return (Blocked(default_block_size(rules, length=length)) if rules.supports_blocks
                else PerStep())
    block_size = check_positive("block_size", block_size)
    if not rules.traced:  # no traces to advance in blocks: every block size is per step
        return PerStep()
    if block_size > 1 and not rules.supports_blocks:
        raise ValueError(
            f"Algorithm '{rules.name}' has no time-blocked form for this model; pass "
            "block_size=1 (or leave it unset).")
    return Blocked(block_size) if block_size > 1 else PerStep()


def _power_of_two_at_most(n: int) -> int:
    """The largest power of two ``<= n`` (``0`` for ``n < 1``)."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 0
