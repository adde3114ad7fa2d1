r"""Built-in tasks for demonstrations, tutorials, tests and benchmarks.

Each task is a frozen dataclass whose :meth:`sample` draws a :class:`Batch`
of sequences, time axis leading, ready for
``learner.etrace_grad(batch.xs, batch.ys, loss_fn, mask=batch.mask)``:

* :class:`SpikePatterns` — classify spatiotemporal Poisson spike patterns,
  answering after the pattern has ended (memory of a few tens of steps);
* :class:`DelayedMatchToSample` — the neuroscience task: two spiking stimuli
  separated by a delay, answer whether they were the same;
* :class:`Integrator` — regression onto a leaky integral of the inputs.

These need no downloads: every batch is generated from a PRNG key, and a
task's fixed structure (the class templates) from its ``seed``.

Three real data sets, with train / validation / test splits, need the optional
``tasks`` extra (``pip install -e ".[tasks]"``) and never download either:

* :class:`MNIST1D` — the MNIST-1D benchmark (Greydanus 2020), generated
  offline by the ``mnist1d`` package, 40 steps of one channel;
* :class:`SequentialDigits` — scikit-learn's 8×8 digits read pixel by pixel,
  64 steps of one channel;
* :class:`SpikingDigits` — the same digits latency-coded as spikes on 64
  channels.

Their :meth:`sample` draws a training batch; ``split('test')`` returns a whole
split as one :class:`Batch`. The class is scored at the last step.

The spiking modeller's kit (``docs/spiking_kit.md``): encoders from values and
signals to spikes (:func:`rate_encode`, :func:`poisson_encode`,
:func:`latency_encode`, :func:`delta_encode`), the per-step
:func:`cross_entropy` of a spiking readout with :func:`last_step_mask`, and the
activity regularisers :func:`firing_rate_penalty`,
:func:`silent_neuron_penalty` and :func:`overactivity_penalty`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from braintrace.tasks._batch import Batch as Batch
from braintrace.tasks._batch import accuracy as accuracy
from braintrace.tasks._datasets import MNIST1D as MNIST1D
from braintrace.tasks._datasets import SequentialDigits as SequentialDigits
from braintrace.tasks._datasets import SpikingDigits as SpikingDigits
from braintrace.tasks._encoders import delta_encode as delta_encode
from braintrace.tasks._encoders import latency_encode as latency_encode
from braintrace.tasks._encoders import poisson_encode as poisson_encode
from braintrace.tasks._encoders import rate_encode as rate_encode
from braintrace.tasks._event_datasets import NMNIST as NMNIST
from braintrace.tasks._event_datasets import SHD as SHD
from braintrace.tasks._event_datasets import SSC as SSC
from braintrace.tasks._event_datasets import AbstractEventDataset as AbstractEventDataset
from braintrace.tasks._losses import cross_entropy as cross_entropy
from braintrace.tasks._losses import last_step_mask as last_step_mask
from braintrace.tasks._regularizers import firing_rate_penalty as firing_rate_penalty
from braintrace.tasks._regularizers import overactivity_penalty as overactivity_penalty
from braintrace.tasks._regularizers import silent_neuron_penalty as silent_neuron_penalty
from braintrace.tasks._tonic import TonicDataset as TonicDataset
from braintrace.tasks._tonic import from_tonic as from_tonic

__all__ = [
    "MNIST1D",
    "NMNIST",
    "SHD",
    "SSC",
    "AbstractEventDataset",
    "Batch",
    "DelayedMatchToSample",
    "Integrator",
    "SequentialDigits",
    "SpikePatterns",
    "SpikingDigits",
    "TonicDataset",
    "accuracy",
    "cross_entropy",
    "delta_encode",
    "firing_rate_penalty",
    "from_tonic",
    "last_step_mask",
    "latency_encode",
    "overactivity_penalty",
    "poisson_encode",
    "rate_encode",
    "silent_neuron_penalty",
]


@dataclasses.dataclass(frozen=True)
class SpikePatterns:
    r"""Classify spatiotemporal Poisson spike patterns after they end.

    Each class has a template: the pattern period (the first
    ``seq_len - response_steps`` steps) is cut into ``num_segments`` segments,
    and in each segment every input channel fires at ``rate_high`` with
    probability ``density`` and at ``rate_low`` otherwise. A sample draws
    Bernoulli spikes from its class's template; during the last
    ``response_steps`` steps every channel fires at ``rate_low`` and the
    model must answer (the mask is 1 there). The templates depend on
    ``seed`` only, so every batch of one task shows the same classes.

    Attributes:
        num_classes: Number of classes ``C``.
        num_inputs: Number of input channels ``I``.
        seq_len: Sequence length ``T``.
        num_segments: Segments of the pattern period, each with its own rates.
        response_steps: Steps after the pattern in which the answer is scored.
        rate_high: Spike probability per step of an active channel.
        rate_low: Spike probability per step of a background channel.
        density: Fraction of channels active in a segment.
        seed: Seed of the class templates.

    Example:
        >>> import jax
        >>> from braintrace.tasks import SpikePatterns
        >>> task = SpikePatterns(num_classes=3, num_inputs=8, seq_len=30, response_steps=5)
        >>> batch = task.sample(jax.random.key(0), batch_size=4)
        >>> batch.xs.shape, batch.ys.shape, batch.mask.shape
        ((30, 4, 8), (30, 4), (30,))
        >>> int(batch.mask.sum()), sorted(set(batch.xs.ravel().tolist()))
        (5, [0.0, 1.0])
        >>> bool((batch.ys == batch.ys[0]).all())  # one label per sequence
        True
    """

    num_classes: int = 4
    num_inputs: int = 20
    seq_len: int = 60
    num_segments: int = 4
    response_steps: int = 10
    rate_high: float = 0.3
    rate_low: float = 0.01
    density: float = 0.3
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.response_steps < self.seq_len:
            raise ValueError(
                f"SpikePatterns: response_steps must be in (0, seq_len={self.seq_len}), got "
                f"{self.response_steps}.")
        if not 0 < self.num_segments <= self.seq_len - self.response_steps:
            raise ValueError(
                f"SpikePatterns: num_segments must be in (0, {self.seq_len - self.response_steps}]"
                f" (the pattern period), got {self.num_segments}.")

    def rates(self) -> jax.Array:
        """Spike probabilities of each class, ``(C, T, I)``."""
        pattern_len = self.seq_len - self.response_steps
        active = jax.random.bernoulli(
            jax.random.key(self.seed), self.density,
            (self.num_classes, self.num_segments, self.num_inputs))
        segment = jnp.arange(pattern_len) * self.num_segments // pattern_len
        rates = jnp.where(active[:, segment], self.rate_high, self.rate_low)
        rest = jnp.full((self.num_classes, self.response_steps, self.num_inputs), self.rate_low)
        return jnp.concatenate([rates, rest], axis=1)

    def sample(self, key: jax.Array, batch_size: int) -> Batch:
        """Draws ``batch_size`` labelled spike trains."""
        k_label, k_spikes = jax.random.split(key)
        labels = jax.random.randint(k_label, (batch_size,), 0, self.num_classes)
        rates = jnp.moveaxis(self.rates()[labels], 0, 1)
        xs = jax.random.bernoulli(k_spikes, rates).astype(jnp.float32)
        ys = jnp.broadcast_to(labels, (self.seq_len, batch_size)).astype(jnp.int32)
        mask = (jnp.arange(self.seq_len) >= self.seq_len - self.response_steps)
        return Batch(xs, ys, mask.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class DelayedMatchToSample:
    r"""Delayed match-to-sample: were the two stimuli, a delay apart, the same?

    The trial runs through four periods: *sample* (``stimulus_steps``), *delay*
    (``delay_steps``), *test* (``stimulus_steps``) and *response*
    (``response_steps``). There are two stimuli, A and B; each drives its own
    population of ``num_inputs // 2`` channels at ``rate_high``. Sample and
    test stimuli are drawn independently, so half the trials match. Outside
    the stimuli every channel fires at ``rate_low``. The label is 1 for a
    match and 0 otherwise, scored in the response period. Solving it needs a
    memory of the sample across the delay and a comparison (an XOR in time).

    Attributes:
        num_inputs: Number of input channels (even).
        stimulus_steps: Length of the sample and test periods.
        delay_steps: Length of the delay.
        response_steps: Length of the response period (the scored steps).
        rate_high: Spike probability per step of a channel of the shown stimulus.
        rate_low: Background spike probability per step.

    Example:
        >>> import jax
        >>> from braintrace.tasks import DelayedMatchToSample
        >>> task = DelayedMatchToSample(num_inputs=4, stimulus_steps=5, delay_steps=10,
        ...                             response_steps=5)
        >>> task.seq_len
        25
        >>> batch = task.sample(jax.random.key(0), batch_size=8)
        >>> batch.xs.shape, batch.ys.shape, int(batch.mask.sum())
        ((25, 8, 4), (25, 8), 5)
        >>> sorted(set(batch.ys[-1].tolist()))
        [0, 1]
    """

    num_inputs: int = 20
    stimulus_steps: int = 10
    delay_steps: int = 20
    response_steps: int = 10
    rate_high: float = 0.4
    rate_low: float = 0.01

    def __post_init__(self):
        if self.num_inputs < 2 or self.num_inputs % 2:
            raise ValueError(
                f"DelayedMatchToSample: num_inputs must be even and >= 2 (one population per "
                f"stimulus), got {self.num_inputs}.")

    @property
    def seq_len(self) -> int:
        """The trial length ``T``."""
        return 2 * self.stimulus_steps + self.delay_steps + self.response_steps

    def sample(self, key: jax.Array, batch_size: int) -> Batch:
        """Draws ``batch_size`` trials; label 1 means the stimuli match."""
        k_stim, k_spikes = jax.random.split(key)
        stimuli = jax.random.randint(k_stim, (2, batch_size), 0, 2)
        t = jnp.arange(self.seq_len)
        test_start = self.stimulus_steps + self.delay_steps
        in_sample = t < self.stimulus_steps
        in_test = (t >= test_start) & (t < test_start + self.stimulus_steps)
        population = jnp.arange(self.num_inputs) * 2 // self.num_inputs
        shown = ((in_sample[:, None, None] & (stimuli[0][None, :, None] == population))
                 | (in_test[:, None, None] & (stimuli[1][None, :, None] == population)))
        xs = jax.random.bernoulli(k_spikes, jnp.where(shown, self.rate_high, self.rate_low))
        labels = (stimuli[0] == stimuli[1]).astype(jnp.int32)
        ys = jnp.broadcast_to(labels, (self.seq_len, batch_size))
        mask = (t >= self.seq_len - self.response_steps).astype(jnp.float32)
        return Batch(xs.astype(jnp.float32), ys, mask)


@dataclasses.dataclass(frozen=True)
class Integrator:
    r"""Regression onto a leaky integral of Gaussian inputs.

    .. math::

        y_t = \alpha\, y_{t-1} + (1 - \alpha)\, x_t, \qquad y_0 = 0,

    per channel, with ``x_t ~ N(0, 1)``; every step is scored. Exactly
    solvable by a leaky integrator, approximately by any gated RNN.

    Attributes:
        num_inputs: Number of input (and output) channels.
        seq_len: Sequence length ``T``.
        decay: The leak ``α`` (memory of about ``1 / (1 - α)`` steps).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace.tasks import Integrator
        >>> batch = Integrator(num_inputs=2, seq_len=10, decay=0.5).sample(
        ...     jax.random.key(0), batch_size=3)
        >>> batch.xs.shape, batch.ys.shape
        ((10, 3, 2), (10, 3, 2))
        >>> bool(jnp.allclose(batch.ys[1], 0.5 * batch.ys[0] + 0.5 * batch.xs[1]))
        True
    """

    num_inputs: int = 2
    seq_len: int = 50
    decay: float = 0.9

    def sample(self, key: jax.Array, batch_size: int) -> Batch:
        """Draws ``batch_size`` input sequences and their integrals."""
        xs = jax.random.normal(key, (self.seq_len, batch_size, self.num_inputs))

        def step(y, x):
            y = self.decay * y + (1.0 - self.decay) * x
            return y, y

        _, ys = jax.lax.scan(step, jnp.zeros_like(xs[0]), xs)
        return Batch(xs, ys, jnp.ones((self.seq_len,), jnp.float32))
