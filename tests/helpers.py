"""Small helpers shared by the test modules (importable: ``tests`` is on ``pythonpath``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from flax import nnx

__all__ = ["bptt_grads", "built_on_the_host", "compilations", "mse", "primitive_names",
           "sequence_loss", "subprocess_env"]


def subprocess_env(*xla_flags: str) -> dict[str, str]:
    """The environment of a test's JAX subprocess: CPU only, and of ``XLA_FLAGS`` only the
    flags ``conftest.py`` added for the suite (``SUITE_XLA_FLAGS``; a device count or dump
    flag from outside stays out) and ``xla_flags``."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    kept = env.get("SUITE_XLA_FLAGS", "").split()
    if kept or xla_flags:
        env["XLA_FLAGS"] = " ".join([*kept, *xla_flags])
    return env


def built_on_the_host(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build(...)`` run on the CPU, what it made (a model's state, or a tree of arrays)
    then put on the default device.

    On a TPU (``BRAINTRACE_DEVICE_TESTS=1``), JAX's float64 samplers do not compile
    (``truncated_normal``: "Binary op and with different element types: s32[] and u32[]"),
    so the tests' float64 models and data are made on the host, as a checkpoint restored
    onto the chip would be. On the CPU both devices are the same.
    """
    @functools.wraps(build, updated=())  # a class's attributes stay with the class
    def built(*args: Any, **kwargs: Any) -> Any:
        with jax.default_device(jax.devices("cpu")[0]):
            made = build(*args, **kwargs)
        device = jax.devices()[0]
        if isinstance(made, nnx.Module):
            nnx.update(made, jax.device_put(nnx.state(made), device))
            return made
        return jax.device_put(made, device)

    return built


def mse(y: jax.Array, t: jax.Array) -> jax.Array:
    """Mean squared error of one step."""
    return jnp.mean((y - t) ** 2)


# -- the BPTT oracle: the one reference every gradient test compares with ----------------------


def sequence_loss(model: nnx.Module, xs: Any, ys: Any,
                  loss_fn: Callable[[Any, Any], jax.Array] = mse
                  ) -> tuple[Callable[[nnx.State, jax.Array], jax.Array], nnx.State]:
    """``(f, params)``: ``f(params, w) = Σ_t w_t L_t`` by ``jax.lax.scan`` of the pure step.

    Written with Flax alone (no braintrace code): each step is
    ``nnx.merge(graphdef, params, rest, copy=True)(x_t)``, and every Variable
    that is not a Param (hidden states, RNG counters, statistics) is carried
    from step to step, starting from the model's current values; nothing of the
    model is mutated.

    Example:
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> f, params = sequence_loss(model, jnp.ones((3, 2)), jnp.zeros((3, 1)))
        >>> bool(f(params, jnp.ones(3)) == 3 * mse(model(jnp.ones(2)), jnp.zeros(1)))
        True
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def total(params: nnx.State, weights: jax.Array) -> jax.Array:
        def body(rest, inputs):
            x, y, w = inputs
            m = nnx.merge(graphdef, params, rest, copy=True)
            out = m(x)
            return nnx.split(m, nnx.Param, ...)[2], w * loss_fn(out, y)

        return jnp.sum(jax.lax.scan(body, rest, (xs, ys, weights))[1])

    return total, params


def bptt_grads(model: nnx.Module, xs: Any, ys: Any, weights: jax.Array | None = None,
               loss_fn: Callable[[Any, Any], jax.Array] = mse) -> nnx.State:
    """The oracle ``∇_θ Σ_t w_t L_t`` (default ``w_t = 1``), shaped like the model's Params.

    Example:
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> grads = bptt_grads(model, jnp.ones((3, 2)), jnp.zeros((3, 1)))
        >>> grads['kernel'][...].shape
        (2, 1)
    """
    total, params = sequence_loss(model, xs, ys, loss_fn)
    length = jax.tree.leaves(xs)[0].shape[0]
    dtype = jnp.result_type(*jax.tree.leaves(params))
    weights = jnp.ones(length, dtype) if weights is None else weights
    return jax.jit(jax.grad(total))(params, weights)


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Collects the names of the programs XLA compiles inside the block (``jit(name)``).

    Example:
        >>> import jax.numpy as jnp
        >>> def twice(x):
        ...     return 2 * x
        >>> with compilations() as names:
        ...     _ = jax.jit(twice)(jnp.ones(3))
        ...     _ = jax.jit(twice)(jnp.ones(3))
        >>> names.count('twice')
        1
    """
    names: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.match(r"Compiling jit\((\w+)\)", record.getMessage())
            if found:
                names.append(found.group(1))

    logger = logging.getLogger("jax")
    handler = Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


def primitive_names(fn: Callable[..., Any], *args: Any) -> set[str]:
    """Names of the primitives in the jaxpr of ``fn(*args)``, nested bodies included.

    Example:
        >>> import jax.numpy as jnp
        >>> sorted(primitive_names(lambda x: jax.jit(jnp.sin)(x) * 2.0, 1.0))
        ['jit', 'mul', 'sin']
    """
    names: set[str] = set()

    def walk(jaxpr: jex_core.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names
