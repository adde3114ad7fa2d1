"""ETP primitives: registration, the rule record and the built-in primitives.

Design note. An ETP primitive is an ordinary JAX op ``y = f(x, θ)`` whose
*identity* tells the compiler "this weight learns online". Everything JAX needs
(impl, abstract evaluation, lowering, JVP, transpose, batching) is derived from
one plain implementation function; what the eligibility-trace algorithms need
is a handful of hand-written rules, kept on the primitive as one frozen
:class:`ETPRules` record. Rules that several primitives share (scaling a trace
along ``y``'s output axis, contracting it with a learning signal, zero traces)
are written once in ``_rules`` and named in each primitive's record.

Modules, imports pointing one way (generic to specific):

* ``_rules``: :class:`ETPRules` and the shared rules; no primitive machinery.
* ``_core``: :class:`ETPPrimitive` (layout, rule lookup) and :class:`MissingRuleError`.
* ``_register``: :func:`register_primitive` and the derived JAX rules,
  :func:`register_batched_counterpart`, :func:`register_pair`, :func:`etp_primitives`.
* ``_dense``, ``_lora``, ``_elemwise``: one built-in each: its impl, layout,
  own rules, rule record and the user-facing op (``matmul``, ``lora_matmul``,
  ``element_wise``).

A new primitive is one more such module: an impl, a layout, the rules it does
not share, an :class:`ETPRules` record and a :func:`register_primitive` (or
:func:`register_pair`) call. ``tests/primitive_cases.py`` lists the primitives
that the contract test (every rule against ``jax.vjp``/``jax.jacobian`` of the
impl) checks.
"""

from ._conv import CONV_RULES as CONV_RULES
from ._conv import conv as conv
from ._conv import etp_conv_batched_p as etp_conv_batched_p
from ._conv import etp_conv_p as etp_conv_p
from ._core import ETPPrimitive as ETPPrimitive
from ._core import MissingRuleError as MissingRuleError
from ._dense import DENSE_RULES as DENSE_RULES
from ._dense import etp_dense_batched_p as etp_dense_batched_p
from ._dense import etp_dense_p as etp_dense_p
from ._dense import matmul as matmul
from ._einsum import EINSUM_RULES as EINSUM_RULES
from ._einsum import einsum as einsum
from ._einsum import etp_einsum_batched_p as etp_einsum_batched_p
from ._einsum import etp_einsum_p as etp_einsum_p
from ._einsum import split_spec as split_spec
from ._elemwise import ELEMWISE_RULES as ELEMWISE_RULES
from ._elemwise import element_wise as element_wise
from ._elemwise import etp_elemwise_p as etp_elemwise_p
from ._embed import EMBED_RULES as EMBED_RULES
from ._embed import embed_lookup as embed_lookup
from ._embed import etp_embed_batched_p as etp_embed_batched_p
from ._embed import etp_embed_p as etp_embed_p
from ._grouped import GROUPED_RULES as GROUPED_RULES
from ._grouped import etp_grouped_batched_p as etp_grouped_batched_p
from ._grouped import etp_grouped_p as etp_grouped_p
from ._grouped import grouped_matmul as grouped_matmul
from ._lora import LORA_RULES as LORA_RULES
from ._lora import etp_lora_batched_p as etp_lora_batched_p
from ._lora import etp_lora_p as etp_lora_p
from ._lora import lora_matmul as lora_matmul
from ._register import decomposed_in as decomposed_in
from ._register import etp_primitives as etp_primitives
from ._register import register_batched_counterpart as register_batched_counterpart
from ._register import register_pair as register_pair
from ._register import register_primitive as register_primitive
from ._register import silent_fallback as silent_fallback
from ._rules import RULE_NAMES as RULE_NAMES
from ._rules import ETPRules as ETPRules
from ._rules import outer_sum as outer_sum
from ._rules import output_axis_contract as output_axis_contract
from ._rules import scale_output_axis as scale_output_axis
from ._rules import sum_leading as sum_leading
from ._rules import zeros_like_output as zeros_like_output
from ._rules import zeros_like_params as zeros_like_params
from ._sparse import SPARSE_RULES as SPARSE_RULES
from ._sparse import Connectivity as Connectivity
from ._sparse import etp_sparse_batched_p as etp_sparse_batched_p
from ._sparse import etp_sparse_p as etp_sparse_p
from ._sparse import sparse_matmul as sparse_matmul

__all__ = [
    "CONV_RULES",
    "DENSE_RULES",
    "EINSUM_RULES",
    "ELEMWISE_RULES",
    "EMBED_RULES",
    "GROUPED_RULES",
    "LORA_RULES",
    "RULE_NAMES",
    "SPARSE_RULES",
    "Connectivity",
    "ETPPrimitive",
    "ETPRules",
    "MissingRuleError",
    "conv",
    "decomposed_in",
    "einsum",
    "element_wise",
    "embed_lookup",
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
    "grouped_matmul",
    "lora_matmul",
    "matmul",
    "outer_sum",
    "output_axis_contract",
    "register_batched_counterpart",
    "register_pair",
    "register_primitive",
    "scale_output_axis",
    "silent_fallback",
    "sparse_matmul",
    "split_spec",
    "sum_leading",
    "zeros_like_output",
    "zeros_like_params",
]
