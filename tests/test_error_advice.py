"""Errors whose advice a user can follow: they name the argument or the change to make.

* ``layers.Stateful`` around a Flax cell without ``rngs=``: a ValueError naming
  the cell and the argument, not Flax's bare "RNGs must be provided";
* a long ``lax.scan`` over a weight inside the model step: the error names the
  Param and advises what the model can do (``unroll=True``, a Python loop, one
  step per call), never an argument that no public function takes
  (``max_unroll``); following the advice compiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
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
