"""A driver's finiteness check, read one call late so that the host never waits for the device.

The stateful drivers (:class:`~braintrace.OnlineLearner`,
:class:`~braintrace.OnlineTrainer`) run programs that return nothing
non-finite (``_programs.checked_grad_program``, ``checked_train_program``:
where a loss or a gradient is not finite they return zero gradients and the
state they were given), together with the flags that say whether they had to.
Reading those flags on the host right after the call would make the host wait
for the device at every call, so that the next call's dispatch could not
overlap the device's work. A :class:`DeferredCheck` keeps them instead, with
the function that reads them (the *verdict*, which raises the error that names
the offending step or Param), and reads them later:

* at the next call of the driver, right after that call is dispatched (its own
  arguments checked), while the device runs it: nothing between a call's checks
  and its dispatch waits for the device or reads its flags, so the host's time
  before the device can start is the same whether the earlier call is still
  running or long done;
* at ``sync()``, and before anything is saved.

So the error of call ``k`` is raised by call ``k + 1`` (or ``sync()``); call
``k + 1`` then changes nothing (its program ran, on the state call ``k`` left,
but nothing it returned is kept). The flags are copied to the host as soon as
the call is dispatched, so reading them costs no round trip to the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["DeferredCheck"]


class _Pending(NamedTuple):
    copies: tuple[Any, ...]  # the flags' local copies, on their way to this host
    verdict: Callable[..., None]


class DeferredCheck:
    """The flags of a driver's last call and the verdict that reads them (module docstring).

    Attributes:
        failed: The last error a verdict raised (so that a loop can tell it from others).

    Example:
        >>> import jax.numpy as jnp
        >>> check = DeferredCheck()
        >>> def verdict(loss):
        ...     if not jnp.isfinite(loss):
        ...         raise FloatingPointError(f'the loss is {loss}')
        >>> check.defer((jnp.asarray(jnp.nan),), verdict)   # the call returns at once
        >>> check.pending
        True
        >>> check.settle()
        Traceback (most recent call last):
        ...
        FloatingPointError: the loss is nan
        >>> check.pending   # an error is raised once
        False
    """

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        self.failed: FloatingPointError | None = None

    @property
    def pending(self) -> bool:
        """Whether a call's flags are still to be read."""
        return self._pending is not None

    def defer(self, flags: tuple[jax.Array, ...], verdict: Callable[..., None]) -> None:
        """Keeps ``flags`` (starting their copy to the host) to be read by ``verdict`` later.

        Flags of an earlier call still kept are read first (:meth:`settle`).
        """
        self.settle()
        self._pending = _Pending(tuple(map(_start_copy, flags)), verdict)

    def settle(self) -> None:
        """Reads the kept flags with their verdict (which raises if the call went wrong),
        waiting for the device to finish their call if it has not."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        try:
            pending.verdict(*map(np.asarray, pending.copies))
        except FloatingPointError as err:
            self.failed = err
            raise


def _start_copy(flag: Any) -> Any:
    """Starts copying ``flag`` to this host; returns the copy to read (across processes, its
    first local copy: :func:`~braintrace._drivers._sharding.host_arrays`).

    An array on the CPU is in this host's memory already: NumPy reads it where it is,
    and starting a copy would cost the host about 10 µs for nothing.
    """
    if not isinstance(flag, jax.Array):
        return flag
    local_only, on_cpu = _placement(flag.sharding)
    local = flag if local_only else flag.addressable_data(0)
    if not on_cpu:
        local.copy_to_host_async()
    return local


@functools.lru_cache(maxsize=64)
def _placement(sharding: jax.sharding.Sharding) -> tuple[bool, bool]:
    """Whether arrays of ``sharding`` are all on this host's devices, and whether those are
    CPUs (found once per sharding: read at every call, they cost the host a few µs)."""
    return (sharding.is_fully_addressable,
            next(iter(sharding.device_set)).platform == "cpu")
