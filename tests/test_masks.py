"""Per-sample masks ``(T, B)``: padded steps and padded samples change nothing (float64).

A batch of sequences of different lengths is padded to ``T`` steps; the mask
scores step ``t`` of sample ``b`` with ``m_tb``. The gradient of
``reduction='sum'`` is ``Σ_tb m_tb ℓ_tb / B`` (a ``(T,)`` mask, or all ones,
gives ``Σ_t L_t`` with ``L_t`` the batch's mean loss) and of ``'mean'`` the mean
over the scored (step, sample) pairs; checked against the BPTT oracle of
``tests/helpers.py`` with the mask inside the loss, in every driver.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads, mse

import braintrace
from braintrace import layers

T, B, IN, OUT = 6, 3, 2, 2
LENGTHS = (6, 4, 2)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def build(batch=B):
    f64 = {"param_dtype": jnp.float64}
    model = nnx.Sequential(layers.ETPLinear(IN, 4, rngs=nnx.Rngs(0), **f64),
                           layers.LIF(4, tau=4.0, v_th=0.3, **f64), layers.ETPLinear(4, OUT, rngs=nnx.Rngs(1),
                                                                    **f64))
    braintrace.init_states(model, batch)
    return model


def padded_batch():
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, IN), jnp.float64)
    ys = jax.random.normal(jax.random.key(1), (T, B, OUT), jnp.float64)
    mask = (jnp.arange(T)[:, None] < jnp.array(LENGTHS)[None]).astype(jnp.float64)
    xs = jnp.where(mask[..., None] > 0, xs, 1e3)  # garbage where padded
    return xs, ys, mask


def masked_oracle(model, xs, ys, mask, reduction):
    """BPTT of ``Σ_tb m_tb ℓ_tb / B`` (``'mean'``: divided by ``Σ m / B``), the mask a target."""
    def loss_fn(y, target):
        t, m = target
        return jnp.sum(m * jax.vmap(mse)(y, t)) / y.shape[0]

    grads = bptt_grads(model, xs, (ys, mask), loss_fn=loss_fn)
    scale = jnp.sum(mask) / mask.shape[1] if reduction == "mean" else 1.0
    return jax.tree.map(lambda g: g / scale, grads)


def assert_close(got, want, tol=1e-10):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        w = np.asarray(w)
        assert np.max(np.abs(w)) > 1e-6, path
        err = np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w))
        assert err <= tol, (jax.tree_util.keystr(path), err)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("algorithm", ["d_rtrl", "rtrl", "bptt"])
def test_padded_steps_add_nothing_to_the_online_gradient(algorithm, reduction):
    xs, ys, mask = padded_batch()
    want = masked_oracle(build(), xs, ys, mask, reduction)
    learner = braintrace.compile(build(), algorithm, xs[0], strict=algorithm != "bptt")
    got = learner.etrace_grad(xs, ys, mse, mask=mask, reduction=reduction)
    assert_close(got, want)


def test_a_padded_sample_changes_nothing_in_the_mean():
    xs, ys, mask = padded_batch()
    mask = mask.at[:, 2].set(0.0)  # the third sample is padding only
    three = braintrace.compile(build(3), "d_rtrl", xs[0])
    two = braintrace.compile(build(2), "d_rtrl", xs[0, :2])
    got = three.etrace_grad(xs, ys, mse, mask=mask)
    want = two.etrace_grad(xs[:, :2], ys[:, :2], mse, mask=mask[:, :2])
    assert_close(got, want)


def test_the_pure_gradient_takes_per_sample_masks_under_jit():
    xs, ys, mask = padded_batch()
    model = build()
    want = masked_oracle(build(), xs, ys, mask, "mean")
    online = braintrace.online_grad(braintrace.compile(model, "d_rtrl", xs[0]), mse)
    grads, _, stats = jax.jit(lambda s, m: online.grad(model, s, xs, ys, mask=m))(
        online.init(model), mask)
    assert_close(grads, want)
    # each step's reported loss is the mean over its scored samples
    ell = jax.vmap(jax.vmap(mse))(braintrace.evaluate(build(), xs, batch_size=B), ys)
    want_losses = jnp.sum(ell * mask, 1) / jnp.sum(mask, 1)
    np.testing.assert_allclose(stats.losses, want_losses, rtol=1e-10)


def test_the_trainer_applies_the_same_per_sample_weights():
    xs, ys, mask = padded_batch()
    want = masked_oracle(build(), xs, ys, mask, "sum")
    model = build()
    learner = braintrace.compile(model, "d_rtrl", xs[0])
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(1.0), loss_fn=mse, update_every=T)
    trainer.step(xs, ys, mask)
    step = jax.tree.map(lambda a, b: (a - b) * (T * 1.0), before, nnx.state(model, nnx.Param))
    assert_close(step, want, 1e-9)  # sgd(1): Params move by the window's mean gradient


def test_bad_per_sample_masks_are_named():
    xs, ys, mask = padded_batch()
    learner = braintrace.compile(build(), "d_rtrl", xs[0])
    with pytest.raises(ValueError, match=r"mask must have shape \(6,\) or \(6, 3\)"):
        learner.etrace_grad(xs, ys, mse, mask=mask[:, :2])
    with pytest.raises(ValueError, match=r"mask\[1, 2\] is nan"):
        learner.etrace_grad(xs, ys, mse, mask=mask.at[1, 2].set(jnp.nan))
    with pytest.raises(ValueError, match="mask must hold real"):
        learner.etrace_grad(xs, ys, mse, mask=mask.astype(jnp.complex128))
