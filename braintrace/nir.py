r"""NIR interchange: spiking models of :mod:`braintrace.layers` to and from NIR graphs.

The `Neuromorphic Intermediate Representation <https://neuroir.org>`_ (the
``nir`` package, an optional extra: ``pip install -e ".[nir]"``) describes
spiking networks in continuous time; snnTorch, spyx, Norse, Rockpool, Lava and
several neuromorphic chips read it. This module imports without ``nir``;
:func:`to_nir` and :func:`from_nir` need it.

**Time.** A braintrace layer is one discrete step; one step lasts ``dt`` in
the graph's time unit (the ``dt`` argument, e.g. ``1e-3`` for milliseconds in
seconds). A NIR leaky node

.. math::

    \tau \dot v = (v_{leak} - v) + R\, I

stepped by forward Euler (as snnTorch, spyx and Norse simulate NIR) is
:math:`v_t = (1 - dt/\tau)\, v_{t-1} + (R\, dt/\tau)\, I_t`. A braintrace
neuron is :math:`v_t = \alpha\, \tilde v_{t-1} + x_t` with
:math:`\alpha = e^{-dt_{layer}/\tau_{layer}}` (its own ``tau`` and ``dt``),
so the export writes

.. math::

    \tau_{NIR} = \frac{dt}{1 - \alpha}, \qquad R = \frac{\tau_{NIR}}{dt} = \frac{1}{1 - \alpha},
    \qquad v_{leak} = 0,

which gives Euler's decay :math:`1 - dt/\tau_{NIR} = \alpha` and input gain
:math:`R\, dt/\tau_{NIR} = 1` exactly. The import inverts it: a layer with
``dt`` and :math:`\tau_{layer} = -dt / \ln(1 - dt/\tau_{NIR})` (so
:math:`\tau_{NIR} > dt` is required); a gain :math:`R\, dt/\tau_{NIR} \ne 1`
is multiplied into the weights of the Affine, Linear or Conv node before the
neuron (it must be 1 when there is none). A CubaLIF
(:math:`\tau_{syn} \dot I = -I + w_{in} S`, :math:`\tau_{mem} \dot v = (v_{leak} - v) + R I`)
is an :class:`~braintrace.layers.ExpSynapse`
(:math:`g_t = \alpha_{syn} g_{t-1} + x_t`) feeding a LIF, with
:math:`\tau_{syn} = dt/(1 - \alpha_{syn})`, :math:`w_{in} = 1/(1 - \alpha_{syn})`
and the membrane as above; the membrane reads the synapse's current of the
same step, as in snnTorch's ``Synaptic``.

An IF (:math:`\dot v = R\, I`, no leak) stepped by Euler is
:math:`v_t = v_{t-1} + R\, dt\, I_t`; an :class:`~braintrace.layers.IF` layer (or a
``ConvLIF`` with ``tau=math.inf``) adds its input with gain 1, so the export
writes :math:`R = 1/dt`, and the import folds a gain :math:`R\, dt \ne 1` (spyx
writes :math:`R = 1`) into the weights before it.

**Spikes and resets.** Voltages are not rescaled (the gain is 1):
``v_threshold = v_th`` and ``v_reset = v_reset``. NIR fires
:math:`z = H(v - v_{threshold})` and sets :math:`v \leftarrow v_{reset}` at
once; a braintrace LIF with ``reset='hard'`` fires on the same condition and
sets :math:`\tilde v = v_{reset}` before the next step's leak, which gives the
same spikes (an IF likewise). ``reset='soft'`` (subtract
:math:`v_{th} - v_{reset}`, the default), ``refractory_steps > 0`` and ALIF's
adaptive threshold have no NIR counterpart and are refused with an error naming
the layer.

**Layout.** NIR weights are ``(out, in)`` (``kernel.T``), convolution weights
``(out, in/groups, *kernel)`` and data channels first: a braintrace frame
``(*spatial, C)`` is NIR's ``(C, *spatial)``. A convolution's padding must be
symmetric for the frame size (NIR pads both sides of an axis equally); a
grouped one is written as the equal ``groups=1`` weight with zeros between the
groups (nir's type check reads the input channels off the weight). A CubaLIF
node is named after its LIF. Pooling keeps its window, stride and padding (both
sides of an axis, counted in an average), and :class:`~braintrace.layers.Flatten`
flattens a frame channels first, which is NIR's ``Flatten`` of the whole frame
(``start_dim=0``, ``end_dim=-1``): a weight after it is not permuted either way.

=========================================  ==============================================
braintrace (a chain of these)              NIR nodes (names: the layer's module path)
=========================================  ==============================================
``ETPLinear``                              ``Affine`` (with bias) or ``Linear``
``ETPSparseLinear``                        ``Affine`` / ``Linear``, dense weight, zero off
                                           the connectivity (imports as ``ETPLinear``)
``ETPConv`` (1-D, 2-D)                     ``Conv1d`` / ``Conv2d``
``LIF`` (hard reset)                       ``LIF``
``IF`` (hard reset)                        ``IF``, ``R = 1/dt``
``ExpSynapse`` directly before a ``LIF``   ``CubaLIF``
``ExpSynapse`` (otherwise)                 ``LI``
``LeakyReadout``                           ``Affine``/``Linear`` (``.linear``), ``LI``
``RecurrentSpiking`` (LIF neuron)          ``Affine``/``Linear`` (``.dense_i``), then a
                                           subgraph ``input → LIF ⇄ Linear (dense_h)``,
                                           ``LIF → output`` (snnTorch's layout)
``ConvLIF``                                ``Conv1d``/``Conv2d`` (``.conv``), ``LIF``
                                           ``(C, *out_spatial)`` (``.neuron``); ``IF`` when
                                           ``tau=math.inf``
``SumPool2d`` / ``AvgPool2d``              ``SumPool2d`` / ``AvgPool2d``
``Flatten``                                ``Flatten`` (``start_dim=0``, ``end_dim=-1``)
=========================================  ==============================================

:func:`from_nir` reads the same node kinds back in a chain (an Affine or
Linear followed by an LI is a ``LeakyReadout``, by a recurrent subgraph a
``RecurrentSpiking``; a Conv followed by a LIF or an IF is a ``ConvLIF``) and
refuses anything else (Delay, Threshold, a Flatten of part of a frame, an IF
inside a recurrent subgraph, ...) with an error naming the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

import braintrace._nir as _nir

__all__ = ["from_nir", "to_nir"]


def to_nir(model: nnx.Module, input_shape: Sequence[int] | None = None, *, dt: float) -> Any:
    """Exports a chain of spiking layers to a ``nir.NIRGraph``.

    Reads the current Param values (not the hidden state); see the module
    docstring for the node each layer maps to and the units.

    Args:
        model: An ``nnx.Sequential`` (nested allowed) of supported layers, or one of them.
        input_shape: Per-sample input shape, channels last; default: fixed by the first
            layer (needed when the model starts with a bare ``ETPConv``).
        dt: Length of one model step in the graph's time unit.

    Returns:
        A ``nir.NIRGraph`` with nodes ``input``, one or two per layer, ``output``,
        and edges joining them in order.

    Raises:
        ImportError: The ``nir`` package is not installed (``pip install -e ".[nir]"``).
        TypeError: A module has no NIR mapping (the error names its path and class).
        ValueError: A layer's configuration has no NIR counterpart (soft reset,
            refractoriness, ALIF, asymmetric padding, ...).

    Example:
        >>> from flax import nnx
        >>> from braintrace import layers
        >>> from braintrace.nir import to_nir
        >>> rngs = nnx.Rngs(0)
        >>> model = nnx.Sequential(layers.ETPLinear(4, 8, rngs=rngs),
        ...                        layers.LIF(8, tau=10.0, reset="hard"),
        ...                        layers.LeakyReadout(8, 2, rngs=rngs))
        >>> graph = to_nir(model, dt=1e-3)
        >>> {name: type(node).__name__ for name, node in graph.nodes.items()}
        {'input': 'Input', 'layers.0': 'Affine', 'layers.1': 'LIF', 'layers.2.linear': 'Affine', 'layers.2': 'LI', 'output': 'Output'}
        >>> float(graph.nodes["layers.1"].tau[0])  # dt / (1 - exp(-1/10)) in seconds
        0.010508...
    """
    return _nir.to_nir(model, input_shape, dt=dt)


def from_nir(graph: Any, *, dt: float, param_dtype: Dtype = jnp.float32) -> nnx.Sequential:
    """Imports a chain NIR graph as an ``nnx.Sequential`` of :mod:`braintrace.layers`.

    Neurons get ``dt`` and a ``tau`` in the graph's time unit, hard resets and
    fixed time constants (learnable ones, :class:`~braintrace.layers.ETPElemwise`,
    where the graph gives each neuron its own). Initialise the hidden state with
    :func:`braintrace.init_states` before stepping the model.

    Args:
        graph: A ``nir.NIRGraph`` (e.g. from ``nir.read(path)``) whose nodes between
            its Input and Output form a chain of the kinds in the module docstring.
        dt: Length of one model step in the graph's time unit.
        param_dtype: Dtype of the new layers' Params and states.

    Returns:
        The model, one time step per call.

    Raises:
        ImportError: The ``nir`` package is not installed (``pip install -e ".[nir]"``).
        ValueError: A node has no braintrace layer, or its parameters cannot be
            represented (the error names the node).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import braintrace
        >>> from braintrace import layers
        >>> from braintrace.nir import from_nir, to_nir
        >>> model = nnx.Sequential(layers.ETPLinear(3, 4, rngs=nnx.Rngs(0)),
        ...                        layers.LIF(4, reset="hard"))
        >>> copy = from_nir(to_nir(model, dt=1.0), dt=1.0)
        >>> [type(layer).__name__ for layer in copy.layers]
        ['ETPLinear', 'LIF']
        >>> braintrace.init_states(copy, batch_size=2)
        >>> copy(jnp.ones((2, 3))).shape
        (2, 4)
    """
    return _nir.from_nir(graph, dt=dt, param_dtype=param_dtype)
