"""Spike rates of a model's spiking layers on real inputs, flagged when silent or saturated.

A spiking layer is any module with a ``spikes()`` method that returns its current
spikes (:class:`~braintrace.layers.LIF`, ``ALIF``, ``ConvLIF``, ...). A layer that
almost never fires passes almost no gradient (its surrogate derivative is read far
below threshold, and the layers it feeds see zeros); one that fires at most steps
carries little information and saturates its surrogate. Both are the classic
failure of a spiking network that does not learn, and both show on the first batch.
:meth:`~braintrace.OnlineTrainer.fit` logs the line :meth:`SpikeRates.line` after its
first batch and after its last (:func:`log_spike_rates`); :func:`spike_rates` measures
them in a loop of your own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._drivers._evaluate import batch_size_of
from braintrace._drivers._inputs import cast_inputs
from braintrace._drivers._model_state import strong
from braintrace._drivers._states import check_batch_size, init_states

__all__ = ["SATURATED", "SILENT", "SpikeRates", "log_spike_rates", "spike_rates"]

SILENT = 0.01
"""A layer whose mean rate (spikes per neuron and step) is below this is flagged silent."""

SATURATED = 0.5
"""A layer whose mean rate is above this is flagged saturated."""


class SpikeRates(NamedTuple):
    """The mean spike rate of each spiking layer over a batch of sequences.

    Attributes:
        rates: ``{path: rate}``, the layer's spikes per neuron and step, in model order.
        silent: The rate below which a layer is flagged silent.
        saturated: The rate above which a layer is flagged saturated.

    Example:
        >>> rates = SpikeRates({'l1.neuron': 0.04, 'l2.neuron': 0.0002})
        >>> rates.flagged
        {'l2.neuron': 'silent'}
        >>> print(rates.line())
        spike rates: l1.neuron 4.0%, l2.neuron 0.02% SILENT (< 1%: little gradient reaches
        or passes it; see docs/training_spiking.md)
    """

    rates: dict[str, float]
    silent: float = SILENT
    saturated: float = SATURATED

    @property
    def flagged(self) -> dict[str, str]:
        """``{path: 'silent' or 'saturated'}`` of the layers out of range."""
        flags = {}
        for path, rate in self.rates.items():
            if rate < self.silent:
                flags[path] = "silent"
            elif rate > self.saturated:
                flags[path] = "saturated"
        return flags

    def line(self) -> str:
        """One line: each layer's rate, the flagged ones in capitals, and why it matters."""
        flags = self.flagged
        parts = [f"{path} {_percent(rate)}" + (f" {flags[path].upper()}" if path in flags else "")
                 for path, rate in self.rates.items()]
        why = []
        if "silent" in flags.values():
            why.append(f"< {100 * self.silent:g}%: little gradient reaches or passes it")
        if "saturated" in flags.values():
            why.append(f"> {100 * self.saturated:g}%: its spikes carry little information")
        note = f" ({'; '.join(why)}; see docs/training_spiking.md)" if why else ""
        return "spike rates: " + ", ".join(parts) + note


def _percent(rate: float) -> str:
    """``0.04 -> '4.0%'``, ``0.0002 -> '0.02%'``: two significant digits below 1%."""
    return f"{100 * rate:.2g}%" if 0 < rate < 0.01 else f"{100 * rate:.1f}%"


def spiking_paths(model: nnx.Module) -> list[str]:
    """The paths of the modules of ``model`` that have a ``spikes()`` method, in model order.

    Example:
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), layers.LIF(3))
        >>> spiking_paths(model)
        ['layers.1']
    """
    return [".".join(str(p) for p in path) for path, module in nnx.iter_modules(model)
            if callable(getattr(module, "spikes", None))]


def spike_rates(model: nnx.Module, xs: Any, *, batch_size: int | None) -> SpikeRates:
    """The mean spike rate of each spiking layer of ``model`` over the inputs ``xs``.

    The model runs as :func:`braintrace.evaluate` runs it: a copy, from fresh hidden
    states, in its current mode, touching nothing. A layer's rate is the mean of its
    ``spikes()`` after each step over the steps, the samples and its neurons.

    Args:
        model: A stateful NNX module whose call ``model(x)`` is one time step.
        xs: Inputs, time axis leading (real data: a layer silent on zeros says nothing).
        batch_size: The batch size of ``xs`` (its second axis), or ``None`` for one
            sample without a batch axis.

    Returns:
        A :class:`SpikeRates`; its ``rates`` are empty when the model has no spiking layer.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> model = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), layers.LIF(3))
        >>> rates = braintrace.spike_rates(model, jnp.zeros((5, 4, 2)), batch_size=4)
        >>> rates.rates, rates.flagged
        ({'layers.1': 0.0}, {'layers.1': 'silent'})
    """
    if batch_size is not None:
        batch_size = check_batch_size("spike_rates: batch_size", batch_size)
    paths = spiking_paths(model)
    if not paths:
        return SpikeRates({})
    graphdef, state = nnx.split(model)
    per_layer = _RATES(graphdef, state, xs, batch_size)
    return SpikeRates(dict(zip(paths, np.asarray(per_layer).tolist(), strict=True)))


def _rates(graphdef: Any, state: Any, xs: Any, batch_size: int | None) -> jax.Array:
    """Each spiking layer's mean ``spikes()`` over the steps, samples and neurons."""
    model = nnx.merge(graphdef, state, copy=True)
    init_states(model, batch_size)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(strong, state)

    def step(state, x_t):
        m = nnx.merge(graphdef, state, copy=True)
        m(x_t)
        rates = [jnp.mean(module.spikes(), dtype=jnp.float32)
                 for _, module in nnx.iter_modules(m) if callable(getattr(module, "spikes", None))]
        return nnx.split(m)[1], jnp.stack(rates)

    return jnp.mean(jax.lax.scan(step, state, xs)[1], axis=0)


_RATES = jax.jit(_rates, static_argnames=("graphdef", "batch_size"))


def log_spike_rates(trainer: Any, history: Any, xs: Any, step: int, bar: Any) -> None:
    """``fit``'s probe: the rates on a batch's inputs ``xs`` into ``history.spike_rates``
    and, where the progress bar shows, one line above it. Nothing for a model without
    spiking layers."""
    learner = trainer.learner
    if not spiking_paths(learner.model):
        return
    example = learner._entry().example
    xs = cast_inputs(xs, example)  # as learner.evaluate casts them
    rates = spike_rates(learner.model, xs,
                        batch_size=batch_size_of(xs, example, learner._batch_size))
    history.spike_rates.append({"step": step, **rates.rates})
    if not bar.disable:
        bar.write(f"step {step}: {rates.line()}")
