"""Errors whose advice a user can follow: they name the argument or the change to make.

* ``layers.Stateful`` around a Flax cell without ``rngs=``: a ValueError naming
  the cell and the argument, not Flax's bare "RNGs must be provided";
* a long ``lax.scan`` over a weight inside the model step: the error names the
  Param and advises what the model can do (``unroll=True``, a Python loop, one
  step per call), never an argument that no public function takes
  (``max_unroll``); following the advice compiles;
* a newcomer's Flax habits (issue 61): a Flax recurrent cell in ``Stateful`` warns at
  compile and names its drop-in (so do ``report()`` and ``strict=True``); algorithm names
  in their documented spellings; ``compile`` without ``batch_size`` on a batch, a whole
  sequence given to one step, ``evaluate`` without ``batch_size`` and a loss written
  ``loss_fn(target, prediction)`` each name the real fix, and the fix works.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers

FLAX_CELLS = {"GRUCell": nnx.GRUCell, "OptimizedLSTMCell": nnx.OptimizedLSTMCell,
              "SimpleCell": nnx.SimpleCell}


@pytest.mark.parametrize("name", FLAX_CELLS)
def test_stateful_flax_cell_without_rngs_names_the_argument(name):
    cell = FLAX_CELLS[name](3, 4, rngs=nnx.Rngs(0))
    before = nnx.state(cell)
    with pytest.raises(ValueError) as error:
        layers.Stateful(cell)
    message = str(error.value)
    assert message.startswith(f"Stateful(nnx.{name}) was given no rngs, but "
                              f"nnx.{name}.initialize_carry needs them")
    assert "pass them as layers.Stateful(cell, rngs=nnx.Rngs(0))" in message
    assert isinstance(error.value.__cause__, ValueError)  # Flax's own error, kept as the cause
    jax.tree.map(np.testing.assert_array_equal, nnx.state(cell), before)
    # the advice works
    model = layers.Stateful(cell, rngs=nnx.Rngs(0))
    assert model(jnp.ones(3)).shape == (4,)


def test_stateful_braintrace_cell_needs_no_rngs():
    model = layers.Stateful(layers.GRUCell(3, 4, rngs=nnx.Rngs(0)))
    assert model(jnp.ones(3)).shape == (4,)


class SettlingLeaky(nnx.Module):
    """A leaky state that settles for ``steps`` inner iterations per time step (a scan)."""

    def __init__(self, steps, unroll=1):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (3, 4)))
        self.h = braintrace.HiddenState(jnp.zeros((2, 4)))
        self.steps, self.unroll = steps, unroll

    def __call__(self, x):
        drive = braintrace.matmul(x, self.w[...])
        settle = lambda c, _: (0.9 * c + 0.1 * drive, None)
        h, _ = jax.lax.scan(settle, self.h[...], None, length=self.steps, unroll=self.unroll)
        self.h[...] = h
        return h


def test_long_scan_error_advises_what_the_model_can_do():
    model = SettlingLeaky(40)
    before = nnx.state(model)
    with pytest.raises(ValueError) as error:
        braintrace.compile(model, "d_rtrl", jnp.ones((2, 3)))
    message = str(error.value)
    assert "has length 40 and consumes tracked input(s) 'w', 'h'" in message
    assert "Unroll it in the model (jax.lax.scan(..., unroll=True), or a Python for loop)" in message
    assert "move the loop out of the model step" in message
    assert "max_unroll" not in message
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)


def test_long_scan_with_unroll_true_compiles():
    graph = braintrace.compile_graph(SettlingLeaky(40, unroll=True), jnp.ones((2, 3)))
    assert graph.traced_param_paths == ("w",)
    assert any("unrolled (40 iteration(s))" in note for note in graph.notes)


def test_short_scan_is_unrolled_without_asking():
    graph = braintrace.compile_graph(SettlingLeaky(5), jnp.ones((2, 3)))
    assert graph.traced_param_paths == ("w",)


# -- a newcomer's first hour (issue 61): Flax habits that work or say why ----------------------

DROP_INS = {"GRUCell": layers.GRUCell, "LSTMCell": layers.LSTMCell,
            "OptimizedLSTMCell": layers.OptimizedLSTMCell, "SimpleCell": layers.SimpleCell}


def _cell_net(cell_class, rngs=None):
    """A cell in ``Stateful`` and an ETP readout (something is traced, so compile runs)."""
    return nnx.Sequential(layers.Stateful(cell_class(3, 4, rngs=nnx.Rngs(0)), rngs=rngs),
                          layers.ETPLinear(4, 2, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("name", DROP_INS)
def test_a_flax_cell_in_stateful_warns_at_compile_naming_its_drop_in(name):
    flax_cell = getattr(nnx, name)
    with pytest.warns(UserWarning) as caught:
        learner = braintrace.compile(_cell_net(flax_cell, nnx.Rngs(2)), "d_rtrl",
                                     jnp.ones((2, 3)), batch_size=2)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"braintrace.compile: `layers.0.cell` (nnx.{name}) is Flax's own "
                              "cell: its Params `layers.0.cell.")
    assert "learn from their same-step gradient only (no credit over time)" in message
    assert f"use braintrace.layers.{name} instead (a drop-in" in message
    assert f"braintrace.layers.{name} instead" in learner.report()
    # the advice works: the drop-in (same arguments) compiles without a warning, its Params
    # traced
    learner = braintrace.compile(_cell_net(DROP_INS[name]), "d_rtrl", jnp.ones((2, 3)),
                                 batch_size=2)
    assert {p.split(".")[0] for p in learner.graph.traced_param_paths} == {"layers"}


def test_strict_refuses_a_flax_cell_naming_its_drop_in_and_bptt_does_not_warn():
    x = jnp.ones((2, 3))
    with pytest.raises(ValueError, match=r"use braintrace.layers.OptimizedLSTMCell instead"):
        braintrace.compile(_cell_net(nnx.OptimizedLSTMCell, nnx.Rngs(2)), "es_d_rtrl", x,
                           batch_size=2, strict=True)
    braintrace.compile(_cell_net(nnx.OptimizedLSTMCell, nnx.Rngs(2)), "bptt", x, batch_size=2)
    # a Flax cell alone: nothing is traced at all, and the error names the drop-in
    with pytest.raises(ValueError, match=r"braintrace.layers.GRUCell instead of `cell` "
                                         r"\(nnx.GRUCell\)"):
        braintrace.compile(layers.Stateful(nnx.GRUCell(3, 4, rngs=nnx.Rngs(0)),
                                           rngs=nnx.Rngs(1)), "d_rtrl", x, batch_size=2)


@pytest.mark.parametrize("spelling, name", [
    ("ES-D-RTRL", "es_d_rtrl"), ("es_d_rtrl", "es_d_rtrl"), ("ESDRTRL", "es_d_rtrl"),
    ("D-RTRL", "d_rtrl"), ("DRTRL", "d_rtrl"), ("BPTT", "bptt"), ("e-prop", "eprop"),
    ("pp-prop", "es_d_rtrl"), ("OSTLRecurrent", "ostl_recurrent"), ("SnAp", "snap"),
    ("three-factor", "three_factor"), ("OTTT", "ottt"), ("RTRL", "rtrl")])
def test_algorithm_names_accept_their_documented_spellings(spelling, name):
    assert braintrace._algorithms.get_algorithm(spelling).name == name


def test_an_unknown_algorithm_name_lists_the_names():
    with pytest.raises(ValueError, match=r"Unknown algorithm 'ES-D-RTLR'.*'es_d_rtrl'.*case, "
                                         r"hyphens and underscores do not matter"):
        braintrace._algorithms.get_algorithm("ES-D-RTLR")


class GRUNet(nnx.Module):
    def __init__(self):
        self.rnn = layers.Stateful(layers.GRUCell(1, 4, rngs=nnx.Rngs(0)))
        self.out = layers.ETPLinear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.out(self.rnn(x))


def test_compile_without_batch_size_on_a_batch_says_compile_with_batch_size():
    model = GRUNet()
    with pytest.raises(ValueError) as error:
        braintrace.compile(model, "d_rtrl", jnp.zeros((8, 1)))
    message = str(error.value)
    assert message.startswith("braintrace.compile: example_x has shape (8, 1), a batch of 8, but "
                              "the model's hidden states hold one sample")
    assert "braintrace.compile(model, algorithm, example_x, batch_size=8)" in message
    assert "init_states" not in message
    assert model.rnn.carry.shape == (4,)  # nothing was changed
    braintrace.compile(model, "d_rtrl", jnp.zeros((8, 1)), batch_size=8)  # the advice works


def test_a_per_sample_learner_given_batches_says_compile_with_batch_size():
    learner = braintrace.compile(GRUNet(), "d_rtrl", jnp.zeros((1,)))
    xs, ys = jnp.ones((5, 8, 1)), jnp.zeros((5, 8, 3))
    mse = lambda y, t: jnp.mean((y - t) ** 2)
    with pytest.raises(ValueError, match=r"compiled for one sample \(without batch_size\); for "
                                         r"batches of 8, compile with braintrace.compile\(\.\.\., "
                                         r"batch_size=8\), or call learner.reset\(batch_size=8\)"):
        learner.etrace_grad(xs, ys, mse)


def test_a_whole_sequence_into_the_model_says_a_call_is_one_step():
    xs = jnp.ones((5, 8, 1))
    for batched in (True, False):  # states batched for 8, or still per sample
        model = GRUNet()
        if batched:
            braintrace.init_states(model, batch_size=8)
        with pytest.raises(ValueError) as error:
            model(xs)
        message = str(error.value)
        assert "A call of the model is one time step" in message
        assert "braintrace.evaluate(model, xs)" in message and "flatten" not in message[:80]
    # the advice works: evaluate runs the sequence at xs's batch (its second axis)
    assert braintrace.evaluate(model, xs).shape == (5, 8, 3)


def test_evaluate_takes_the_batch_size_from_the_second_axis_or_says_what_to_pass():
    model, xs = GRUNet(), jax.random.normal(jax.random.key(0), (5, 8, 1))
    np.testing.assert_array_equal(braintrace.evaluate(model, xs),
                                  braintrace.evaluate(model, xs, batch_size=8))
    with pytest.raises(ValueError, match=r"xs has shape\(s\) \(5,\). Pass batch_size: None"):
        braintrace.evaluate(model, xs[:, 0, 0])
    with pytest.raises(ValueError, match=r"batch_size was taken from xs's second axis \(2\).*"
                                         r"pass batch_size=None"):
        braintrace.evaluate(nnx.Sequential(layers.ETPLinear(2, 4, rngs=nnx.Rngs(0)),
                                           layers.LIF(4)), jnp.ones((5, 2)))


def test_a_loss_with_swapped_arguments_says_how_loss_fn_is_called():
    learner = braintrace.compile(GRUNet(), "d_rtrl", jnp.zeros((2, 1)), batch_size=2)
    xs, labels = jnp.ones((3, 2, 1)), jnp.zeros((3, 2), jnp.int32)
    ce = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    with pytest.raises(TypeError) as error:
        learner.etrace_grad(xs, labels, lambda y, logits: ce(logits, y))
    assert str(error.value).startswith(
        "loss_fn(prediction, target) raised TypeError, but loss_fn(target, prediction) runs; "
        "braintrace calls loss_fn as loss_fn(prediction, target) (prediction: the model's output "
        "of one step, float32 (2, 3); target: that step's ys[t], int32 (2,))")
    assert learner.etrace_grad(xs, labels, ce)  # the advice works
    # a loss that fails either way keeps its own error, with what it was given
    with pytest.raises(TypeError) as error:
        learner.etrace_grad(xs, labels, lambda y, t: ce(y.astype(jnp.int32), t))
    assert "braintrace called loss_fn(prediction, target) with prediction" in "".join(
        error.value.__notes__)
