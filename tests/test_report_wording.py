"""What ``report()`` (and ``strict=True``'s error) tells a user, in the user's terms.

* a module of a library's private class is named by its path and the user's
  enclosing module, never by the private class (``_PromotingLinear``);
* a weight between two stateful layers is a feed-forward connection, not
  "recurrent weights";
* windowed mode is named by the argument of the drivers that take it
  (``chunk_size`` of ``etrace_grad`` and ``online_grad``), and that advice
  works;
* spiking models are not sent to MinGRU/LRU, other recurrent ones are;
* wherever RTRL is recommended its cost is stated (memory and time per step,
  small models), and the algorithms are named by their public names; the short report
  (the default) states it once, however many approximations it lists.
"""

import re

import jax.numpy as jnp
import pytest
from flax import nnx

import braintrace
from braintrace import layers

B, I, H = 2, 3, 8


def _report(model, algorithm="d_rtrl", verbose=False):
    braintrace.init_states(model, B)
    return braintrace.compile(model, algorithm, jnp.ones((B, I))).report(verbose=verbose)


def _summaries(model):
    """The one-sentence summaries of the approximations of ``model``'s graph."""
    braintrace.init_states(model, B)
    graph = braintrace.compile_graph(model, jnp.ones((B, I)))
    return [a.summary for a in graph.approximations]


def _lstm():
    return nnx.Sequential(layers.Stateful(layers.OptimizedLSTMCell(I, H, rngs=nnx.Rngs(0))),
                          layers.ETPLinear(H, 2, rngs=nnx.Rngs(1)))


def _recurrent_lif():
    return layers.RecurrentSpiking(I, layers.LIF(H), rngs=nnx.Rngs(0))


def _two_lif_layers():
    return nnx.Sequential(layers.ETPLinear(I, H, rngs=nnx.Rngs(0)), layers.LIF(H),
                          layers.ETPLinear(H, 4, rngs=nnx.Rngs(1)), layers.LIF(4))


def _gru():
    return layers.Stateful(layers.GRUCell(I, H, rngs=nnx.Rngs(0)))


def test_report_names_the_users_module_not_a_private_class():
    text = _report(_lstm(), verbose=True)
    assert "_PromotingLinear" not in text
    assert ("`layers.0.cell.dense_h` (in `layers.0.cell` (OptimizedLSTMCell)) couples different "
            "units") in text
    assert ("`layers.0.cell.dense_i` (in `layers.0.cell` (OptimizedLSTMCell)): "
            "kernel<-layers.0.cell.dense_i.kernel") in text


def test_a_weight_between_two_stateful_layers_is_called_feed_forward():
    (summary,) = _summaries(_two_lif_layers())
    assert summary.startswith("`layers.2` (ETPLinear) carries hidden state `layers.1.v` of "
                              "`layers.1` (LIF) into hidden state `layers.3.v` of `layers.3` (LIF)"
                              " (a feed-forward connection between two stateful layers")
    assert "recurrent weights" not in summary
    assert "MinGRUCell" not in summary


def test_recurrent_weights_are_still_called_recurrent():
    (summary,) = _summaries(_gru())
    assert "couples different units of hidden state `carry`" in summary
    assert "(recurrent weights, a matrix or a reduction)" in summary


def test_windowed_mode_is_advised_by_the_argument_of_the_drivers_that_take_it():
    (summary,) = _summaries(_gru())
    assert "windowed mode (chunk_size=K in etrace_grad or online_grad)" in summary
    assert "etrace_grad(..., chunk_size=K)" not in summary
    # the advice works for a user of the pure functions
    model = _gru()
    braintrace.init_states(model, B)
    online = braintrace.online_grad(braintrace.compile(model, "d_rtrl", jnp.ones((B, I))),
                                    lambda y, t: jnp.mean((y - t) ** 2), chunk_size=2)
    _, _, stats = online.grad(model, online.init(model), jnp.ones((4, B, I)),
                                  jnp.zeros((4, B, H)))
    assert stats.losses.shape == (4,)


def test_spiking_recurrence_gets_spiking_advice_not_mingru():
    (summary,) = [s for s in _summaries(_recurrent_lif()) if "couples" in s]
    assert "MinGRUCell" not in summary and "LRU" not in summary
    assert "drop the recurrent weights if the task allows" in summary
    assert "ETPLinear into LIF or ALIF" in summary
    assert "windowed mode" in summary and "RTRL()" in summary


def test_non_spiking_recurrence_is_offered_an_elementwise_recurrence():
    (summary,) = _summaries(_gru())
    assert "use a layer with an elementwise recurrence (MinGRUCell, MinLSTMCell, LRU)" in summary
    assert "drop the recurrent weights" not in summary


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("make", [_lstm, _recurrent_lif, _two_lif_layers, _gru])
def test_every_rtrl_recommendation_states_its_cost(make, verbose):
    text = _report(make(), "es_d_rtrl", verbose)
    lines = [line for line in text.splitlines() if re.search(r"(?<![A-Z_])RTRL\(\)", line)]
    assert lines
    for line in lines:
        assert "small models" in line, line
        assert "O(B·N²·|θ|) time per step" in line, line
        assert "hundreds of times BPTT's" in line, line
    if not verbose:  # said once, however many approximations there are
        assert text.count("O(B·N²·|θ|) time per step") == 1, text


def test_the_exact_alternatives_give_rtrls_memory_and_step_jacobian():
    text = _report(_recurrent_lif(), "es_d_rtrl")
    (line,) = [line for line in text.splitlines() if line.startswith("  Exact on this model")]
    assert line.startswith("  Exact on this model (strict=True accepts them): RTRL() (for small "
                           "models: an influence of about ")
    assert f"MiB at this batch size, multiplied by the {H} × {H} step Jacobian every step" in line


def test_exact_alternatives_use_public_names():
    x = jnp.ones((B, I))
    model = nnx.Sequential(layers.ETPLinear(I, H, rngs=nnx.Rngs(0)), layers.LIF(H))
    braintrace.init_states(model, B)
    with pytest.raises(ValueError) as error:
        braintrace.compile(model, "es_d_rtrl", x, strict=True)
    assert "Exact on this model (strict=True accepts them): DRTRL(), RTRL()" in str(error.value)
    assert "D_RTRL()" not in str(error.value)
