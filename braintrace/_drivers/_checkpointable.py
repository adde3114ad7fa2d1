"""What is saved and restored: named items, and how to load them back.

:class:`OnlineLearner` and :class:`OnlineTrainer` (and, through them,
:class:`~braintrace.CheckpointManager`) speak one protocol: ``_checkpoint_items``
names what a checkpoint holds (``_checkpoint.Item``: the Params under their
Flax paths, hidden and other state, traces, an optimiser's state), and
``_load_checkpoint`` writes what was restored back. :class:`Checkpointable`
turns that protocol into :meth:`~Checkpointable.save` and
:meth:`~Checkpointable.restore`. :class:`ModelAndState` speaks the same
protocol for the objects of a user's own train step (a model and the
:class:`~braintrace.OnlineState` of :func:`~braintrace.online_grad`), which
``CheckpointManager.save(step, model=..., state=...)`` saves.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
from flax import nnx

from braintrace._compiler import leaf_paths, split_model
from braintrace._drivers._checkpoint import (
    Item,
    JsonItem,
    leaf_names,
    optimizer_item,
    restore_checkpoint,
    save_checkpoint,
)
from braintrace._drivers._functional import OnlineState

__all__ = ["Checkpointable", "ModelAndState"]


class Checkpointable(abc.ABC):
    """A driver that saves and restores itself as named checkpoint items (module docstring)."""

    @abc.abstractmethod
    def _checkpoint_items(self, optimizer: nnx.Optimizer | None = None
                          ) -> dict[str, Item | JsonItem]:
        """What a checkpoint of this driver holds, as named items (``_checkpoint.py``)."""

    @abc.abstractmethod
    def _load_checkpoint(self, restored: dict[str, Any],
                         optimizer: nnx.Optimizer | None = None) -> None:
        """Writes restored items (of ``_checkpoint_items``) back into the driver and model."""

    def _restore_items(self, path: str, optimizer: nnx.Optimizer | None = None
                       ) -> dict[str, Item | JsonItem]:
        """The items to restore from the checkpoint at ``path``, as templates (by default
        those :meth:`_checkpoint_items` saves)."""
        del path
        return self._checkpoint_items(optimizer)

    def save(self, path: str, *, optimizer: nnx.Optimizer | None = None) -> None:
        """Saves Params, hidden and other state (RNG keys included) and traces to ``path``.

        ``path`` becomes an orbax checkpoint directory (replacing one there),
        sharded arrays included; on several hosts every process calls this. The
        Params are its item ``params``, ``nnx.state(model, nnx.Param)`` under its
        Flax paths, which plain orbax and Flax restore without braintrace
        (``docs/checkpoints.md``); an :class:`~braintrace.OnlineTrainer` adds its
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
        items = self._restore_items(path, optimizer)
        self._load_checkpoint(restore_checkpoint(path, items), optimizer)


class ModelAndState:
    """A model and the :class:`~braintrace.OnlineState` of a user's own train step, as items.

    The model's Variables are the items of a learner's checkpoint of that model
    (``params`` under its Flax paths, ``hidden`` and ``other``: its own hidden
    states and RNG keys and counts); each field of ``state`` is an item
    ``state_<field>`` beside them (``state_hidden`` and ``state_other`` under
    their Flax paths, ``state_traces`` under indices). Loading writes the
    model's Variables back into it and keeps the restored state in
    :attr:`state` (an ``OnlineState`` is immutable: it is returned, not filled).

    Args:
        model: The ``nnx.Module`` whose Params the train step updates.
        state: The ``OnlineState`` the train step carries, or ``None``.
        user: Who is asking, for error messages (e.g. ``'CheckpointManager.save'``).

    Raises:
        TypeError: ``model`` is not an ``nnx.Module`` or ``state`` not an
            ``OnlineState``, or one of their arrays is a tracer (inside ``jit``).
    """

    def __init__(self, model: nnx.Module, state: OnlineState | None, user: str):
        if not isinstance(model, nnx.Module):
            raise TypeError(f"{user}: model must be an nnx.Module (the model your train step "
                            f"updates), got {type(model).__name__}.")
        if state is not None and not isinstance(state, OnlineState):
            hint = (" online_update's init returns (opt_state, state): pass its second element."
                    if isinstance(state, tuple) and len(state) == 2 else "")
            raise TypeError(f"{user}: state must be a braintrace.OnlineState (from online.init "
                            f"or online.grad), got {type(state).__name__}.{hint}")
        if any(isinstance(leaf, jax.core.Tracer)
               for leaf in jax.tree.leaves((nnx.state(model), state))):
            raise TypeError(f"{user} reads and writes files on the host, so it cannot run inside "
                            "jax.jit / nnx.jit: call it between calls of your jit-ed train step.")
        self.model, self.state = model, state

    def _checkpoint_items(self, optimizer: nnx.Optimizer | None = None) -> dict[str, Item]:
        """The model's ``params``, ``hidden``, ``other``; ``state_<field>`` per state field."""
        _, params, hidden, other = split_model(self.model)
        items = {name: Item(tree, [f"{name}/{p}" for p in leaf_paths(tree)])
                 for name, tree in (("params", params), ("hidden", hidden), ("other", other))}
        if self.state is not None:
            for field, tree in zip(self.state._fields, self.state, strict=True):
                name = f"state_{field}"
                items[name] = (Item(tree, [f"{name}/{p}" for p in leaf_paths(tree)])
                               if isinstance(tree, nnx.State) else
                               Item(tree, leaf_names(name, tree), flax=False))
        if optimizer is not None:
            items["optimizer"] = optimizer_item(optimizer)
        return items

    def _restore_items(self, path: str, optimizer: nnx.Optimizer | None = None
                       ) -> dict[str, Item]:
        """The items to restore: those :meth:`_checkpoint_items` saves."""
        del path
        return self._checkpoint_items(optimizer)

    def _load_checkpoint(self, restored: dict[str, Any],
                         optimizer: nnx.Optimizer | None = None) -> None:
        """Writes the model's restored Variables (and ``optimizer``'s) back; keeps the state."""
        for name in ("params", "hidden", "other"):
            nnx.update(self.model, restored[name])
        if self.state is not None:
            self.state = OnlineState(*(restored[f"state_{field}"]
                                       for field in self.state._fields))
        if optimizer is not None:
            nnx.update(optimizer, restored["optimizer"])
