"""The models of the gradient contract (float64; see ``test_gradient_contract.py``).

Every entry of :data:`MODELS` is a :class:`ModelCase`: a builder of a batched
model with random hidden state (so ``T = 1`` exercises ``h^0``), the input
width, and whether D-RTRL is exact on it over time (``exact``, which is also
what ``compile(..., strict=True)`` must accept). A new layer joins the
contract by one line here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import braintrace
from braintrace import layers

F64 = jnp.float64
BATCH, IN, HID, OUT = 2, 3, 4, 2


def _normal(key: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, F64)


def randomize_hidden(model: nnx.Module, seed: int = 7, scale: float = 0.5) -> nnx.Module:
    """Sets every floating hidden state to a random value."""
    for i, (_, node) in enumerate(nnx.iter_graph(model)):
        if isinstance(node, braintrace.HiddenState) and jnp.issubdtype(node.dtype, jnp.floating):
            node.set_value(_normal(seed + i, node[...].shape, scale))
    return model


def _linear(i: int, o: int, seed: int, **kw) -> layers.ETPLinear:
    return layers.ETPLinear(i, o, param_dtype=F64, rngs=nnx.Rngs(seed), **kw)


class Readout(nnx.Module):
    """``cell`` (one step, keeps its state) followed by an ``ETPLinear`` readout."""

    def __init__(self, cell: nnx.Module, hidden: int, seed: int = 11):
        self.cell = cell
        self.out = _linear(hidden, OUT, seed)

    def __call__(self, x):
        return self.out(jnp.tanh(self.cell(x)))


class Leaky(nnx.Module):
    """``h' = 0.8 h + drive(x)``, read out by ``tanh(h) W_o``; ``drive`` is a module."""

    def __init__(self, drive: nnx.Module, hidden: int = HID):
        self.drive = drive
        self.h = braintrace.HiddenState(jnp.zeros((hidden,), F64))
        self.out = _linear(hidden, OUT, 12)

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.drive(x)
        return self.out(jnp.tanh(self.h[...]))


class Sequential(nnx.Module):
    def __init__(self, *modules: nnx.Module):
        self.modules = nnx.List(modules)

    def __call__(self, x):
        for m in self.modules:
            x = m(x)
        return x


class LayerNormDrive(nnx.Module):
    """``LayerNorm(W x)``: a normalisation between the ETP op and the state."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)
        self.norm = nnx.LayerNorm(HID, param_dtype=F64, rngs=nnx.Rngs(2))

    def __call__(self, x):
        return self.norm(self.lin(x))


class BatchNormDrive(nnx.Module):
    """``BatchNorm(W x)`` with batch statistics (mixes samples; a bias would cancel)."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1, use_bias=False)
        self.norm = nnx.BatchNorm(HID, use_running_average=False, param_dtype=F64,
                                  rngs=nnx.Rngs(2))
        for stat in (self.norm.mean, self.norm.var):  # Flax keeps batch stats in float32
            stat.set_value(stat[...].astype(F64))

    def __call__(self, x):
        return self.norm(self.lin(x))


class TwiceDrive(nnx.Module):
    """One ``ETPLinear`` applied twice: ``W x + W (x²)``."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)

    def __call__(self, x):
        return self.lin(x) + self.lin(x ** 2)


class PlainNextToETP(nnx.Module):
    """``W x + nnx.Linear(x)``: a plain Param feeds the state beside a traced one."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)
        self.plain = nnx.Linear(IN, HID, param_dtype=F64, rngs=nnx.Rngs(3))

    def __call__(self, x):
        return self.lin(x) + self.plain(x)


class SharedWithPlainOps(nnx.Module):
    """``W x + sin(W).sum(0)``: a traced Param also used by plain operations."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)

    def __call__(self, x):
        return self.lin(x) + jnp.sin(self.lin.kernel[...]).sum(0)


class RematDrive(nnx.Module):
    """An ``ETPLinear`` under ``nnx.remat``."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)

    def __call__(self, x):
        return nnx.remat(lambda m, x: m(x))(self.lin, x)


class JitDrive(nnx.Module):
    """An ``ETPLinear`` under ``nnx.jit``."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)

    def __call__(self, x):
        return nnx.jit(lambda m, x: m(x))(self.lin, x)


class DropoutDrive(nnx.Module):
    """``Dropout(W x)``: a random mask drawn from the model's ``nnx.Rngs`` every step."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)
        self.dropout = nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=5))

    def __call__(self, x):
        return self.dropout(self.lin(x))


class PreviousStateReadout(nnx.Module):
    """``y_t = R tanh(h_{t-1}) + S x_t``, ``h_t = λ h_{t-1} + W x_t`` (λ fixed)."""

    def __init__(self):
        self.w = _linear(IN, HID, 1)
        self.r = nnx.Linear(HID, OUT, param_dtype=F64, rngs=nnx.Rngs(2))
        self.s = nnx.Linear(IN, OUT, param_dtype=F64, rngs=nnx.Rngs(3))
        self.h = braintrace.HiddenState(jnp.zeros((HID,), F64))

    def __call__(self, x):
        h_prev = self.h[...]
        self.h[...] = 0.7 * h_prev + self.w(x)
        return self.r(jnp.tanh(h_prev)) + self.s(x)


class CellStateAndOutput(nnx.Module):
    """``c = 0.5 c + W x``, ``h = tanh(c)``: one new state computed from another."""

    def __init__(self):
        self.w = _linear(IN, HID, 1)
        self.c = braintrace.HiddenState(jnp.zeros((HID,), F64))
        self.h = braintrace.HiddenState(jnp.zeros((HID,), F64))
        self.out = _linear(HID, OUT, 2)

    def __call__(self, x):
        self.c[...] = 0.5 * self.c[...] + self.w(x)
        self.h[...] = jnp.tanh(self.c[...])
        return self.out(self.h[...])


@jax.custom_vjp
def soft_tanh(x):
    """``tanh`` with a hand-written backward rule (forward mode is undefined for it)."""
    return jnp.tanh(x)


soft_tanh.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1.0 - jnp.tanh(x) ** 2),))


class CustomVJPActivation(nnx.Module):
    """``h' = soft_tanh(0.8 h + W x)`` with a ``jax.custom_vjp`` activation."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)
        self.h = braintrace.HiddenState(jnp.zeros((HID,), F64))
        self.out = _linear(HID, OUT, 2)

    def __call__(self, x):
        self.h[...] = soft_tanh(0.8 * self.h[...] + self.lin(x))
        return self.out(self.h[...])


class StepCounter(nnx.Module):
    """A leaky layer that also counts its steps in an integer HiddenState."""

    def __init__(self):
        self.leaky = Leaky(_linear(IN, HID, 1))
        self.count = braintrace.HiddenState(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.count[...] = self.count[...] + 1
        return self.leaky(x)


def _cell(cls, **kw):
    return lambda: Readout(layers.Stateful(cls(IN, HID, param_dtype=F64, rngs=nnx.Rngs(0),
                                               **kw)), HID)


def _lora():
    layer = layers.ETPLoRALinear(IN, HID, lora_rank=2, param_dtype=F64, lora_param_dtype=F64,
                                 rngs=nnx.Rngs(1))
    layer.lora.lora_b.set_value(_normal(5, layer.lora.lora_b[...].shape))  # zero at init
    return layer


def _lif_synapse():
    return Sequential(_linear(IN, HID, 1), layers.LIF(HID, tau=4.0, v_th=0.3, param_dtype=F64),
                      layers.ExpSynapse(HID, tau=3.0, param_dtype=F64), _linear(HID, OUT, 2))


def _alif_taus(readout):
    alif = layers.ALIF(HID, tau=4.0, v_th=0.3, learn_tau=True, learn_tau_a=True, param_dtype=F64)
    if readout == "leaky":  # a leaky readout state fed by the spikes: cross-layer credit
        return Sequential(_linear(IN, HID, 1), alif,
                          layers.LeakyReadout(HID, OUT, tau=3.0, learn_tau=True,
                                              param_dtype=F64, rngs=nnx.Rngs(2)))
    return Sequential(_linear(IN, HID, 1), alif, _linear(HID, OUT, 2))


def _recurrent_lif(num_layers=1):
    stack = [layers.RecurrentSpiking(IN if k == 0 else HID,
                                     layers.LIF(HID, tau=4.0, v_th=0.3, param_dtype=F64),
                                     param_dtype=F64, rngs=nnx.Rngs(1 + k))
             for k in range(num_layers)]
    return Sequential(*stack, _linear(HID, OUT, 9))


class OneDriveTwoStates(nnx.Module):
    """One ``ETPLinear`` driving two hidden states that never meet: two hidden groups."""

    def __init__(self):
        self.lin = _linear(IN, HID, 1)
        self.a = braintrace.HiddenState(jnp.zeros((HID,), F64))
        self.b = braintrace.HiddenState(jnp.zeros((HID,), F64))
        self.out = _linear(HID, OUT, 2)

    def __call__(self, x):
        y = self.lin(x)
        self.a[...] = 0.9 * self.a[...] + y
        self.b[...] = 0.5 * self.b[...] + jnp.tanh(y)
        return self.out(jnp.tanh(self.a[...]) * self.b[...])


class EncoderGRU(nnx.Module):
    """An ``ETPLinear`` encoder, ``tanh``, then a GRU: the encoder reaches the state only
    through the GRU's input kernel (another ETP operation)."""

    def __init__(self):
        self.enc = _linear(IN, HID, 3)
        self.rnn = layers.Stateful(layers.GRUCell(HID, HID, param_dtype=F64, rngs=nnx.Rngs(0)))
        self.out = _linear(HID, OUT, 4)

    def __call__(self, x):
        return self.out(self.rnn(jnp.tanh(self.enc(x))))


class ConvEncoderRecurrentConvLIF(nnx.Module):
    """A conv encoder into a ``ConvLIF`` layer whose input current also gets a recurrent
    ``ETPConv`` of its own spikes (1-D frames of ``IN`` positions; ``ConvLIF`` itself has no
    recurrence, so the recurrent convolution is added from its parts)."""

    def __init__(self):
        self.enc = layers.ETPConv(1, 2, (2,), param_dtype=F64, rngs=nnx.Rngs(1))
        self.layer = layers.ConvLIF(2, 2, (2,), input_size=(IN,), tau=4.0, v_th=0.3,
                                    param_dtype=F64, rngs=nnx.Rngs(2))
        self.rec = layers.ETPConv(2, 2, (2,), use_bias=False, param_dtype=F64,
                                  rngs=nnx.Rngs(3))
        self.out = _linear(2 * IN, OUT, 4)

    def __call__(self, x):
        frames = jnp.tanh(self.enc(x[..., None]))
        z = self.layer.neuron(self.layer.conv(frames) + self.rec(self.layer.spikes()))
        return self.out(z.reshape(*z.shape[:-2], -1))


def _lif(readout):
    lif = layers.LIF(HID, tau=4.0, v_th=0.3, param_dtype=F64)
    if readout == "leaky":  # the usual spiking classifier: a leaky readout state of the spikes
        return Sequential(_linear(IN, HID, 1), lif,
                          layers.LeakyReadout(HID, OUT, tau=3.0, param_dtype=F64,
                                              rngs=nnx.Rngs(2)))
    return Sequential(_linear(IN, HID, 1), lif, _linear(HID, OUT, 2))


def _encoder_recurrent_lif():
    return Sequential(_linear(IN, HID, 3),
                      layers.RecurrentSpiking(HID, layers.LIF(HID, tau=4.0, v_th=0.3,
                                                              param_dtype=F64),
                                              param_dtype=F64, rngs=nnx.Rngs(1)),
                      _linear(HID, OUT, 9))


def _recurrent_alif():
    """A dense recurrence over ALIF neurons: two states per unit (SnAp saturates at n = 3)."""
    alif = layers.ALIF(HID, tau=4.0, tau_a=2.0, beta=1.0, v_th=0.3, param_dtype=F64)
    return Sequential(layers.RecurrentSpiking(IN, alif, param_dtype=F64, rngs=nnx.Rngs(1)),
                      _linear(HID, OUT, 9))


def gaussian_surrogate(x):
    """A surrogate derivative given as a function: ``exp(-4 x²)``."""
    return jnp.exp(-4.0 * x ** 2)


@jax.custom_jvp
def own_spike(x):
    """A user's own spike function: Heaviside forward, ``1/(1 + 5|x|)`` backward."""
    return (x > 0).astype(x.dtype)


own_spike.defjvp(lambda primals, tangents: (own_spike(primals[0]),
                                            tangents[0] / (1.0 + 5.0 * jnp.abs(primals[0]))))


def _if():
    """IF neurons (no leak) with a surrogate given as a function."""
    neuron = layers.IF(HID, v_th=0.3, surrogate=gaussian_surrogate, param_dtype=F64)
    return Sequential(_linear(IN, HID, 1), neuron, _linear(HID, OUT, 2))


def _cuba(readout):
    """CuBaLIF neurons (two states per neuron), learned time constants, a ``tanh``
    surrogate; with ``readout='count'`` their spikes counted by a ``SumOverTime`` (a third
    state per neuron) that is the output."""
    width = OUT if readout == "count" else HID
    neuron = layers.CuBaLIF(width, tau=4.0, tau_syn=3.0, v_th=0.3, learn_tau=True,
                            learn_tau_syn=True, surrogate="tanh", param_dtype=F64)
    if readout == "count":
        return Sequential(_linear(IN, OUT, 1), neuron, layers.SumOverTime(OUT, param_dtype=F64))
    return Sequential(_linear(IN, HID, 1), neuron, _linear(HID, OUT, 2))


def _recurrent_cuba():
    """CuBaLIF neurons whose recurrent input enters the synaptic current; a user's own
    ``custom_jvp`` spike function."""
    neuron = layers.CuBaLIF(HID, tau=4.0, tau_syn=3.0, v_th=0.3, surrogate=own_spike,
                            param_dtype=F64)
    return Sequential(layers.RecurrentSpiking(IN, neuron, param_dtype=F64, rngs=nnx.Rngs(1)),
                      _linear(HID, OUT, 9))


def _leaky_max():
    """The maximum over time of a leaky readout's membrane (``MaxOverTime``)."""
    return Sequential(layers.LeakyReadout(IN, OUT, tau=3.0, learn_tau=True, param_dtype=F64,
                                          rngs=nnx.Rngs(2)),
                      layers.MaxOverTime(OUT, param_dtype=F64))


def _lru_stack():
    return Sequential(layers.LRU(IN, HID, out_features=HID, r_min=0.4, param_dtype=F64,
                                 rngs=nnx.Rngs(0)),
                      layers.LRU(HID, HID, out_features=OUT, r_min=0.4, param_dtype=F64,
                                 rngs=nnx.Rngs(1)))


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A contract model: ``build()`` gives it batched, with random hidden state."""

    make: Callable[[], nnx.Module]
    exact: bool
    input_scale: float = 1.0

    def build(self) -> nnx.Module:
        model = self.make()
        braintrace.init_states(model, BATCH)
        return randomize_hidden(model)


MODELS: dict[str, ModelCase] = {
    "dense": ModelCase(lambda: Leaky(_linear(IN, HID, 1)), exact=True),
    "lora": ModelCase(lambda: Leaky(_lora()), exact=True),
    "alif-learned-taus": ModelCase(lambda: _alif_taus("linear"), exact=True, input_scale=2.0),
    "alif-leaky-readout": ModelCase(lambda: _alif_taus("leaky"), exact=False, input_scale=2.0),
    "lif-expsynapse": ModelCase(_lif_synapse, exact=True, input_scale=2.0),
    "cell-state-and-output": ModelCase(CellStateAndOutput, exact=True),
    "one-drive-two-states": ModelCase(OneDriveTwoStates, exact=True),
    "weight-used-twice": ModelCase(lambda: Leaky(TwiceDrive()), exact=True),
    "remat": ModelCase(lambda: Leaky(RematDrive()), exact=True),
    "nnx-jit": ModelCase(lambda: Leaky(JitDrive()), exact=True),
    "dropout": ModelCase(lambda: Leaky(DropoutDrive()), exact=True),
    "previous-state-readout": ModelCase(PreviousStateReadout, exact=True),
    "integer-state": ModelCase(StepCounter, exact=True),
    "custom-vjp-activation": ModelCase(CustomVJPActivation, exact=True),
    "min-gru": ModelCase(_cell(layers.MinGRUCell), exact=True),
    "lru": ModelCase(lambda: Readout(layers.LRU(IN, HID, out_features=HID, r_min=0.4,
                                                param_dtype=F64, rngs=nnx.Rngs(0)), HID),
                     exact=True),
    "simple-cell": ModelCase(_cell(layers.SimpleCell, dtype=F64), exact=False),
    "gru": ModelCase(_cell(layers.GRUCell), exact=False),
    "lstm": ModelCase(_cell(layers.LSTMCell), exact=False),
    "recurrent-lif": ModelCase(_recurrent_lif, exact=False, input_scale=2.0),
    "recurrent-lif-2-layers": ModelCase(lambda: _recurrent_lif(2), exact=False, input_scale=2.0),
    "recurrent-alif": ModelCase(_recurrent_alif, exact=False, input_scale=2.0),
    "lif": ModelCase(lambda: _lif("linear"), exact=True, input_scale=2.0),
    "lif-leaky-readout": ModelCase(lambda: _lif("leaky"), exact=False, input_scale=2.0),
    "if": ModelCase(_if, exact=True, input_scale=2.0),
    "cuba-lif": ModelCase(lambda: _cuba("linear"), exact=True, input_scale=2.0),
    "cuba-lif-count": ModelCase(lambda: _cuba("count"), exact=True, input_scale=2.0),
    "recurrent-cuba-lif": ModelCase(_recurrent_cuba, exact=False, input_scale=2.0),
    "leaky-max-over-time": ModelCase(_leaky_max, exact=True),
    "encoder-gru": ModelCase(EncoderGRU, exact=False),
    "encoder-recurrent-lif": ModelCase(_encoder_recurrent_lif, exact=False, input_scale=2.0),
    "lru-2-layers": ModelCase(_lru_stack, exact=False),
    "conv-encoder-recurrent-convlif": ModelCase(ConvEncoderRecurrentConvLIF, exact=False,
                                                input_scale=2.0),
    "layernorm": ModelCase(lambda: Leaky(LayerNormDrive()), exact=False),
    "batchnorm": ModelCase(lambda: Leaky(BatchNormDrive()), exact=False),
    "plain-linear-beside-etp": ModelCase(lambda: Leaky(PlainNextToETP()), exact=False),
    "traced-param-in-plain-ops": ModelCase(lambda: Leaky(SharedWithPlainOps()), exact=False),
}
"""Every built-in layer and model shape of the contract; ``exact``: D-RTRL equals BPTT."""

ALGORITHMS: dict[str, Callable[[], braintrace.AbstractAlgorithm]] = {
    "d_rtrl": braintrace.D_RTRL,
    "es_d_rtrl": lambda: braintrace.ES_D_RTRL(0.7, x_decay_or_rank=0.4),
    "eprop": lambda: braintrace.EProp(0.5),
    "fptt": braintrace.FPTT,
    "ostl_recurrent": braintrace.OSTLRecurrent,
    "ostl_feedforward": braintrace.OSTLFeedforward,
    "otpe": lambda: braintrace.OTPE(0.6),
    "ottt": lambda: braintrace.OTTT(0.6),
    "rtrl": braintrace.RTRL,
    "sltt": braintrace.SLTT,
    "uoro": braintrace.UORO,
    "snap-1": lambda: braintrace.SnAp(1),
    "snap-2": lambda: braintrace.SnAp(2),
}
"""Every algorithm of the contract (each equals BPTT at ``T = 1`` on every model)."""
