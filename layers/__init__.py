"""Drop-in Flax NNX layers whose trainable operations learn online (``braintrace.layers``).

Linear maps (:class:`ETPLinear`, :class:`ETPLoRA`, :class:`ETPLoRALinear`) and
learnable elementwise parameters (:class:`ETPElemwise`) route their weights
through ETP primitives; recurrent cells follow the Flax cell protocol
(``cell(carry, x) -> (carry, y)``) and become one-step models with
:class:`Stateful`; spiking layers keep their state in
:class:`braintrace.HiddenState`\\ s.
"""

from ._conv import ETPConv as ETPConv
from ._conv_spiking import ConvLIF as ConvLIF
from ._cuba import CuBaLIF as CuBaLIF
from ._einsum import ETPEinsum as ETPEinsum
from ._einsum import ETPLinearGeneral as ETPLinearGeneral
from ._elemwise import ETPElemwise as ETPElemwise
from ._elemwise import ExpDecay as ExpDecay
from ._embed import ETPEmbed as ETPEmbed
from ._flatten import Flatten as Flatten
from ._grouped import ETPGroupedLinear as ETPGroupedLinear
from ._if import IF as IF
from ._linear import ETPLinear as ETPLinear
from ._lora import ETPLoRA as ETPLoRA
from ._lora import ETPLoRALinear as ETPLoRALinear
from ._lru import LRU as LRU
from ._lru import LRUCell as LRUCell
from ._min_lstm import MinLSTMCell as MinLSTMCell
from ._optimized_lstm import OptimizedLSTMCell as OptimizedLSTMCell
from ._over_time import MaxOverTime as MaxOverTime
from ._over_time import SumOverTime as SumOverTime
from ._pooling import AvgPool2d as AvgPool2d
from ._pooling import SumPool2d as SumPool2d
from ._readout import LeakyReadout as LeakyReadout
from ._recurrent import GRUCell as GRUCell
from ._recurrent import LSTMCell as LSTMCell
from ._recurrent import MinGRUCell as MinGRUCell
from ._recurrent import SimpleCell as SimpleCell
from ._sparse import ETPSparseLinear as ETPSparseLinear
from ._spiking import ALIF as ALIF
from ._spiking import LIF as LIF
from ._spiking import ExpSynapse as ExpSynapse
from ._spiking import RecurrentSpiking as RecurrentSpiking
from ._stateful import Stateful as Stateful
from ._surrogate import SURROGATES as SURROGATES
from ._surrogate import spike as spike

__all__ = [
    "ALIF",
    "IF",
    "LIF",
    "LRU",
    "SURROGATES",
    "AvgPool2d",
    "ConvLIF",
    "CuBaLIF",
    "ETPConv",
    "ETPEinsum",
    "ETPElemwise",
    "ETPEmbed",
    "ETPGroupedLinear",
    "ETPLinear",
    "ETPLinearGeneral",
    "ETPLoRA",
    "ETPLoRALinear",
    "ETPSparseLinear",
    "ExpDecay",
    "ExpSynapse",
    "Flatten",
    "GRUCell",
    "LRUCell",
    "LSTMCell",
    "LeakyReadout",
    "MaxOverTime",
    "MinGRUCell",
    "MinLSTMCell",
    "OptimizedLSTMCell",
    "RecurrentSpiking",
    "SimpleCell",
    "Stateful",
    "SumOverTime",
    "SumPool2d",
    "spike",
]
