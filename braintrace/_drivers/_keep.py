"""Which checkpoint steps are kept: orbax's keep rules, with NaN and infinite metrics never best.

:class:`~braintrace.CheckpointManager` lets orbax keep every step and deletes
the steps these rules do not keep only once a new step is complete
(:func:`unkept`). The rules see the complete steps only (those whose manifest
was written, the ones that restore): a step whose save failed midway is never
best and never counts against ``max_to_keep``. ``best_fn`` values are ranked by
:func:`score`: larger is better whatever ``best_mode`` says, and a NaN or
infinite value (a diverged run) ranks below every finite one, so it never
displaces the best step.
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Saved", "keep_rule", "score", "unkept"]


class Saved(NamedTuple):
    """A saved step as orbax's keep rules read it."""

    step: int
    metrics: Any
    time: datetime.datetime


def score(best_fn: Callable[[Any], float], best_mode: str, metrics: Any) -> float:
    """``best_fn(metrics)``, larger is better; NaN and infinite values rank last (``-inf``).

    Example:
        >>> loss = lambda m: m['loss']
        >>> score(loss, 'min', {'loss': 2.0}), score(loss, 'min', {'loss': float('nan')})
        (-2.0, -inf)
    """
    value = float(best_fn(metrics))
    if not math.isfinite(value):
        return -math.inf
    return value if best_mode == "max" else -value


def keep_rule(options: Any) -> Any:
    """The steps ``options`` keeps, as orbax's preservation policy of them.

    ``options.preservation_policy``, or the policy orbax makes of ``max_to_keep``,
    ``keep_period``, ``keep_time_interval`` and ``best_fn`` (whose NaN and
    infinite values rank last).
    """
    import orbax.checkpoint as ocp

    managers = ocp.checkpoint_managers
    if options.preservation_policy is not None:
        return options.preservation_policy
    policies: list[Any] = []
    if options.keep_period is not None:
        policies.append(managers.EveryNSteps(options.keep_period))
    if options.keep_time_interval is not None:
        policies.append(managers.EveryNSeconds(
            interval_secs=int(options.keep_time_interval.total_seconds())))
    if options.best_fn is not None:
        policies.append(managers.BestN(
            get_metric_fn=functools.partial(score, options.best_fn, options.best_mode),
            n=options.max_to_keep,
            keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics))
    else:
        policies.append(managers.LatestN(n=options.max_to_keep))
    return managers.AnyPreservationPolicy(policies)


def unkept(rule: Any, complete: list[Saved], unfinished: list[int]) -> list[int]:
    """The steps to delete once a step is complete, oldest first.

    The complete steps (oldest first) that ``rule`` (:func:`keep_rule`) does not
    keep, judged among the complete steps alone, and the unfinished steps older
    than the newest complete one: saves that failed before their manifest, which
    never restore. An unfinished step newer than every complete one is left (a
    save in progress elsewhere, or the next save replaces it).

    Example:
        >>> import datetime, orbax.checkpoint as ocp
        >>> now = datetime.datetime.now()
        >>> latest = ocp.checkpoint_managers.LatestN(n=1)
        >>> unkept(latest, [Saved(0, None, now), Saved(2, None, now)], unfinished=[1, 3])
        [0, 1]
    """
    import orbax.checkpoint as ocp

    kept = rule.should_preserve(complete, context=ocp.checkpoint_managers.PreservationContext())
    newest = complete[-1].step if complete else -1
    return sorted([s.step for s, keep in zip(complete, kept, strict=True) if not keep]
                  + [step for step in unfinished if step < newest])
