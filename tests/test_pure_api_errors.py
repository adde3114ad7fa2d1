"""The pure API's and the learner's inputs: float widths are cast, wrong arguments are clear.

* float inputs of another width than the compiled example are cast to its dtype in
  ``etrace_grad``, ``etrace_evolve``, ``learner.evaluate``, ``online_grad`` and
  ``online_update``: bit-identical to casting them first; ``braintrace.evaluate`` (no
  compiled dtype) refuses a step that would change a state's dtype, naming it;
* a state made by another learner (algorithm, batch size, model), ``T = 0``, a model in
  place of the learner, and batch-major input to ``evaluate`` are errors that say what to
  do, and leave the model and the state as they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import mse

import braintrace
from braintrace import layers

B, IN, HID, OUT, T = 4, 2, 5, 2, 4


class Net(nnx.Module):
    def __init__(self, dtype=jnp.float32, hid=HID, seed=0):
        rngs = nnx.Rngs(seed)
        self.enc = layers.ETPLinear(IN, hid, param_dtype=dtype, rngs=rngs)
        self.lif = layers.LIF(hid, tau=4.0, v_th=0.3, param_dtype=dtype)
        self.out = layers.ETPLinear(hid, OUT, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.enc(x)))


def data(dtype, batch_size=B, length=T):
    xs = jax.random.normal(jax.random.key(0), (length, batch_size, IN)).astype(dtype)
    ys = jax.random.normal(jax.random.key(1), (length, batch_size, OUT)).astype(dtype)
    return xs, ys


def arrays(*trees):
    return [np.asarray(a) for a in jax.tree.leaves(trees)]


def assert_same(got, want):
    got, want = arrays(got), arrays(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


# -- float inputs of another width -----------------------------------------------------------

WIDTHS = [  # (algorithm, the model's and example's dtype, the data's dtype, every driver)
    pytest.param("d_rtrl", jnp.float32, jnp.float64, True, id="float64-data-into-float32"),
    pytest.param("d_rtrl", jnp.bfloat16, jnp.float32, False, id="float32-data-into-bfloat16"),
    pytest.param("rtrl", jnp.float64, jnp.float32, False, id="float32-data-into-float64-rtrl"),
]


@pytest.mark.parametrize("algorithm, dtype, given, every_driver", WIDTHS)
def test_float_inputs_of_another_width_are_cast_to_the_compiled_dtype(algorithm, dtype, given,
                                                                     every_driver):
    """Each driver gives what it gives for the inputs cast to the compiled dtype first (the
    programs of the learner and of the pure functions: ``etrace_grad``, ``online_update``;
    with ``every_driver``, ``online_grad``, ``etrace_evolve``, ``learner.evaluate`` and the
    trainer)."""
    with jax.enable_x64(True):
        xs, ys = data(given)
        ys = ys.astype(dtype)
        model = Net(dtype)
        learner = braintrace.compile(model, algorithm, jnp.zeros((B, IN), dtype), batch_size=B)
        online = braintrace.online_grad(learner, mse)
        train = braintrace.online_update(learner, mse, optax.sgd(0.1), update_every=2)
        trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=2)
        params = arrays(nnx.state(model, nnx.Param))

        def run(xs):
            learner.reset()
            results = [learner.etrace_grad(xs, ys, mse),
                       nnx.jit(train.update)(model, *train.init(model), xs, ys)]
            if every_driver:
                results += [nnx.jit(online.grad)(model, online.init(model), xs, ys),
                            learner.evaluate(xs), learner.etrace_evolve(xs),
                            trainer.step(xs, ys), arrays(nnx.state(model, nnx.Param))]
                nnx.update(model, jax.tree.unflatten(jax.tree.structure(
                    nnx.state(model, nnx.Param)), params))
            return results

        assert_same(run(xs), run(xs.astype(dtype)))


def test_evaluate_refuses_a_step_that_would_change_a_states_dtype():
    """``braintrace.evaluate`` has no compiled dtype: it gives ``xs`` to the model as it is,
    and a step that promotes a state (written with ``set_value``) is named."""

    class Promoting(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((3,), jnp.float32))
            self.h = braintrace.HiddenState(jnp.zeros((3,), jnp.float32))

        def __call__(self, x):
            self.h.set_value(0.5 * self.h[...] + self.w[...] * x)
            return self.h[...]

    with jax.enable_x64(True):
        model = Promoting()
        before = arrays(nnx.state(model))
        with pytest.raises(ValueError, match=r"changes 'h' from float32 to float64 \(xs is "
                                             r"float64\).*xs\.astype\(jnp\.float32\)"):
            braintrace.evaluate(model, jnp.ones((4, 2, 3), jnp.float64), batch_size=2)
        assert_same(nnx.state(model), before)
        out = braintrace.evaluate(model, jnp.ones((4, 2, 3), jnp.float32), batch_size=2)
        np.testing.assert_allclose(out[-1], np.full((2, 3), 1.875))


# -- a state from another learner --------------------------------------------------------------


def learner_and_state(algorithm="d_rtrl", batch_size=B, hid=HID):
    model = Net(hid=hid)
    learner = braintrace.compile(model, algorithm, jnp.zeros((batch_size, IN)),
                                 batch_size=batch_size)
    return model, learner, braintrace.online_grad(learner, mse).init(model)


def another_batch():
    _, _, state = learner_and_state()
    _, _, small = learner_and_state(batch_size=3)
    return state._replace(traces=small.traces)


STATES = [
    pytest.param(lambda: learner_and_state("es_d_rtrl")[2], ValueError,
                 r"state\.traces were not made by this learner, which runs algorithm "
                 r"'d_rtrl' at batch size 4 .*4 arrays as \[IOTrace\(\*, \*, \*, \*\)\].*"
                 r"online\.init\(model\)", id="es_d_rtrl-state"),
    pytest.param(lambda: learner_and_state("rtrl")[2], ValueError,
                 r"state\.traces were not made by this learner", id="rtrl-state"),
    pytest.param(another_batch, ValueError,
                 r"state\.traces were not made by this learner.*one is \(3, 5\) float32 where "
                 r"this learner's is \(4, 5\) float32", id="traces-of-batch-3"),
    pytest.param(lambda: learner_and_state(hid=3)[2], ValueError,
                 r"state\.hidden 'lif\.v' is \(4, 3\) float32, but this learner runs it as "
                 r"\(4, 5\) float32 \(at batch size 4\).*another model",
                 id="another-model"),
    pytest.param(lambda: (None, learner_and_state()[2]), TypeError,
                 r"state must be the braintrace\.OnlineState that init\(model\) returns, got a "
                 r"tuple\. It looks like the \(opt_state, state\) pair of online_update's init",
                 id="online-update-pair"),
]


@pytest.mark.parametrize("make, error, message", STATES)
def test_a_state_from_another_learner_is_a_clear_error(make, error, message):
    model, learner, _ = learner_and_state()
    online = braintrace.online_grad(learner, mse)
    state = make()
    before = arrays(nnx.state(model), state, learner.traces)
    with pytest.raises(error, match=message):
        online.grad(model, state, *data(jnp.float32))
    with pytest.raises(error, match=message):
        nnx.jit(online.grad)(model, state, *data(jnp.float32))
    assert_same(arrays(nnx.state(model), state, learner.traces), before)


def test_inputs_of_another_batch_than_the_state_say_to_make_a_state_for_it():
    model, learner, state = learner_and_state()
    online = braintrace.online_grad(learner, mse)
    before = arrays(nnx.state(model), state)
    with pytest.raises(ValueError, match=r"online_grad: grad: xs has shape \(4, 3, 2\).*For a "
                                         r"batch of 3: make its state with online\.init\(model, "
                                         r"batch_size=3\).*If it is batch-major"):
        online.grad(model, state, *data(jnp.float32, batch_size=3))
    train = braintrace.online_update(learner, mse, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"For a batch of 6: make its state with online\.init"
                                         r"\(model, batch_size=6\) \(each batch size"):
        train.update(model, *train.init(model), *data(jnp.float32, batch_size=6))
    assert_same(arrays(nnx.state(model), state), before)


# -- T = 0, a model for the learner, batch-major evaluation --------------------------------


def test_no_time_steps_is_a_clear_error():
    model, learner, state = learner_and_state()
    before = arrays(nnx.state(model), state)
    xs, ys = data(jnp.float32, length=0)
    with pytest.raises(ValueError, match=r"online_grad: grad: xs has no time steps \(T = 0\)"):
        braintrace.online_grad(learner, mse).grad(model, state, xs, ys)
    train = braintrace.online_update(learner, mse, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"online_update: update: xs has no time steps"):
        train.update(model, *train.init(model), xs, ys)
    assert_same(arrays(nnx.state(model), state), before)


@pytest.mark.parametrize("make", [
    lambda model: braintrace.online_grad(model, mse),
    lambda model: braintrace.online_update(model, mse, optax.sgd(0.1)),
], ids=["online_grad", "online_update"])
def test_a_model_in_place_of_the_learner_is_a_type_error(make):
    model = Net()
    before = arrays(nnx.state(model))
    with pytest.raises(TypeError, match=r"takes the learner that braintrace\.compile returns, "
                                        r"got an nnx\.Module \(the model itself\)\. Compile the "
                                        r"model first: learner = braintrace\.compile\("):
        make(model)
    assert_same(nnx.state(model), before)


def test_evaluate_on_batch_major_input_gives_the_time_major_hint():
    model, _, _ = learner_and_state()
    before = arrays(nnx.state(model))
    with pytest.raises(ValueError, match=r"^evaluate: xs has shape \(4, 7, 2\), but "
                                         r"batch_size=4\. Inputs are time-major: \(T, batch, "
                                         r"\*features\)\. This looks batch-major \(4 sequences "
                                         r"of 7 steps\): pass jnp\.swapaxes\(xs, 0, 1\)\.$"):
        braintrace.evaluate(model, jnp.ones((B, 7, IN)), batch_size=B)
    with pytest.raises(ValueError, match=r"its second axis is a batch of 3: pass "
                                         r"batch_size=3\.$"):
        braintrace.evaluate(model, jnp.ones((7, 3, IN)), batch_size=B)
    assert_same(nnx.state(model), before)
