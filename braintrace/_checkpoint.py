"""Saving and restoring pytrees of arrays with Flax's msgpack serialisation."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import serialization

__all__ = ["restore_leaves", "save_leaves"]


def save_leaves(path: str, tree: Any) -> None:
    """Writes the leaves of ``tree`` to ``path`` (structure comes from a template on restore)."""
    leaves = jax.tree.leaves(tree)
    payload = {f"{i:06d}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
    with open(path, "wb") as f:
        f.write(serialization.msgpack_serialize(payload))


def restore_leaves(path: str, template: Any) -> Any:
    """Reads leaves written by :func:`save_leaves` into the structure of ``template``.

    Raises:
        ValueError: The file does not match the template (another model or algorithm).
    """
    with open(path, "rb") as f:
        payload = serialization.msgpack_restore(f.read())
    leaves, treedef = jax.tree.flatten(template)
    stored = [payload[k] for k in sorted(payload)]
    if len(stored) != len(leaves) or any(
            np.shape(a) != np.shape(b) for a, b in zip(stored, leaves)):
        raise ValueError(
            f"The checkpoint at {path} does not match this learner (different model, batch "
            "size or algorithm): it holds "
            f"{len(stored)} arrays, this learner {len(leaves)}.")
    return jax.tree.unflatten(
        treedef, [jax.numpy.asarray(a, dtype=np.asarray(b).dtype) for a, b in zip(stored, leaves)])
