"""The time loops: run a sequence under an algorithm's rules, with memory independent of ``T``.

Design note. The algorithms (``braintrace/_algorithms``) are rules per relation
and hooks, bound to a graph once (:class:`~braintrace._algorithms.GraphRules`);
they never run a loop. This package runs them over a sequence. A run is a
:class:`LoopContext` (built once: rules, loss, Params, operands), a loop
specification chosen in one place (:func:`choose_loop`: :class:`PerStep`,
:class:`Blocked`, :class:`Windowed`) and one entry point, :func:`run`, over a
:class:`ScanCarry` that every loop takes and returns with nothing pending (the
per-step loop may leave its last trace update pending for the next piece of
the sequence: ``run(..., finish=False)``, then :func:`finish_carry`).

Modules, imports pointing one way: ``_context``; ``_masks`` (what a mask
ignores is never read); ``_step`` (one step's loss terms and Jacobians);
``_groups`` (several steps per loop iteration on accelerators); ``_per_step`` (the carry, the per-step loop, the final gradients, evolution
without gradients); ``_blocked``; ``_windowed``; ``_spec`` (the choice);
``_run`` (the entry point).

A new loop is a module here with a ``run_<loop>(ctx, carry, xs, ys, weights, ...,
reaches=None)`` (with a mask, each step's inputs and targets go through
``_masks.ignore_masked`` with its ``reaches`` flags as the loop reads them), a spec
record in ``_spec`` (its ``defers``: whether its carry holds a step's trace update for
the next step; and its case in :func:`choose_loop`), and its case in :func:`run`.
"""

from braintrace._loops._context import LoopContext as LoopContext
from braintrace._loops._masks import ignore_masked as ignore_masked
from braintrace._loops._masks import reaches_scored as reaches_scored
from braintrace._loops._per_step import ScanCarry as ScanCarry
from braintrace._loops._per_step import evolve as evolve
from braintrace._loops._per_step import finish_carry as finish_carry
from braintrace._loops._per_step import init_carry as init_carry
from braintrace._loops._per_step import param_gradients as param_gradients
from braintrace._loops._per_step import restart_sums as restart_sums
from braintrace._loops._run import run as run
from braintrace._loops._spec import BLOCK_MEMORY_BUDGET as BLOCK_MEMORY_BUDGET
from braintrace._loops._spec import BLOCK_SPEED_BUDGET as BLOCK_SPEED_BUDGET
from braintrace._loops._spec import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from braintrace._loops._spec import TRACE_BOUND_BLOCK_SIZE as TRACE_BOUND_BLOCK_SIZE
from braintrace._loops._spec import TRACE_BOUND_RATIO as TRACE_BOUND_RATIO
from braintrace._loops._spec import Blocked as Blocked
from braintrace._loops._spec import LoopSpec as LoopSpec
from braintrace._loops._spec import PerStep as PerStep
from braintrace._loops._spec import Windowed as Windowed
from braintrace._loops._spec import check_positive as check_positive
from braintrace._loops._spec import choose_loop as choose_loop
from braintrace._loops._spec import default_block_size as default_block_size
from braintrace._loops._step import step_jacobians as step_jacobians

__all__ = ["BLOCK_MEMORY_BUDGET", "BLOCK_SPEED_BUDGET", "DEFAULT_BLOCK_SIZE",
           "TRACE_BOUND_BLOCK_SIZE", "TRACE_BOUND_RATIO", "Blocked", "LoopContext", "LoopSpec",
           "PerStep", "ScanCarry", "Windowed", "check_positive", "choose_loop",
           "default_block_size", "evolve", "finish_carry", "ignore_masked", "init_carry",
           "param_gradients", "reaches_scored", "restart_sums", "run", "step_jacobians"]
