"""Ctrl+C during :meth:`OnlineTrainer.fit`: finish the batch in flight, then stop.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be can
leave a batch half done (learnt but not recorded, recorded but not evaluated),
and a checkpoint of that state would not resume exactly. Inside
:class:`DeferredInterrupt` the first SIGINT only sets :attr:`requested`: the
loop reads it once a batch is done and stops there. A second SIGINT raises
``KeyboardInterrupt`` at once, as usual.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Self

__all__ = ["DeferredInterrupt"]


class DeferredInterrupt:
    """Within ``with``: the first SIGINT sets :attr:`requested`, a second raises.

    Installed only over Python's own handler, in the main thread (signals are
    delivered there); elsewhere, or under another handler, it changes nothing
    and Ctrl+C raises ``KeyboardInterrupt`` at once. The previous handler is put
    back on exit.

    Example:
        >>> with DeferredInterrupt() as interrupt:
        ...     interrupt.handle(signal.SIGINT, None)   # as a first Ctrl+C would
        ...     interrupt.requested
        True
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> Self:
        self.requested = False
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum: int, frame: Any) -> None:
        """The SIGINT handler: request a stop, or raise if one was requested already."""
        del signum, frame
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nOnlineTrainer.fit: stopping after the batch in flight (Ctrl+C again to stop "
              "at once).", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
