"""The paged sampler's KV contexts: what the model's attention layers call to write their K/V
into the page pool and attend over it (rlx.sampler.paged runs them).

  PrefillContext  dense causal attention over a chunk of prompts; their K/V go into pages.
  DecodeContext   one token per slot: its K/V into the slot's page, attention over the
                  slot's pages through `Attention` (the kernel chosen by PagedConfig), or,
                  with `Groups`, cascade attention (shared prompt pages once per group).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from rlx import kernels
from rlx.model import transformer

if TYPE_CHECKING:
  from rlx.sampler.paged import PagedConfig


def _cdiv(a, b):
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Attention:
  """Static choice of paged attention kernel."""

  impl: str
  interpret: bool
  context_buckets: int = 1
  cascade: bool = False

  @classmethod
  def make(cls, pc: "PagedConfig") -> "Attention":
    if pc.attention_impl == "reference":
      return cls("reference", False, pc.context_buckets, pc.cascade)
    if pc.attention_impl == "pallas":
      # On CPU "auto" is the reference: bucket it too.
      cpu = jax.default_backend() not in ("tpu", "gpu", "cuda", "rocm")
      return cls("auto", False, pc.context_buckets if cpu else 1, pc.cascade)
    flavour = pc.interpret_flavour
    if flavour == "auto":
      flavour = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"
    return cls(flavour, True, 1, pc.cascade)

  def cascade_attend(self, q_SxHxD, k_pages, v_pages, lengths_S, pages_SxM, groups: "Groups",
                     spec):
    """Shared full prompt pages once per group in flight + each slot's own pages, merged.

    Rows: the distinct groups of the active slots (at most min(S, groups) of them), in
    group order; slot (group g, child j) is sample j of g's row, laid out group-major for
    `rlx.kernels.group_prefix_attention` (the prefix half of `cascade_paged_attention`).
    """
    s, hq, d = q_SxHxD.shape
    page, size = k_pages.shape[2], groups.size
    rows = min(s, groups.pages.shape[0])
    active = lengths_S > 0
    key = jnp.where(active, groups.group_S, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, stable=True)
    ordered = key[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
    row_S = jnp.zeros((s,), jnp.int32).at[order].set(jnp.cumsum(starts, dtype=jnp.int32) - 1)
    put_row = jnp.where(active, row_S, rows)
    row_group = jnp.zeros((rows,), jnp.int32).at[put_row].set(groups.group_S, mode="drop")
    row_prefix = jnp.zeros((rows,), jnp.int32).at[put_row].set(groups.full_S * page,
                                                                 mode="drop")
    member = jnp.where(active, row_S * size + groups.child_S, rows * size)
    q_rows = jnp.zeros((rows * size, hq, d), q_SxHxD.dtype).at[member].set(q_SxHxD,
                                                                           mode="drop")
    options = dict(sm_scale=spec.scale, impl=self.impl, interpret=self.interpret,
                   soft_cap=spec.softcap, return_lse=True)
    o_pre, lse_pre = kernels.group_prefix_attention(
        q_rows, k_pages, v_pages, row_prefix, groups.pages[row_group], group_size=size,
        **options)
    at = jnp.minimum(member, rows * size - 1)
    o_pre = o_pre[at]
    lse_pre = jnp.where(active[:, None], lse_pre[at], -jnp.inf)
    # The slot's own pages start at column full_S (a page-aligned position).
    cols = pages_SxM.shape[1]
    own = jnp.take_along_axis(
        pages_SxM, jnp.minimum(groups.full_S[:, None] + jnp.arange(cols)[None], cols - 1),
        axis=1)
    own_len = jnp.where(active, lengths_S - groups.full_S * page, 0)
    o_own, lse_own = kernels.paged_attention(q_SxHxD, k_pages, v_pages, own_len, own,
                                             **options)
    out, _ = kernels.merge_attention_states(o_pre, lse_pre, o_own, lse_own)
    return out

  def __call__(self, q_BxHxD, k_pages, v_pages, lengths_B, pages_BxM, max_pages, spec):
    """Attention over the first lengths_B[b] tokens; max_pages >= every ceil(len / P)."""
    def attend(width):
      return kernels.paged_attention(
          q_BxHxD, k_pages, v_pages, lengths_B, pages_BxM[:, :width], sm_scale=spec.scale,
          impl=self.impl, interpret=self.interpret, soft_cap=spec.softcap,
          sliding_window=spec.window)

    cols = pages_BxM.shape[1]
    widths = sorted({_cdiv(cols * (i + 1), self.context_buckets)
                     for i in range(self.context_buckets)})
    if len(widths) == 1:
      return attend(cols)
    index = sum((max_pages > w).astype(jnp.int32) for w in widths[:-1])
    return jax.lax.switch(index, [functools.partial(attend, w) for w in widths])


def layer_pages(pages, layer, per_layer: int):
  """A layer's view of page ids: the pool holds every layer's pages on its page axis
  ([Hkv, L * N, P, D]; layer l's page i is l * N + i), so a layer index -- a Python int
  when the layers run unrolled, a traced one inside transformer's layer scan -- is an
  offset, and the kernels read the one pool buffer at it with nothing sliced out."""
  return pages + layer * per_layer


def _write_pages(pages, layer, per_layer: int, pool):
  """Pages to write for this layer; local id per_layer (or any id >= it) means "do not
  write" and maps past the whole pool, so the scatter drops it."""
  return jnp.where(pages < per_layer, layer_pages(pages, layer, per_layer), pool.shape[1])


@struct.dataclass
class PrefillContext:
  """Dense causal attention over a chunk of prompts; writes their K/V into pages."""

  k: jax.Array  # [Hkv, L * N, P, D]: layer l's page i at l * N + i
  v: jax.Array
  pages_CxM: jax.Array  # i32 prompt pages of each prompt (layer-local ids)
  valid_CxT: jax.Array  # bool: real (not padding) prompt token
  per_layer: int = struct.field(pytree_node=False)  # N, pages of one layer

  scannable = True  # layer_attend takes a traced layer index (transformer.scans_layers)

  def layer_attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, q_pos_BxT, spec):
    k_pos = jnp.where(self.valid_CxT, q_pos_BxT, -1)
    allowed = transformer.attention_mask(q_pos_BxT, k_pos, spec.window)
    out = transformer.dot_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, allowed, spec)
    page_size = self.k.shape[2]
    page = jnp.take_along_axis(self.pages_CxM, q_pos_BxT // page_size, axis=1)
    page = _write_pages(jnp.where(self.valid_CxT, page, self.per_layer), layer,
                        self.per_layer, self.k)
    slot = q_pos_BxT % page_size
    k = self.k.at[:, page, slot].set(k_BxTxKxD.transpose(2, 0, 1, 3).astype(self.k.dtype),
                                     mode="drop")
    v = self.v.at[:, page, slot].set(v_BxTxKxD.transpose(2, 0, 1, 3).astype(self.v.dtype),
                                     mode="drop")
    return out, self.replace(k=k, v=v)


@struct.dataclass
class Groups:
  """Per-slot group membership, for cascade attention."""

  group_S: jax.Array  # i32[S] the slot's group (local id)
  child_S: jax.Array  # i32[S] its index within the group
  full_S: jax.Array  # i32[S] shared full prompt pages of its group
  pages: jax.Array  # i32[num_groups, prompt_pages] each group's prompt pages
  size: int = struct.field(pytree_node=False)


@struct.dataclass
class DecodeContext:
  """One token per slot: write its K/V into its page, attend over the slot's pages."""

  k: jax.Array  # [Hkv, L * N, P, D]: layer l's page i at l * N + i; each page 0 stays zero
  v: jax.Array
  page_table_SxM: jax.Array  # i32, layer-local page ids
  lengths_S: jax.Array  # i32 tokens attended, including the one written now (0: none)
  write_page_S: jax.Array  # i32 layer-local; N (out of range) = do not write
  write_slot_S: jax.Array  # i32
  max_pages: jax.Array  # i32[] >= every slot's pages in use (attention reads no further)
  groups: Groups | None
  attention: Attention = struct.field(pytree_node=False)
  per_layer: int = struct.field(pytree_node=False)  # N, pages of one layer

  scannable = True  # layer_attend takes a traced layer index (transformer.scans_layers)

  def layer_attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, q_pos_BxT, spec):
    del q_pos_BxT  # positions are implied by lengths
    n = self.per_layer
    page, slot = _write_pages(self.write_page_S, layer, n, self.k), self.write_slot_S
    k = self.k.at[:, page, slot].set(k_BxTxKxD[:, 0].swapaxes(0, 1).astype(self.k.dtype),
                                     mode="drop")
    v = self.v.at[:, page, slot].set(v_BxTxKxD[:, 0].swapaxes(0, 1).astype(self.v.dtype),
                                     mode="drop")
    table = layer_pages(self.page_table_SxM, layer, n)
    if self.groups is not None and spec.window is None:
      groups = self.groups.replace(pages=layer_pages(self.groups.pages, layer, n))
      out = self.attention.cascade_attend(q_BxTxHxD[:, 0], k, v, self.lengths_S, table,
                                          groups, spec)
    else:
      out = self.attention(q_BxTxHxD[:, 0], k, v, self.lengths_S, table, self.max_pages,
                           spec)
    return out[:, None], self.replace(k=k, v=v)
