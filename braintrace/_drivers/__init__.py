"""Drivers: compile a model, the pure online-learning functions, and their stateful shells.

Design note. ``compile`` analyses a model for an algorithm (``_compiled``: one
graph per mode and batch size). The programs (``_programs``) are pure functions
over flat arrays that run the loops (``braintrace/_loops``); the pure public
functions (``_functional``: :func:`online_grad`, :func:`online_update`,
``_evaluate``: :func:`evaluate`) and the stateful conveniences
(:class:`OnlineLearner`, :class:`OnlineTrainer`) are two faces of those same
programs: the shells add host-side checks, clear errors, and writing results
back into the model (``_learner_binding``: what a learner's calls read and write
back). Helpers: ``_inputs`` (argument checks), ``_model_state``
(a model's arrays as flat lists and back), ``_states`` (hidden-state
initialisation), ``_sharding`` (data parallel), ``_checkpoint`` (orbax items and
digests), ``_manager`` (:class:`CheckpointManager`: numbered steps over orbax's
manager), ``_deferred`` (a call's finiteness check, read one call late),
``_fit`` (the streaming training loop of ``OnlineTrainer.fit``, with ``_callbacks``,
``_history``, ``_fit_run``: a run's progress in checkpoints, ``_fit_arguments``,
``_interrupt``) and ``_spike_rates`` (each spiking layer's rate on real inputs, which
``fit`` logs).
"""

from braintrace._drivers._callbacks import Callback as Callback
from braintrace._drivers._callbacks import EarlyStopping as EarlyStopping
from braintrace._drivers._callbacks import ModelCheckpoint as ModelCheckpoint
from braintrace._drivers._compile import compile as compile
from braintrace._drivers._evaluate import evaluate as evaluate
from braintrace._drivers._functional import GradStats as GradStats
from braintrace._drivers._functional import OnlineGradient as OnlineGradient
from braintrace._drivers._functional import OnlineState as OnlineState
from braintrace._drivers._functional import OnlineUpdate as OnlineUpdate
from braintrace._drivers._functional import UpdateStats as UpdateStats
from braintrace._drivers._functional import online_grad as online_grad
from braintrace._drivers._functional import online_update as online_update
from braintrace._drivers._history import History as History
from braintrace._drivers._learner import OnlineLearner as OnlineLearner
from braintrace._drivers._manager import CheckpointManager as CheckpointManager
from braintrace._drivers._model_state import model_leaves as model_leaves
from braintrace._drivers._spike_rates import SpikeRates as SpikeRates
from braintrace._drivers._spike_rates import spike_rates as spike_rates
from braintrace._drivers._states import init_states as init_states
from braintrace._drivers._trainer import OnlineTrainer as OnlineTrainer

__all__ = ["Callback", "CheckpointManager", "EarlyStopping", "GradStats", "History",
           "ModelCheckpoint", "OnlineGradient", "OnlineLearner", "OnlineState", "OnlineTrainer",
           "OnlineUpdate", "SpikeRates", "UpdateStats", "compile", "evaluate", "init_states",
           "model_leaves", "online_grad", "online_update", "spike_rates"]
