"""Mixed precision over every algorithm, loop and time block (issue 59's sweep).

One tiny model, ``h' = α h + x W + b`` (a :class:`~braintrace.layers.LeakyReadout` of 4
units used as a hidden layer) read out by ``tanh(h') W_o + b_o`` (batch 2, input 3), in
three setups, its values the same (drawn in float32, then cast):

* ``float32``: Params, states and data in float32;
* ``bfloat16``: bfloat16 Params and states fed float32 data (the step computes in float32
  and stores its state in bfloat16);
* ``float64-data``: float64 data into the float32 model (``jax.enable_x64``: the step
  computes in float64 and stores its state in float32).

The model is exact for D-RTRL (a leaky integrator under a readout without memory), smooth
(no spike whose flip under rounding would move a gradient by more than rounding), and
its layers return the new state's wide value while storing it narrowed: the case whose
learning signal at ``h^t`` and whose loop carries lost their dtype before.

* ``T = 1``, every registered algorithm (an alias once) and D-RTRL's and ES-D-RTRL's
  ``signal='fast'`` in every setup: BPTT's gradient of the same model in the same dtypes
  to the setup's rounding; OSTTP (whose hidden layer learns from a projection of the
  target, not BPTT's error) its projected-target oracle; ThreeFactor given the
  modulator ``∂L/∂h^1``.
* ``T = 40`` (a default time block of 32 steps and one of 8), in the two mixed setups, one
  algorithm per distinct loop (every algorithm over every loop would not fit the suite's
  time): D-RTRL blocked (the diagonal block product), ES-D-RTRL blocked (a rule's per-step
  ``block_step``; exact at ``T = 1`` only, so against its per-step form, which its blocks
  regroup), OTPE blocked (the readers' stacked values), OSTTP blocked (the fast signal's
  block and the projected inputs), RTRL per step (the full scope), D-RTRL windowed
  (``chunk_size=4``), and ``OnlineTrainer(update_every=2)`` (an update every two steps,
  traces run on), each against BPTT where it is exact. The float32 setup's loops are
  covered over time by the rest of the suite; here it is the control of the ``T = 1`` sweep.
* Float64 data into the float32 model through ``online_grad`` in ``nnx.jit`` and ``fit``.

Every check of a sweep runs, and a failure lists each algorithm that failed with what it
raised. About 26 s of one core in all.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import mse, sequence_loss

import braintrace
from braintrace import layers
from braintrace._algorithms import ALGORITHMS

B, I, H, O = 2, 3, 4, 2
T_LONG = 40  # one default block of 32 steps and one of 8


class Setup(NamedTuple):
    """Dtypes of one setup and the rounding its gradients are compared to (relative, the
    largest over a Param's entries): at ``T = 1`` and over ``T_LONG`` steps."""

    param: Any
    data: Any
    x64: bool
    rounding: float
    rounding_long: float


SETUPS = {
    "float32": Setup(jnp.float32, jnp.float32, False, 1e-6, 1e-6),
    # bfloat16's 8 bits (0.4%) rounded at every stored state, trace and per-step gradient
    # (measured: 1.5% at T = 1, 2.5% over 40 steps)
    "bfloat16": Setup(jnp.bfloat16, jnp.float32, False, 3e-2, 5e-2),
    # the float32 state's rounding (measured: 2e-7 at T = 1, 3e-7 over 40 steps)
    "float64-data": Setup(jnp.float32, jnp.float64, True, 1e-6, 1e-6),
}


@contextlib.contextmanager
def precision(setup: Setup) -> Iterator[None]:
    with jax.enable_x64(setup.x64):
        yield


def cast_variables(model: nnx.Module, dtype: Any) -> nnx.Module:
    """``model`` with every floating Variable cast to ``dtype``."""
    graphdef, state = nnx.split(model)
    cast = lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
    return nnx.merge(graphdef, jax.tree.map(cast, state))


def build(param_dtype: Any) -> nnx.Module:
    """The model in ``param_dtype``, its values drawn in float32 (hidden state random)."""
    model = nnx.Sequential(layers.LeakyReadout(I, H, tau=5.0, rngs=nnx.Rngs(0)), jnp.tanh,
                           layers.ETPLinear(H, O, rngs=nnx.Rngs(1)))
    braintrace.init_states(model, B)
    model.layers[0].y.set_value(0.5 * jax.random.normal(jax.random.key(7), (B, H)))
    return cast_variables(model, param_dtype)


def data(setup: Setup, length: int) -> tuple[jax.Array, jax.Array]:
    xs = jax.random.normal(jax.random.key(1), (length, B, I))
    ys = jax.random.normal(jax.random.key(2), (length, B, O))
    return xs.astype(setup.data), ys.astype(setup.data)


def flat(state: Any) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v, np.float64)
            for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def relative_errors(got: Any, want: Any) -> dict[str, float]:
    g, w = flat(got), flat(want)
    assert g.keys() == w.keys()
    for k, v in w.items():
        assert np.max(np.abs(v)) > 1e-6, f"the reference gradient of {k} is zero"
    return {k: float(np.max(np.abs(g[k] - w[k])) / np.max(np.abs(w[k]))) for k in w}


def assert_close(got: Any, want: Any, rounding: float, what: str) -> None:
    for k, v in flat(got).items():
        assert np.all(np.isfinite(v)), (what, k)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= rounding, (what, errors)


# -- references ---------------------------------------------------------------------


def oracle(model: nnx.Module, xs: jax.Array, ys: jax.Array, weights: jax.Array | None = None,
           loss_fn: Any = mse) -> Any:
    """BPTT of the model in its own dtypes (``helpers.bptt_grads``), its Params' cotangents
    summed over the steps in float32 at least: the Params enter as float32 (at least) copies
    cast to their dtype inside each step, so a bfloat16 model's forward is unchanged and the
    oracle's sum over ``T`` steps is not rounded to bfloat16 at every step."""
    total, params = sequence_loss(model, xs, ys, loss_fn)
    wide = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))
    length = xs.shape[0]
    weights = jnp.ones((length,), xs.dtype) if weights is None else weights
    narrow = lambda p: jax.tree.map(lambda a, like: a.astype(like.dtype), p, params)
    return jax.jit(jax.grad(lambda p: total(narrow(p), weights)))(jax.tree.map(wide, params))


class Split(nnx.Module):
    """``model`` as ``x -> (readout(sg(z)), z)``, ``z = tanh(h^t)`` the hidden layer's output."""

    def __init__(self, model: nnx.Module):
        self.model = model

    def __call__(self, x):
        leaky, act, readout = self.model.layers
        z = act(leaky(x))
        return readout(jax.lax.stop_gradient(z)), z


def projected_oracle(model: nnx.Module, learner: Any, xs: jax.Array, ys: jax.Array) -> Any:
    """OSTTP's gradient when its traces are exact: BPTT of ``Σ_t w_t (L_t + ⟨z^t, y*^t B⟩)``,
    ``w_t = 1/T`` and ``y*`` the target per sample weighted ``1/B`` (a loss averaged over the
    batch); the readout learns from the loss, the hidden layer from the projection."""
    matrices = learner.rules.learning_signal.matrices
    assert len(matrices) == 1, "OSTTP does not see the readout read the hidden layer"
    (matrix,) = matrices
    length = xs.shape[0]

    def objective(out, target):
        y, z = out
        sent = (target.astype(matrix.dtype) @ matrix).astype(z.dtype)
        return mse(y, target) + jnp.sum(z * sent) / B

    grads = oracle(Split(model), xs, ys, loss_fn=objective,
                  weights=jnp.full((length,), 1.0 / length, xs.dtype))
    return grads["model"]


def first_step_signal(model: nnx.Module, xs: jax.Array, ys: jax.Array) -> dict[str, jax.Array]:
    """ThreeFactor's modulator that makes it BPTT at ``T = 1``: ``∂L_1/∂h^1`` (``(1, B, H)``)."""
    leaky, act, readout = nnx.clone(model).layers
    h1 = leaky(xs[0])
    signal = jax.grad(lambda h: mse(readout(act(h)), ys[0]))(h1)
    return {"layers.0.y": signal.astype(leaky.y[...].dtype)[None]}


def sweep_algorithms() -> dict[str, Any]:
    """Every registered algorithm once (an alias left out), and the fast signals."""
    found, seen = {}, set()
    for name, cls in ALGORITHMS.items():
        if cls not in seen:
            seen.add(cls)
            found[name] = cls
    found["d_rtrl-fast"] = lambda: braintrace.DRTRL(signal="fast")
    found["es_d_rtrl-fast"] = lambda: braintrace.ESDRTRL(signal="fast")
    return found


def failures(checks: dict[str, Any]) -> str:
    """Runs every check; one line per check that failed, with what it raised (an assertion,
    or a JAX error): every failure of the sweep at once."""
    found = []
    for name, check in checks.items():
        try:
            check()
        except Exception as error:  # noqa: BLE001
            first = (str(error).splitlines() or [""])[0]
            found.append(f"{name}: {type(error).__name__}: {first[:400]}")
    return "\n".join(found)


def first_step(setup: Setup, name: str, make: Any, xs: jax.Array, ys: jax.Array,
               bptt: Any) -> None:
    """One algorithm at ``T = 1`` against its oracle (module docstring)."""
    model = build(setup.param)
    learner = braintrace.compile(model, make(), xs[0])
    inputs = {}
    if name == "three_factor":
        inputs["modulators"] = first_step_signal(model, xs, ys)
    got = learner.etrace_grad(xs, ys, mse, **inputs)
    want = projected_oracle(build(setup.param), learner, xs, ys) if name == "osttp" else bptt
    assert_close(got, want, setup.rounding, name)


@pytest.mark.parametrize("setup_name", SETUPS)
def test_every_algorithm_equals_bptt_at_t1_in_every_precision(setup_name):
    setup = SETUPS[setup_name]
    with precision(setup):
        xs, ys = data(setup, 1)
        bptt = oracle(build(setup.param), xs, ys)
        found = failures({name: functools.partial(first_step, setup, name, make, xs, ys, bptt)
                          for name, make in sweep_algorithms().items()})
    assert not found, "\n" + found


def accumulated_gradient() -> optax.GradientTransformation:
    """An optax transformation that leaves the Params as they are and sums the gradients it
    is given in its state: the trainer's gradient of every window at fixed Params."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, total, params=None: (jax.tree.map(jnp.zeros_like, grads),
                                           jax.tree.map(jnp.add, total, grads)))


def long_run(setup: Setup, name: str, xs: jax.Array, ys: jax.Array, bptt: Any) -> None:
    """One algorithm and loop over ``T_LONG`` steps (module docstring)."""
    model = build(setup.param)
    if name == "trainer":  # an update every two steps, each window's mean gradient
        learner = braintrace.compile(model, "d_rtrl", xs[0])
        trainer = braintrace.OnlineTrainer(learner, accumulated_gradient(), loss_fn=mse,
                                           update_every=2)
        trainer.step(xs, ys)
        # each window's mean over its 2 steps, summed over T/2 windows: / (T/2), a mean over T
        got = jax.tree.map(lambda g: g / (T_LONG // 2), trainer.opt_state)
        assert_close(got, bptt, setup.rounding_long, name)
        return
    algorithm, loop = {
        "d_rtrl": ("d_rtrl", {}), "otpe": ("otpe", {}), "rtrl": ("rtrl", {}),
        "es_d_rtrl": ("es_d_rtrl", {}), "osttp": ("osttp", {}),
        "d_rtrl-windowed": ("d_rtrl", {"chunk_size": 4})}[name]
    learner = braintrace.compile(model, algorithm, xs[0])
    got = learner.etrace_grad(xs, ys, mse, **loop)
    if name == "osttp":
        want = projected_oracle(build(setup.param), learner, xs, ys)
    elif name == "es_d_rtrl":  # its blocks regroup its per-step recursion: the same gradient
        per_step = braintrace.compile(build(setup.param), algorithm, xs[0])
        want = per_step.etrace_grad(xs, ys, mse, block_size=1)
    else:
        want = bptt
    assert_close(got, want, setup.rounding_long, name)


LOOPS = ("d_rtrl", "es_d_rtrl", "otpe", "osttp", "rtrl", "d_rtrl-windowed", "trainer")


@pytest.mark.parametrize("setup_name", ["bfloat16", "float64-data"])
def test_every_loop_over_two_time_blocks_in_mixed_precision(setup_name):
    setup = SETUPS[setup_name]
    with precision(setup):
        xs, ys = data(setup, T_LONG)
        bptt = oracle(build(setup.param), xs, ys,
                      weights=jnp.full((T_LONG,), 1.0 / T_LONG, setup.data))
        found = failures({name: functools.partial(long_run, setup, name, xs, ys, bptt)
                          for name in LOOPS})
    assert not found, "\n" + found


def test_float64_data_into_a_float32_model_through_the_pure_api_and_fit():
    """Float64 data into the float32 model (the step computes in float64): ``online_grad``
    inside ``nnx.jit``, in time blocks of 2, the state carried from one call to the next,
    equals BPTT's gradient of the second call's steps; ``fit`` trains with it (both raised
    JAX's carry error)."""
    setup = SETUPS["float64-data"]
    with precision(setup):
        xs, ys = data(setup, 8)
        model = build(setup.param)
        want = oracle(build(setup.param), xs, ys,
                      weights=jnp.repeat(jnp.array([0.0, 0.25]), 4))  # the second call's mean
        online = braintrace.online_grad(braintrace.compile(model, "d_rtrl", xs[0]), mse,
                                        block_size=2)
        step = nnx.jit(online.grad)
        _, state, _ = step(model, online.init(model), xs[:4], ys[:4])
        grads, state, stats = step(model, state, xs[4:], ys[4:])
        assert bool(stats.finite.all())
        assert jax.tree.leaves(state.hidden)[0].dtype == jnp.float32
        assert_close(grads, want, setup.rounding, "online_grad")

        trainer = braintrace.OnlineTrainer(braintrace.compile(model, "d_rtrl", xs[0]),
                                           optax.sgd(0.1), loss_fn=mse, update_every=2)
        before = flat(nnx.state(model, nnx.Param))
        history = trainer.fit([(xs, ys)], validation=(xs, ys), progress=False)
        after = flat(nnx.state(model, nnx.Param))
        assert np.isfinite([r["loss"] for r in history.steps]).all()
        assert model.layers[2].kernel[...].dtype == jnp.float32
        assert all(np.all(np.isfinite(after[k])) and np.any(after[k] != before[k])
                   for k in before)
