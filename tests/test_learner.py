"""Drivers: compile, etrace_grad, etrace_evolve, reset, checkpoints, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads as oracle
from helpers import compilations, sequence_loss

import braintrace
from braintrace import layers

B, I, H, O = 3, 4, 5, 2


def mse(y, t):
    return jnp.mean((y - t) ** 2)


class LeakyNet(nnx.Module):
    """An exact model: leaky integrator with learnable decay, tanh readout."""

    def __init__(self, rngs, dtype=jnp.float32):
        self.w_in = layers.ETPLinear(I, H, rngs=rngs, param_dtype=dtype)
        self.decay = layers.ETPElemwise(jnp.full((H,), 3.0), layers.ExpDecay(1.0),
                                        param_dtype=dtype)
        self.h = braintrace.HiddenState(jnp.zeros((H,), dtype))
        self.out = layers.ETPLinear(H, O, rngs=rngs, param_dtype=dtype)

    def __call__(self, x):
        self.h[...] = self.decay() * self.h[...] + self.w_in(x)
        return self.out(jnp.tanh(self.h[...]))


def gru_net(rngs, dtype=jnp.float32):
    return nnx.Sequential(layers.Stateful(layers.GRUCell(I, H, rngs=rngs, param_dtype=dtype)),
                          layers.ETPLinear(H, O, rngs=rngs, param_dtype=dtype))


def data(T, key=0, dtype=jnp.float32):
    kx, ky = jax.random.split(jax.random.key(key))
    return (jax.random.normal(kx, (T, B, I), dtype), jax.random.normal(ky, (T, B, O), dtype))


def bptt_grads(model, xs, ys, loss_fn=mse):
    """The oracle of the mean loss over time."""
    length = xs.shape[0]
    return oracle(model, xs, ys, jnp.full(length, 1 / length, xs.dtype), loss_fn)


def max_rel_error(a, b):
    errs = [float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(errs)


def test_etrace_grad_equals_bptt_on_exact_model_and_feeds_nnx_optimizer():
    with jax.enable_x64(True):
        xs, ys = data(12, dtype=jnp.float64)
        model = LeakyNet(nnx.Rngs(0), jnp.float64)
        braintrace.init_states(model, B)
        reference = bptt_grads(model, xs, ys)
        assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(reference)) > 1e-3
        learner = braintrace.compile(model, "d_rtrl", xs[0])
        grads = learner.etrace_grad(xs, ys, mse)
        assert max_rel_error(grads, reference) < 1e-8
        assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(model, nnx.Param))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        before = np.asarray(model.w_in.kernel[...])
        optimizer.update(model, grads)
        assert not np.allclose(before, np.asarray(model.w_in.kernel[...]))


def test_etrace_grad_equals_sum_of_per_step_calls():
    xs, ys = data(6)
    whole = braintrace.compile(gru_net(nnx.Rngs(0)), "es_d_rtrl", xs[0], batch_size=B)
    expected = whole.etrace_grad(xs, ys, mse, reduction="sum")
    stepwise = braintrace.compile(gru_net(nnx.Rngs(0)), "es_d_rtrl", xs[0], batch_size=B)
    total = None
    for t in range(6):
        g = stepwise.etrace_grad(xs[t:t + 1], ys[t:t + 1], mse, reduction="sum")
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    assert max_rel_error(total, expected) < 1e-5


def test_mask_and_reductions_weight_steps():
    xs, ys = data(4)
    make = lambda: braintrace.compile(gru_net(nnx.Rngs(0)), "d_rtrl", xs[0], batch_size=B)
    summed = make().etrace_grad(xs, ys, mse, reduction="sum")
    mean = make().etrace_grad(xs, ys, mse)
    assert max_rel_error(jax.tree.map(lambda g: 4 * g, mean), summed) < 1e-5
    masked = make().etrace_grad(xs, ys, mse, mask=jnp.array([1.0, 1.0, 0.0, 0.0]),
                                reduction="sum")
    first_two = make().etrace_grad(xs[:2], ys[:2], mse, reduction="sum")
    assert max_rel_error(masked, first_two) < 1e-5


def test_repeated_calls_do_not_retrace():
    xs, ys = data(5)
    learner = braintrace.compile(gru_net(nnx.Rngs(0)), "d_rtrl", xs[0], batch_size=B)
    with compilations() as compiled:
        learner.etrace_grad(xs, ys, mse)
        learner.etrace_grad(xs, ys, mse)
        learner.etrace_evolve(xs)
        learner.etrace_grad(xs, ys, mse)
    assert compiled.count("checked_grad_program") == 1


def test_evolve_advances_state_like_the_model_itself():
    xs, _ = data(5)
    model = gru_net(nnx.Rngs(0))
    learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=B)
    ys = learner.etrace_evolve(xs)
    reference = gru_net(nnx.Rngs(0))
    braintrace.init_states(reference, B)
    expected = jnp.stack([reference(x) for x in xs])
    np.testing.assert_allclose(ys, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.layers[0].carry[...], reference.layers[0].carry[...],
                               rtol=1e-5, atol=1e-6)
    one = learner(xs[0])
    assert one.shape == (B, O)


def test_reset_changes_batch_size():
    xs, ys = data(3)
    learner = braintrace.compile(gru_net(nnx.Rngs(0)), "d_rtrl", xs[0], batch_size=B)
    learner.reset(batch_size=2)
    grads = learner.etrace_grad(xs[:, :2], ys[:, :2], mse)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    with pytest.raises(ValueError, match="compiled for"):
        learner.etrace_grad(xs, ys, mse)


def test_checkpoint_resume_matches_uninterrupted_run(tmp_path):
    xs, ys = data(8)
    tx = optax.adam(1e-2)

    def trainer():
        learner = braintrace.compile(gru_net(nnx.Rngs(0)), "es_d_rtrl", xs[0], batch_size=B)
        return braintrace.OnlineTrainer(learner, tx, loss_fn=mse)

    straight = trainer()
    straight.step(xs[:4], ys[:4])
    expected = straight.step(xs[4:], ys[4:])

    first = trainer()
    first.step(xs[:4], ys[:4])
    path = str(tmp_path / "run.ckpt")
    first.save(path)
    resumed = trainer()
    resumed.restore(path)
    got = resumed.step(xs[4:], ys[4:])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(straight.learner.model)),
                    jax.tree.leaves(nnx.state(resumed.learner.model))):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    xs, _ = data(2)
    small = braintrace.compile(gru_net(nnx.Rngs(0)), "d_rtrl", xs[0], batch_size=B)
    path = str(tmp_path / "small.ckpt")
    small.save(path)
    other = braintrace.compile(LeakyNet(nnx.Rngs(0)), "d_rtrl", xs[0], batch_size=B)
    with pytest.raises(ValueError, match="does not match"):
        other.restore(path)


@pytest.mark.parametrize("name", ["d_rtrl", "es_d_rtrl", "pp_prop", "eprop", "ostl_recurrent",
                                  "ostl_feedforward", "bptt"])
def test_algorithm_names_compile(name):
    xs, ys = data(2)
    learner = braintrace.compile(LeakyNet(nnx.Rngs(0)), name, xs[0], batch_size=B)
    grads = learner.etrace_grad(xs, ys, mse)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    expected = "es_d_rtrl" if name == "pp_prop" else name
    assert f"algorithm: {expected}" in learner.report()


def test_bad_input_errors():
    xs, ys = data(4)
    with pytest.raises(ValueError, match="Unknown algorithm 'bppt'.*'bptt'"):
        braintrace.compile(LeakyNet(nnx.Rngs(0)), "bppt", xs[0], batch_size=B)
    learner = braintrace.compile(LeakyNet(nnx.Rngs(0)), "d_rtrl", xs[0], batch_size=B)
    with pytest.raises(ValueError, match="4 time steps but ys has"):
        learner.etrace_grad(xs, ys[:3], mse)
    with pytest.raises(ValueError, match=r"compiled for steps of shape \(3, 4\)"):
        learner.etrace_grad(xs[:, :2], ys[:, :2], mse)
    with pytest.raises(ValueError, match="scalar"):
        learner.etrace_grad(xs, ys, lambda y, t: (y - t) ** 2)
    with pytest.raises(ValueError, match="reduction"):
        learner.etrace_grad(xs, ys, mse, reduction="max")
    with pytest.raises(ValueError, match="chunk_size"):
        learner.etrace_grad(xs, ys, mse, chunk_size=3)
    with pytest.raises(ValueError, match="mask"):
        learner.etrace_grad(xs, ys, mse, mask=jnp.ones(3))


def test_nan_loss_stops_with_step_index_and_keeps_params():
    xs, ys = data(6)
    ys = ys.at[3].set(jnp.nan)
    learner = braintrace.compile(LeakyNet(nnx.Rngs(0)), "d_rtrl", xs[0], batch_size=B)
    learner.etrace_grad(xs, ys, mse)
    with pytest.raises(FloatingPointError, match="time step 3"):
        learner.sync()
    model = LeakyNet(nnx.Rngs(0))
    learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=B)
    before = [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=2)
    trainer.step(xs, ys)
    with pytest.raises(FloatingPointError, match="time step 3"):
        trainer.sync()
    after = [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_compiled_memory_is_flat_in_sequence_length_while_bptt_grows():
    def temp_bytes(lowered):
        return lowered.compile().memory_analysis().temp_size_in_bytes

    learner = braintrace.compile(gru_net(nnx.Rngs(0)), "es_d_rtrl", jnp.zeros((B, I)),
                                 batch_size=B)
    params = nnx.state(learner.model, nnx.Param)

    def bptt(params, xs, ys):
        f, _ = sequence_loss(learner.model, xs, ys)
        return f(params, jnp.ones(xs.shape[0], xs.dtype)) / xs.shape[0]

    online, offline = {}, {}
    # the same T mod K (4, for blocks of 16 or 32): the last, shorter block holds as many steps
    for T in (100, 10_020):
        xs = jax.ShapeDtypeStruct((T, B, I), jnp.float32)
        ys = jax.ShapeDtypeStruct((T, B, O), jnp.float32)
        online[T] = temp_bytes(learner.lower_etrace_grad(xs, ys, mse))
        offline[T] = temp_bytes(jax.jit(jax.grad(bptt)).lower(params, xs, ys))
    assert online[10_020] <= 1.1 * online[100] + 1024
    assert offline[10_020] > 20 * offline[100]


class PerSampleLeaky(nnx.Module):
    def __init__(self, rngs, dtype):
        self.lin = layers.ETPLinear(I, H, rngs=rngs, param_dtype=dtype)
        self.h = braintrace.HiddenState(jnp.zeros((H,), dtype))

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.lin(x)
        return jnp.tanh(self.h[...])


class VmappedLeaky(nnx.Module):
    """A per-sample model batched with nnx.vmap: hidden state per lane, Params shared."""

    def __init__(self, rngs, dtype):
        self.inner = PerSampleLeaky(rngs, dtype)

    def __call__(self, x):
        axes = nnx.StateAxes({braintrace.HiddenState: 0, ...: None})
        return nnx.vmap(lambda m, x: m(x), in_axes=(axes, 0))(self.inner, x)


def test_per_sample_model_under_nnx_vmap_learns_exactly():
    with jax.enable_x64(True):
        xs, _ = data(6, dtype=jnp.float64)
        ys = jax.random.normal(jax.random.key(5), (6, B, H), jnp.float64)
        model = VmappedLeaky(nnx.Rngs(0), jnp.float64)
        braintrace.init_states(model, B)
        reference = bptt_grads(model, xs, ys)
        learner = braintrace.compile(model, "d_rtrl", xs[0])
        assert learner.graph.traced_param_paths == ("inner.lin.bias", "inner.lin.kernel")
        assert max_rel_error(learner.etrace_grad(xs, ys, mse), reference) < 1e-8


def test_trainer_mask_zero_weights_leave_params_unchanged_and_batches_may_carry_masks():
    xs, ys = data(4)
    model = LeakyNet(nnx.Rngs(0))
    learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=B)
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse)
    before = [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    trainer.step(xs, ys, jnp.zeros(4))
    for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    history = trainer.fit([(xs, ys, jnp.array([0.0, 0.0, 1.0, 1.0]))], progress=False)
    assert len(history) == 1
    assert any(not np.array_equal(a, b)
               for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))))
