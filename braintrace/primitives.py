"""The ETP primitive objects and the rules they share: for writing and inspecting primitives.

Users of the built-in layers never need this module: the layers call the ops
(:func:`braintrace.matmul`, ...). A new primitive is made with
:func:`braintrace.register_primitive` and given its eligibility-trace rules as
one :class:`ETPRules` record (``prim.register_etp_rules(ETPRules(...))``);
the shared rules below (:func:`scale_output_axis`, :func:`output_axis_contract`,
...) are the ones the built-ins use.

Example:
    >>> import braintrace.primitives as P
    >>> P.etp_dense_p.name, P.etp_dense_p.rules.registered()[:2]
    ('etp_dense', ('xy_to_dw', 'dt_to_t'))
    >>> 'etp_dense_batched' in P.etp_primitives()
    True
"""

from braintrace._primitives import RULE_NAMES as RULE_NAMES
from braintrace._primitives import ETPPrimitive as ETPPrimitive
from braintrace._primitives import ETPRules as ETPRules
from braintrace._primitives import MissingRuleError as MissingRuleError
from braintrace._primitives import etp_conv_batched_p as etp_conv_batched_p
from braintrace._primitives import etp_conv_p as etp_conv_p
from braintrace._primitives import etp_dense_batched_p as etp_dense_batched_p
from braintrace._primitives import etp_dense_p as etp_dense_p
from braintrace._primitives import etp_einsum_batched_p as etp_einsum_batched_p
from braintrace._primitives import etp_einsum_p as etp_einsum_p
from braintrace._primitives import etp_elemwise_p as etp_elemwise_p
from braintrace._primitives import etp_embed_batched_p as etp_embed_batched_p
from braintrace._primitives import etp_embed_p as etp_embed_p
from braintrace._primitives import etp_grouped_batched_p as etp_grouped_batched_p
from braintrace._primitives import etp_grouped_p as etp_grouped_p
from braintrace._primitives import etp_lora_batched_p as etp_lora_batched_p
from braintrace._primitives import etp_lora_p as etp_lora_p
from braintrace._primitives import etp_primitives as etp_primitives
from braintrace._primitives import etp_sparse_batched_p as etp_sparse_batched_p
from braintrace._primitives import etp_sparse_p as etp_sparse_p
from braintrace._primitives import outer_sum as outer_sum
from braintrace._primitives import output_axis_contract as output_axis_contract
from braintrace._primitives import register_batched_counterpart as register_batched_counterpart
from braintrace._primitives import register_pair as register_pair
from braintrace._primitives import register_primitive as register_primitive
from braintrace._primitives import scale_output_axis as scale_output_axis
from braintrace._primitives import sum_leading as sum_leading
from braintrace._primitives import zeros_like_output as zeros_like_output
from braintrace._primitives import zeros_like_params as zeros_like_params

__all__ = [
    "RULE_NAMES",
    "ETPPrimitive",
    "ETPRules",
    "MissingRuleError",
    "etp_conv_batched_p",
    "etp_conv_p",
    "etp_dense_batched_p",
    "etp_dense_p",
    "etp_einsum_batched_p",
    "etp_einsum_p",
    "etp_elemwise_p",
    "etp_embed_batched_p",
    "etp_embed_p",
    "etp_grouped_batched_p",
    "etp_grouped_p",
    "etp_lora_batched_p",
    "etp_lora_p",
    "etp_primitives",
    "etp_sparse_batched_p",
    "etp_sparse_p",
    "outer_sum",
    "output_axis_contract",
    "register_batched_counterpart",
    "register_pair",
    "register_primitive",
    "scale_output_axis",
    "sum_leading",
    "zeros_like_output",
    "zeros_like_params",
]
