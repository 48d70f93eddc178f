"""Pallas kernels for rlx (installed as ``rlx.kernels``).

Public API:
  paged_attention            decode attention over a paged KV cache (impl switch)
  paged_attention_reference  the plain-jnp reference, returns (out, lse)
  cascade_paged_attention    shared-prefix (GRPO group) paged attention
  group_prefix_attention     its prefix half: a group's queries over its prompt pages, once
  merge_attention_states     log-sum-exp merge of two partial attentions
"""

from .cascade_attention import cascade_paged_attention
from .cascade_attention import group_prefix_attention
from .cascade_attention import merge_attention_states
from .paged_attention import IMPLS
from .paged_attention import paged_attention
from .paged_attention import paged_attention_reference

__all__ = [
    "IMPLS",
    "cascade_paged_attention",
    "group_prefix_attention",
    "merge_attention_states",
    "paged_attention",
    "paged_attention_reference",
]
