"""A hidden state written with a value of another dtype keeps its credit over time.

``variable[...] = value`` with ``value`` wider than the Variable (a float32 step into a
bfloat16 hidden state, the usual mixed-precision setup) is written by Flax with a
``scatter`` that casts; the compiler follows it like any other value:

* float64 oracle: a float64 step written into a float32 hidden state, D-RTRL and RTRL
  (exact on the model) = BPTT to the state's float32 rounding (1e-6; both round the
  state alike in the forward, its derivatives at other places), where the lost path was
  60% off;
* the bfloat16 model of the report (bfloat16 Params and state, float32 example and data):
  D-RTRL within bfloat16 rounding of BPTT, where it was 60-70% off before;
* the analyses of what reads the new state ``h^t`` start at the value the narrowed state
  is cast from (``ETraceGraph.new_state_vars``), as they do on the same model computed in
  the state's dtype: the readers, the operations OSTTP projects the target onto, the fast
  signal's obstacles and OTPE's exactness.

``tests/test_precision_sweep.py`` runs every algorithm and loop in these setups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_models as S
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._algorithms._eprop import feedback_equations
from braintrace._algorithms._otpe_exact import otpe_obstacles
from braintrace._compiler import fast_signal_obstacles, readers

B, I, H, O, T = 2, 3, 4, 2, 6

pytestmark = pytest.mark.filterwarnings(  # JAX warns of the cast in Flax's scatter
    "ignore:scatter inputs have incompatible types:FutureWarning")


class NarrowState(nnx.Module):
    """``h' = 0.9 h + x W + b`` in the step's dtype, written into a narrower hidden state
    with ``h[...] = h'``; read out by ``tanh(h') W_o``."""

    def __init__(self, param_dtype, state_dtype):
        self.w = layers.ETPLinear(I, H, param_dtype=param_dtype, rngs=nnx.Rngs(0))
        self.h = braintrace.HiddenState(jnp.zeros((H,), state_dtype))
        self.out = layers.ETPLinear(H, O, param_dtype=param_dtype, rngs=nnx.Rngs(1))

    def __call__(self, x):
        h = 0.9 * self.h[...] + self.w(x)
        self.h[...] = h
        return self.out(jnp.tanh(h))


def model(param_dtype, state_dtype):
    m = NarrowState(param_dtype, state_dtype)
    braintrace.init_states(m, B)
    m.h.set_value(jax.random.normal(jax.random.key(3), (B, H), state_dtype))
    return m


def data(dtype):
    return (jax.random.normal(jax.random.key(1), (T, B, I), dtype),
            jax.random.normal(jax.random.key(2), (T, B, O), dtype))


def grads(algorithm, m, xs, ys):
    learner = braintrace.compile(m, algorithm, xs[0])
    return learner.etrace_grad(xs, ys, S.mse, reduction="sum")


def test_a_float64_step_into_a_float32_state_equals_bptt():
    """D-RTRL and RTRL (exact on the model) equal the float64 BPTT oracle to the float32
    rounding of the state (BPTT's cotangent of the state is float32, as are the Jacobians
    ``D`` the traces read)."""
    with jax.enable_x64(True):
        xs, ys = data(jnp.float64)
        want = S.bptt_grads(model(jnp.float64, jnp.float32), xs, ys)
        S.assert_live(want)
        assert model(jnp.float64, jnp.float32).h[...].dtype == jnp.float32
        for algorithm in ("d_rtrl", "rtrl"):  # the diagonal and the full hidden Jacobian
            got = grads(algorithm, model(jnp.float64, jnp.float32), xs, ys)
            errors = S.rel_errors(got, want)
            assert max(errors.values()) < 1e-6, (algorithm, errors)


def test_bfloat16_state_and_params_with_float32_data_are_within_bf16_rounding_of_bptt():
    """The report's setup: D-RTRL's gradient of the traced Params within 3% of BPTT's
    (bfloat16 rounding over 6 steps; the path lost, the error was 0.6-0.7)."""
    xs, ys = data(jnp.float32)
    want = S.bptt_grads(model(jnp.bfloat16, jnp.bfloat16), xs, ys)
    got = grads("d_rtrl", model(jnp.bfloat16, jnp.bfloat16), xs, ys)
    errors = S.rel_errors(jax.tree.map(lambda a: a.astype(np.float32), got),
                          jax.tree.map(lambda a: a.astype(np.float32), want))
    assert max(errors.values()) < 3e-2, errors


def layered_graph(param_dtype):
    """A leaky layer read through ``tanh`` by a leaky readout, computed in float32 (the
    data's dtype) and stored in ``param_dtype``: ``tanh`` and the loss read the float32
    values, as Flax layers return them."""
    model = nnx.Sequential(layers.LeakyReadout(I, H, tau=4.0, param_dtype=param_dtype,
                                               rngs=nnx.Rngs(0)), jnp.tanh,
                           layers.LeakyReadout(H, O, tau=1 / np.log(2), param_dtype=param_dtype,
                                               rngs=nnx.Rngs(1)))  # leak 1/2, also in bfloat16
    braintrace.init_states(model, B)
    return braintrace.compile_graph(model, jnp.zeros((B, I), jnp.float32))


class WideSynapse(nnx.Module):
    """``i' = i/2 + x``, ``v' = v/2 + i'``, both computed in the input's dtype and stored in
    the states' (the membrane computed from the current's new value, in one group)."""

    def __init__(self, dtype):
        self.i = braintrace.HiddenState(jnp.zeros((H,), dtype))
        self.v = braintrace.HiddenState(jnp.zeros((H,), dtype))

    def __call__(self, x):
        i = 0.5 * self.i[...] + x
        v = 0.5 * self.v[...] + i
        self.i[...], self.v[...] = i, v
        return jnp.tanh(v)


def synapse_graph(param_dtype):
    model = nnx.Sequential(layers.ETPLinear(I, H, param_dtype=param_dtype, rngs=nnx.Rngs(0)),
                           WideSynapse(param_dtype),
                           layers.LeakyReadout(H, O, tau=1 / np.log(2), param_dtype=param_dtype,
                                               rngs=nnx.Rngs(1)))
    braintrace.init_states(model, B)
    return braintrace.compile_graph(model, jnp.zeros((B, I), jnp.float32))


def analyses(graph):
    """What each analysis of the new state finds: the readers, the operations reading
    ``h^t``, the fast signal's obstacles, OTPE's obstacles with the readout's leak and 0.6."""
    return (readers(graph), len(feedback_equations(graph)),
            [o.detail for o in fast_signal_obstacles(graph)],
            otpe_obstacles(graph, 0.5), otpe_obstacles(graph, 0.6))


def test_the_analyses_of_the_new_state_see_through_its_cast():
    """A bfloat16 model fed float32 data: the readout reads the layer (one reader, the
    operation OSTTP projects the target onto), the fast signal's obstacles are the coupling
    and the readout's state computed from the layer's, OTPE with the readout's leak is exact
    and with another is refused for that leak, and a new state computed from another of its
    group's refuses it: as in float32 (before: no reader, nothing to project onto, a
    'reads-before-update' obstacle, a false 'recurrence' for OTPE)."""
    graph = layered_graph(jnp.float32)
    want = analyses(graph)
    assert want[:2] == (((1,), ()), 1) and want[3] == ()
    assert [o.kind for o in fast_signal_obstacles(graph)] == ["approximate-traces",
                                                              "new-from-new"]
    refused = ("hidden state `layers.2.y` of `layers.2` (LeakyReadout) reads hidden state "
               "`layers.0.y` of `layers.0` (LeakyReadout) and leaks by 0.5, not by decay=0.6")
    assert want[4] == (refused,)
    assert analyses(layered_graph(jnp.bfloat16)) == want
    # a new state computed from another of its group's: refused in both
    refused = otpe_obstacles(synapse_graph(jnp.float32), 0.5)
    assert any("`layers.1.v`" in o and "computed from that of" in o for o in refused)
    assert otpe_obstacles(synapse_graph(jnp.bfloat16), 0.5) == refused
