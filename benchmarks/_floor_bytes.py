"""The online floor's bytes per step from its terms (``_floor.py``), without JAX: the tables
recompute it from a run's recorded terms."""

from __future__ import annotations


def online_bytes_per_step(terms: dict[str, int], traces: int, block: int, length: int
                          ) -> float:
    """``W + X + 2·Hd + 2·Tr·⌈T/K⌉/T``: ``terms``' ``W``, ``X``, ``Hd`` and ``traces`` bytes
    (``Tr``) read and written once per block of ``block`` steps (``K``) over ``length`` steps
    (``T``; a block longer than the sequence is one pass).

    Example:
        >>> online_bytes_per_step({"W": 10, "X": 2, "Hd": 4}, 100, 32, 100)  # 4 passes
        28.0
    """
    passes = -(-length // block)
    return terms["W"] + terms["X"] + 2 * terms["Hd"] + 2 * traces * passes / length
