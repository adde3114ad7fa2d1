"""Every public name of the previous release keeps working (moved names are aliases).

``ROUND_2_NAMES`` is ``braintrace.__all__`` as released in round 2: users type
these names, so each must still resolve, and a renamed or moved one must be the
very object of its new home.
"""

import pytest

import braintrace
from braintrace import primitives

ROUND_2_NAMES = (
    "DNI", "D_RTRL", "ES_D_RTRL", "RTRL", "UORO", "AbstractAlgorithm", "Connectivity", "EProp",
    "ETPPrimitive", "ETraceGraph", "HiddenState", "LinearSynthesizer", "MissingRuleError",
    "OSTLFeedforward", "OSTLRecurrent", "OnlineLearner", "OnlineTrainer", "SnAp", "ThreeFactor",
    "__version__", "compile", "compile_graph", "conv", "einsum", "element_wise", "embed_lookup",
    "etp_conv_batched_p", "etp_conv_p", "etp_dense_batched_p", "etp_dense_p",
    "etp_einsum_batched_p", "etp_einsum_p", "etp_elemwise_p", "etp_embed_batched_p",
    "etp_embed_p", "etp_grouped_batched_p", "etp_grouped_p", "etp_lora_batched_p", "etp_lora_p",
    "etp_primitives", "etp_sparse_batched_p", "etp_sparse_p", "grouped_matmul", "init_states",
    "lora_matmul", "matmul", "pp_prop", "register_batched_counterpart", "register_primitive",
    "sparse_matmul", "tasks",
)


@pytest.mark.parametrize("name", ROUND_2_NAMES)
def test_every_round_2_name_still_resolves(name):
    assert getattr(braintrace, name) is not None


def test_renamed_algorithms_are_aliases_of_the_new_classes():
    assert braintrace.D_RTRL is braintrace.DRTRL
    assert braintrace.ES_D_RTRL is braintrace.ESDRTRL
    assert isinstance(braintrace.pp_prop(0.9), braintrace.ESDRTRL)
    learner_names = {"d_rtrl": braintrace.DRTRL, "es_d_rtrl": braintrace.ESDRTRL,
                     "bptt": braintrace.BPTT}
    for name, cls in learner_names.items():  # compile's names build the same classes
        assert type(braintrace.compile(_tiny(), name, _x()).algorithm) is cls


@pytest.mark.parametrize("name", sorted(n for n in primitives.__all__ if n.startswith("etp_")))
def test_primitive_objects_moved_to_braintrace_primitives_are_the_same_objects(name):
    assert getattr(braintrace, name) is getattr(primitives, name)


def _tiny():
    from flax import nnx

    from braintrace import layers

    model = nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(0)), layers.LIF(3))
    braintrace.init_states(model, 1)
    return model


def _x():
    import jax.numpy as jnp

    return jnp.ones((1, 2))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'DRTRL2'"):
        braintrace.DRTRL2  # noqa: B018


def test_every_name_in_all_resolves():
    for name in braintrace.__all__:
        assert hasattr(braintrace, name), name
