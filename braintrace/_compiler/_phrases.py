"""Phrases for reports and errors: lists, operations and states named in module terms.

Example:
    >>> from braintrace._compiler._phrases import listing
    >>> listing(["`a`", "`b`", "`c`"], limit=2)
    '`a`, `b` and 1 more'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax.extend.core as jex_core

from braintrace._compiler._modules import ModuleMap

__all__ = ["EXACT_ALTERNATIVES", "RTRL_COST", "RTRL_TIME", "WINDOWED", "eqn_names", "listing",
           "operations", "params_phrase", "states_phrase"]

RTRL_TIME = ("O(B·N²·|θ|) time per step for B samples, N hidden units and |θ| traced weights, "
             "hundreds of times BPTT's already at 64 neurons")
"""What a step of exact RTRL costs: it multiplies its influence by the ``N × N`` step Jacobian."""

RTRL_COST = f"O(B·N·|θ|) memory and {RTRL_TIME}"
"""What exact RTRL costs in memory (its influence) and time."""

WINDOWED = "windowed mode (chunk_size=K in etrace_grad or online_grad) is exact within K steps"
"""Windowed mode, named by the argument of the drivers that offer it."""

EXACT_ALTERNATIVES = (f"RTRL() follows it exactly but suits small models only ({RTRL_COST}); "
                      f"{WINDOWED}")
"""What to use when the diagonal traces drop a coupling: the strict-exact alternatives."""


def listing(items: Iterable[str], limit: int = 4) -> str:
    """``'a, b and 3 more'``: distinct items in order, at most ``limit`` named."""
    items = list(dict.fromkeys(items))
    more = len(items) - limit
    named = items[:limit]
    if more > 0:
        return f"{', '.join(named)} and {more} more"
    if len(named) > 1:
        return f"{', '.join(named[:-1])} and {named[-1]}"
    return named[0] if named else ""


def eqn_names(jaxpr: jex_core.Jaxpr, eqns: Iterable[int], limit: int = 4) -> str:
    """``"'dot_general' (eqn 3), 'add' (eqn 5)"``: equations for the details."""
    listed = list(dict.fromkeys(f"'{jaxpr.eqns[i].primitive.name}' (eqn {i})" for i in eqns))
    more = f" and {len(listed) - limit} more" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more


def operations(jaxpr: jex_core.Jaxpr, modules: ModuleMap, eqns: Sequence[int],
               verb: tuple[str, str] | None = None) -> str:
    """The modules the equations run in (``'`rnn.cell` (GRUCell)'``), or, without modules,
    the equations' primitives; with ``verb = (singular, plural)``, followed by the verb that
    agrees with them."""
    labels = [label for label in dict.fromkeys(modules.eqn_label(i, "") for i in eqns) if label]
    if labels:
        text, count = listing(labels), len(labels)
    else:
        text, count = "operations " + listing(f"'{jaxpr.eqns[i].primitive.name}'"
                                              for i in eqns), 2
    if verb is None:
        return text
    return f"{text} {verb[0] if count == 1 else verb[1]}"


def params_phrase(paths: Iterable[str], limit: int = 4) -> str:
    """``'`a.kernel`, `a.bias`'``."""
    return listing((f"`{p}`" for p in paths), limit)


def states_phrase(modules: ModuleMap, paths: Iterable[str]) -> str:
    """``'hidden state `rnn.neuron.v` of `rnn.neuron` (LIF)'``."""
    paths = list(dict.fromkeys(paths))
    by_module: dict[str | None, list[str]] = {}
    for p in paths:
        by_module.setdefault(modules.module_of(p), []).append(p)
    parts = []
    for module, members in by_module.items():
        names = listing(f"`{p}`" for p in members)
        parts.append(names if module is None else f"{names} of {modules.label(module)}")
    noun = "hidden state" if len(paths) == 1 else "hidden states"
    return f"{noun} {listing(parts)}"
