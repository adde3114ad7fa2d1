"""Formulations chosen by the backend a program is lowered for.

The same sum can be written in ways that one XLA backend runs well and another
badly. XLA:CPU walks a reduction over a leading axis with a stride, fuses index
arithmetic into every element of a large consumer, and runs a gather of single
elements as cheaply as a load; XLA:TPU (and GPU) run reductions and broadcasts
as vector operations, but a gather of single elements one at a time (measured on
a TPU v5e: 84 µs to spread 4,096 values over 12,288 positions, against well
under a microsecond as a reshape and a broadcast). :func:`by_platform` keeps
both formulations of one computation and lets JAX pick one when the program is
lowered (``jax.lax.platform_dependent``): a program lowered for the CPU holds
only the CPU formulation, one lowered for an accelerator only the other. Both
are pure JAX, so the tests compare them on the CPU: :func:`formulation` makes
every :func:`by_platform` take one of them whatever the backend.

A computation may have a third formulation for TPUs alone, Pallas kernels
(``by_platform(..., tpu=...)``). It is traced only in processes whose default
backend is a TPU: elsewhere it would cost tracing (and building its tables) in every
program for a branch that lowering drops, so a program lowered for a TPU from a CPU
host holds the accelerator formulation. ``formulation('pallas')`` runs it anywhere, its
kernels in Pallas' interpret mode off a TPU (:func:`interpreting`): the tests compare
it with the others on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["FORMULATIONS", "by_platform", "formulation", "interpreting", "tpu_formulations"]

FORMULATIONS = ("cpu", "accelerator", "pallas")
"""The formulations :func:`by_platform` chooses between."""

_forced: list[str] = []
"""The formulation :func:`formulation` imposes (innermost last); empty: by backend."""


@contextlib.contextmanager
def formulation(name: str) -> Iterator[None]:
    """Within the block, every :func:`by_platform` function runs its ``name`` formulation.

    For comparing the two formulations on one backend (the tests run the accelerator
    formulation on the CPU, in float64, against the CPU one). JAX's caches of traced
    programs are cleared on entry and exit, so a program traced inside is not reused
    outside, nor one traced outside inside.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace._platform import by_platform, formulation
        >>> which = by_platform(cpu=lambda a: a, accelerator=lambda a: -a)
        >>> with formulation("accelerator"):
        ...     float(jax.jit(which)(jnp.ones(())))
        -1.0
    """
    if name not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {name!r}.")
    jax.clear_caches()
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()
        jax.clear_caches()


def interpreting() -> bool:
    """Whether Pallas kernels run in interpret mode: under ``formulation('pallas')`` on a
    backend other than a TPU.

    Example:
        >>> from braintrace._platform import formulation, interpreting
        >>> with formulation("pallas"):
        ...     interpreting()
        True
    """
    return bool(_forced) and _forced[-1] == "pallas" and jax.default_backend() != "tpu"


def tpu_formulations() -> bool:
    """Whether :func:`by_platform` traces the ``tpu`` formulations: under
    ``formulation('pallas')``, or by default where the default backend is a TPU. (A caller
    that would otherwise not call :func:`by_platform` at all asks first, so that no program
    for another backend changes.)

    Example:
        >>> from braintrace._platform import formulation, tpu_formulations
        >>> with formulation("pallas"):
        ...     tpu_formulations()
        True
        >>> with formulation("accelerator"):
        ...     tpu_formulations()
        False
    """
    return _forced[-1] == "pallas" if _forced else jax.default_backend() == "tpu"


def by_platform(cpu: Callable[..., Any], accelerator: Callable[..., Any],
                tpu: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A function that runs ``cpu`` in programs lowered for the CPU, ``accelerator`` elsewhere
    (``tpu``, if given, on a TPU: traced only where the default backend is one).

    All must take the same arguments (arrays or pytrees of arrays) and return the same
    shapes and dtypes. Static configuration goes into the functions themselves
    (``functools.partial``), not into the arguments. ``formulation('pallas')`` takes
    ``tpu`` (``accelerator`` where there is none).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from braintrace._platform import by_platform
        >>> total = by_platform(cpu=lambda a: jnp.ones(a.shape[0]) @ a,
        ...                     accelerator=lambda a: jnp.sum(a, axis=0))
        >>> jax.jit(total)(jnp.arange(6.0).reshape(3, 2)).tolist()
        [6.0, 9.0]
    """

    forced = {"cpu": cpu, "accelerator": accelerator, "pallas": tpu or accelerator}

    @functools.wraps(accelerator)
    def run(*args: Any) -> Any:
        if _forced:
            return forced[_forced[-1]](*args)
        if tpu is not None and jax.default_backend() == "tpu":
            return jax.lax.platform_dependent(*args, cpu=cpu, tpu=tpu, default=accelerator)
        return jax.lax.platform_dependent(*args, cpu=cpu, default=accelerator)

    return run
