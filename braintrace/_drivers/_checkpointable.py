"""What the stateful drivers share to be saved and restored: named items and how to load them.

:class:`OnlineLearner` and :class:`OnlineTrainer` (and, through them,
:class:`~braintrace.CheckpointManager`) speak one protocol: ``_checkpoint_items``
names what a checkpoint holds (``_checkpoint.Item``: the Params under their
Flax paths, hidden and other state, traces, an optimiser's state), and
``_load_checkpoint`` writes what was restored back. :class:`Checkpointable`
turns that protocol into :meth:`~Checkpointable.save` and
:meth:`~Checkpointable.restore`.
"""

from __future__ import annotations

import abc
from typing import Any

from flax import nnx

from braintrace._drivers._checkpoint import Item, restore_checkpoint, save_checkpoint

__all__ = ["Checkpointable"]


class Checkpointable(abc.ABC):
    """A driver that saves and restores itself as named checkpoint items (module docstring)."""

    @abc.abstractmethod
    def _checkpoint_items(self, optimizer: nnx.Optimizer | None = None) -> dict[str, Item]:
        """What a checkpoint of this driver holds, as named items (``_checkpoint.py``)."""

    @abc.abstractmethod
    def _load_checkpoint(self, restored: dict[str, Any],
                         optimizer: nnx.Optimizer | None = None) -> None:
        """Writes restored items (of ``_checkpoint_items``) back into the driver and model."""

    def save(self, path: str, *, optimizer: nnx.Optimizer | None = None) -> None:
        """Saves Params, hidden and other state (RNG keys included) and traces to ``path``.

        ``path`` becomes an orbax checkpoint directory (replacing one there),
        sharded arrays included; on several hosts every process calls this. The
        Params are its item ``params``, ``nnx.state(model, nnx.Param)`` under its
        Flax paths, which plain orbax and Flax restore without braintrace
        (README: "Checkpoints"); an :class:`~braintrace.OnlineTrainer` adds its
        optax state as the item ``opt_state``. It carries a SHA-256 digest of
        its files, checked by :meth:`restore`. For numbered steps, keep-last-N
        and keep-best, use :class:`braintrace.CheckpointManager`.

        Args:
            path: The checkpoint directory.
            optimizer: A user's ``nnx.Optimizer`` (of a training loop of their
                own), saved beside the Params as ``nnx.state(optimizer)``.

        Raises:
            ValueError: ``path`` exists and is not a braintrace checkpoint.

        Example:
            >>> import os, tempfile, jax.numpy as jnp
            >>> from flax import nnx
            >>> import braintrace
            >>> from braintrace import layers
            >>> model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
            >>> learner = braintrace.compile(model, 'd_rtrl', jnp.ones((1, 2)), batch_size=1)
            >>> path = os.path.join(tempfile.mkdtemp(), 'run.ckpt')
            >>> learner.save(path)
            >>> learner.restore(path)
        """
        save_checkpoint(path, self._checkpoint_items(optimizer))

    def restore(self, path: str, *, optimizer: nnx.Optimizer | None = None) -> None:
        """Restores what :meth:`save` wrote, so the run continues identically.

        The arrays are read onto this driver's devices: a checkpoint saved on
        another mesh (or without one) restores here.

        Args:
            path: The checkpoint directory.
            optimizer: The ``nnx.Optimizer`` to restore too (it must have been saved).

        Raises:
            ValueError: The checkpoint is damaged or not one, or it does not
                match this driver (or ``optimizer``); the message names the file
                and the first offending leaf. The model, the driver and the
                optimizer are then unchanged.
        """
        items = self._checkpoint_items(optimizer)
        self._load_checkpoint(restore_checkpoint(path, items), optimizer)
