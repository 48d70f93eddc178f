"""Cascade (shared-prefix) paged decode attention for GRPO groups.

The ``G`` samples of a group decode from the same prompt, whose KV pages are
shared. Attention splits exactly into a part over the shared prefix and a part
over each sample's own suffix, merged by log-sum-exp::

  softmax over [prefix; suffix] = merge((o_p, lse_p), (o_s, lse_s))

Prefix: the group's ``G`` samples are folded into the GQA axis -- query rows
ordered (kv head, sample, head in group) -- so one ``paged_attention`` call per
group sees ``G * Hq / Hkv`` query rows per KV head and reads every prefix page
once per group instead of ``G`` times. With ``impl="reference"`` this is a
dense einsum over the gathered prefix pages; the Pallas impls get a ``G``-times
taller matmul for the same HBM traffic. Suffix: plain ``paged_attention`` with
``return_lse=True``. Empty prefixes or suffixes (lse ``-inf``) merge exactly.

Inputs are group-major: sample ``j`` of group ``g`` is row ``g * G + j``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import paged_attention as pa


def merge_attention_states(o1, lse1, o2, lse2):
  """Merges two attention results over disjoint key sets.

  Args:
    o1, o2: [..., D] outputs, each normalised over its own keys.
    lse1, lse2: [...] f32 log-sum-exp of each side's logits; ``-inf`` marks an
      empty side, whose output is ignored (even if NaN).

  Returns:
    (o [..., D] in o1.dtype, lse [...] f32); 0 and ``-inf`` if both are empty.
  """
  lse1 = lse1.astype(jnp.float32)
  lse2 = lse2.astype(jnp.float32)
  m = jnp.maximum(lse1, lse2)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w1 = jnp.where(jnp.isfinite(lse1), jnp.exp(lse1 - m_safe), 0.0)
  w2 = jnp.where(jnp.isfinite(lse2), jnp.exp(lse2 - m_safe), 0.0)
  w = w1 + w2
  o = (jnp.where(w1[..., None] > 0, w1[..., None] * o1.astype(jnp.float32), 0.0)
       + jnp.where(w2[..., None] > 0, w2[..., None] * o2.astype(jnp.float32), 0.0))
  o = o / jnp.where(w > 0, w, 1.0)[..., None]
  lse = jnp.where(w > 0, m_safe + jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf)
  return o.astype(o1.dtype), lse


def cascade_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    prefix_lengths: jax.Array,
    prefix_page_indices: jax.Array,
    suffix_lengths: jax.Array,
    suffix_page_indices: jax.Array,
    *,
    group_size: int,
    sm_scale: float,
    impl: str = "auto",
    interpret: Any = False,
    return_lse: bool = False,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
):
  """Decode attention over a group-shared prefix plus per-sample suffixes.

  Args:
    q: [B, Hq, D] with B = num_groups * group_size, group-major.
    k_pages, v_pages: [Hkv, N, P, D] page pools holding prefix and suffixes.
    prefix_lengths: i32[num_groups] shared prompt tokens per group.
    prefix_page_indices: i32[num_groups, prefix_pages] pages of each prompt.
    suffix_lengths: i32[B] tokens of each sample after its prefix.
    suffix_page_indices: i32[B, suffix_pages] pages of each sample's suffix
      (the suffix starts at slot 0 of its first page).
    group_size: samples per group (G), static.
    sm_scale, impl, interpret, soft_cap, pages_per_block, num_splits: as in
      ``paged_attention``.
    return_lse: also return the f32 [B, Hq] log-sum-exp over prefix + suffix.
    sliding_window: not supported (NotImplementedError): the window would start
      at a different prefix position for every sample.

  Returns:
    [B, Hq, D] in q.dtype (and the lse with return_lse); equal to
    ``paged_attention`` over each sample's prefix tokens followed by its suffix
    tokens.
  """
  if sliding_window is not None:
    raise NotImplementedError(
        "cascade_paged_attention does not support sliding_window (each sample's "
        "window would start at a different prefix position); use "
        "paged_attention for sliding-window layers.")
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
  if getattr(q, "ndim", None) != 3 or getattr(k_pages, "ndim", None) != 4:
    raise ValueError(f"q must be [B, Hq, D] and k_pages [Hkv, N, P, D], got "
                     f"shapes {getattr(q, 'shape', q)} and "
                     f"{getattr(k_pages, 'shape', k_pages)}.")
  batch, num_q_heads, _ = q.shape
  num_kv_heads = k_pages.shape[0]
  if getattr(prefix_lengths, "ndim", None) != 1:
    raise ValueError(f"prefix_lengths must be [num_groups], got shape "
                     f"{getattr(prefix_lengths, 'shape', prefix_lengths)}.")
  num_groups = prefix_lengths.shape[0]
  if batch != num_groups * group_size:
    raise ValueError(f"q batch {batch} must equal num_groups * group_size = "
                     f"{num_groups} * {group_size} (num_groups from "
                     f"prefix_lengths).")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                     f"num_kv_heads={num_kv_heads}.")
  options = dict(sm_scale=sm_scale, impl=impl, interpret=interpret,
                 return_lse=True, soft_cap=soft_cap,
                 pages_per_block=pages_per_block, num_splits=num_splits)
  o_prefix, lse_prefix = group_prefix_attention(
      q, k_pages, v_pages, prefix_lengths, prefix_page_indices,
      group_size=group_size, **options)
  o_suffix, lse_suffix = pa.paged_attention(
      q, k_pages, v_pages, suffix_lengths, suffix_page_indices, **options)
  out, lse = merge_attention_states(o_prefix, lse_prefix, o_suffix, lse_suffix)
  return (out, lse) if return_lse else out


def group_prefix_attention(q, k_pages, v_pages, prefix_lengths, prefix_page_indices, *,
                           group_size: int, **options):
  """The prefix half of the cascade: (o [B, Hq, D], f32 lse [B, Hq]), group-major rows.

  One ``paged_attention`` call over ``num_groups`` rows: row ``g * G + j`` of ``q``
  (heads ``h * Hg + r``) becomes query row ``h * G * Hg + j * Hg + r`` of group ``g``,
  so each prefix page is read once per group. ``options`` go to ``paged_attention``
  (``return_lse`` is forced on).
  """
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  per_kv = num_q_heads // num_kv_heads
  num_groups = batch // group_size
  q_fold = (q.reshape(num_groups, group_size, num_kv_heads, per_kv, head_dim)
            .transpose(0, 2, 1, 3, 4)
            .reshape(num_groups, num_kv_heads * group_size * per_kv, head_dim))
  o, lse = pa.paged_attention(q_fold, k_pages, v_pages, prefix_lengths,
                              prefix_page_indices, **{**options, "return_lse": True})
  o = (o.reshape(num_groups, num_kv_heads, group_size, per_kv, head_dim)
       .transpose(0, 2, 1, 3, 4).reshape(batch, num_q_heads, head_dim))
  lse = (lse.reshape(num_groups, num_kv_heads, group_size, per_kv)
         .transpose(0, 2, 1, 3).reshape(batch, num_q_heads))
  return o, lse
