"""``braintrace.compile``: a stateful model and an algorithm to an :class:`OnlineLearner`."""

from __future__ import annotations

import warnings
from typing import Any

import jax
from flax import nnx

from braintrace._algorithms import AbstractAlgorithm, check_trace_dtype, get_algorithm
from braintrace._compiler import flax_cell_advice
from braintrace._drivers._inputs import check_example_batch, shape_of
from braintrace._drivers._learner import OnlineLearner
from braintrace._drivers._sharding import check_mesh
from braintrace._drivers._states import (
    check_batch_size,
    check_sample_shapes,
    init_states,
    runs_at_batch_size,
)
from braintrace._hidden import state_batch_size

__all__ = ["compile"]


def compile(
    model: nnx.Module,
    algorithm: str | AbstractAlgorithm,
    example_x: Any,
    *,
    batch_size: int | None = None,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | None = "data",
    neuron_axis: str | None = None,
    trace_dtype: Any = None,
) -> OnlineLearner:
    """Compiles a stateful model for online learning with ``algorithm``.

    Initialises the hidden states for ``batch_size`` (when given), compiles one
    step into an eligibility-trace graph and initialises the traces.

    Args:
        model: An NNX module whose call ``model(x)`` is one time step.
        algorithm: An instance (``braintrace.DRTRL()``) or a name: ``'bptt'``,
            ``'d_rtrl'``, ``'es_d_rtrl'``, ``'pp_prop'``, ``'eprop'``,
            ``'ostl_recurrent'``, ``'ostl_feedforward'``, ``'rtrl'``, ``'snap'``,
            ``'uoro'``, ``'three_factor'``.
        example_x: The input of one step (with its batch axis, if batched).
        batch_size: Batch size to initialise hidden states for; ``None`` keeps
            the states as they are.
        strict: Refuse a model whose gradient under ``algorithm`` would not be
            BPTT's: an approximation of the graph's traces
            (``learner.graph.approximations``; BPTT keeps none and is exact on
            every model) or of the algorithm itself
            (``algorithm.approximations(graph)``); ``learner.report()`` lists both.
        mesh: Data parallel over the devices of this mesh: the batch axis of
            inputs, targets, hidden states and traces is split over its axis
            ``data_axis``; Params are replicated and XLA sums the gradients over
            the devices. ``None`` runs on the default device.
        data_axis: The name of the mesh axis the batch is split over. With a
            ``neuron_axis``, the mesh may lack it (or it may be ``None``): the
            batch is then not split.
        neuron_axis: The name of the mesh axis the hidden (post-synaptic) units
            are split over, ``None`` for none. Params, hidden states, traces and
            the optimiser state are split by neuron: a Param along its
            ``out_sharding`` metadata (Flax's ``nnx.with_partitioning``) or else
            its last axis (``ETPLinear.kernel`` by output, ``ETPSparseLinear.weight``
            by synapse: keep the synapses in post-synaptic order), a hidden state
            along its feature axis, a trace as the Param or unit it belongs to.
            XLA inserts the communication; gradients are the one-device ones.
        trace_dtype: The dtype the eligibility traces are stored in, e.g.
            ``jnp.bfloat16`` to halve their memory and the bytes each update moves;
            ``None`` (the default): the Params' dtype. Each update is computed in
            float32 (or ``trace_dtype`` if wider) from the stored trace and rounded once
            when stored; scalars (ES-D-RTRL's bias correction) keep their dtype. For
            :class:`~braintrace.DRTRL`, :class:`~braintrace.ESDRTRL` (``pp_prop``),
            :class:`~braintrace.EProp`, the OSTL variants and
            :class:`~braintrace.ThreeFactor`. Tolerance: with bfloat16 traces each
            Param's gradient is within 1e-2 (relative) of the float32 traces' one in the
            tests (T = 8; D-RTRL per step, ES-D-RTRL in time blocks). Rounding to
            bfloat16's 8 significant bits at every store adds up over long sequences, most
            in a trace that settles under a slow leak (a leaky readout's bias, τ = 20
            steps: 5% off after 200 steps of the per-step loop, 0.8% in the default time
            blocks, which store once per block). The state of the pure API (``online.init``) and
            checkpoints hold the traces in this dtype. On the CPU bfloat16 traces run
            slower than float32 ones (XLA:CPU converts them element by element); they
            are for accelerators.

    Returns:
        An :class:`OnlineLearner`.

    Raises:
        ValueError: With a ``mesh``: it has no axis ``data_axis`` (or
            ``neuron_axis``), ``batch_size`` is missing or not divisible by that
            axis's size, or a Param's neuron axis does not divide by the
            ``neuron_axis`` size (the message names it); a leaf
            of ``example_x`` does not lead with the batch size; a hidden state was
            declared with a batch axis (see :func:`check_sample_shapes`); ``trace_dtype``
            is float64 without ``jax_enable_x64``, or given to an algorithm that does not
            take it (BPTT keeps no traces). Nothing is changed then.
        TypeError: ``trace_dtype`` is not a floating-point dtype (an
            ``ArgumentTypeError``, also a ``ValueError``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.rnn = layers.LIF(4)
        ...         self.w_in = layers.ETPLinear(3, 4, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.rnn(self.w_in(x))
        >>> learner = braintrace.compile(Net(nnx.Rngs(0)), 'd_rtrl', jnp.ones((2, 3)),
        ...                              batch_size=2)
        >>> learner.graph.traced_param_paths
        ('w_in.bias', 'w_in.kernel')

        The traces in bfloat16:

        >>> learner = braintrace.compile(Net(nnx.Rngs(0)), 'd_rtrl', jnp.ones((2, 3)),
        ...                              batch_size=2, trace_dtype=jnp.bfloat16)
        >>> {str(a.dtype) for a in jax.tree.leaves(learner.traces)}
        {'bfloat16'}
    """
    algorithm = get_algorithm(algorithm)
    trace_dtype = _check_trace_dtype(algorithm, trace_dtype)
    if batch_size is not None:
        batch_size = check_batch_size("compile: batch_size", batch_size)
    if mesh is not None:
        check_mesh(mesh, data_axis, batch_size if batch_size is not None
                   else state_batch_size(model), neuron_axis)
    batched = batch_size if batch_size is not None else state_batch_size(model)
    check_example_batch(example_x, batched)
    check_sample_shapes(model, example_x, batched)
    if batch_size is not None:
        init_states(model, batch_size)
    try:
        learner = OnlineLearner(model, algorithm, example_x, strict=strict, mesh=mesh,
                                data_axis=data_axis, neuron_axis=neuron_axis,
                                trace_dtype=trace_dtype)
    except (ValueError, TypeError) as err:
        hint = None if batched is not None else _missing_batch_size(model, example_x)
        if hint is None:
            raise
        raise ValueError(hint) from err
    for sentence in flax_cell_advice(learner.graph, learner.algorithm):
        warnings.warn(f"braintrace.compile: {sentence} learner.report() lists it; strict=True "
                      "refuses it.", UserWarning, stacklevel=2)
    return learner


def _missing_batch_size(model: nnx.Module, example_x: Any) -> str | None:
    """Why a model with per-sample hidden states failed on ``example_x``, when the example
    leads with a batch axis the model runs at (``batch_size`` was not given); else ``None``."""
    leading = {shape_of(a)[0] if shape_of(a) else None for a in jax.tree.leaves(example_x)}
    if len(leading) != 1 or None in leading:
        return None
    n = leading.pop()
    if runs_at_batch_size(model, example_x, None) or not runs_at_batch_size(model, example_x, n):
        return None  # the model runs per sample (it failed for another reason), or not at n
    shapes = ", ".join(str(shape_of(a)) for a in jax.tree.leaves(example_x))
    return (f"braintrace.compile: example_x has shape {shapes}, a batch of {n}, but the "
            "model's hidden states hold one sample: compile was given no batch_size. Pass it: "
            f"braintrace.compile(model, algorithm, example_x, batch_size={n}). Nothing was "
            "changed.")


def _check_trace_dtype(algorithm: AbstractAlgorithm, trace_dtype: Any) -> Any:
    """``trace_dtype`` checked (``check_trace_dtype``) and taken by ``algorithm``."""
    dtype = check_trace_dtype(trace_dtype)
    if dtype is not None and not algorithm.supports_trace_dtype:
        raise ValueError(
            f"compile: trace_dtype={dtype} stores eligibility traces in another dtype, for "
            "DRTRL, ESDRTRL (pp_prop), EProp, OSTLRecurrent, OSTLFeedforward and "
            f"ThreeFactor; algorithm '{algorithm.name}' ({type(algorithm).__name__}) does "
            "not take it. Leave trace_dtype=None.")
    return dtype
