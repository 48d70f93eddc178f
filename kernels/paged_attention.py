"""Paged decode attention: reference, input validation and backend dispatch.

One query token per sequence attends to the first ``lengths[b]`` tokens of that
sequence's KV cache, which lives in fixed-size pages shared by all sequences::

  token t of sequence b  ->  k_pages[:, page_indices[b, t // P], t % P, :]

Grouped-query attention: query head ``h`` reads KV head ``h // (Hq // Hkv)``.

Conventions every implementation follows (the tests hold them to it):

* Logits are ``sm_scale * q.k`` accumulated in f32, then optionally soft-capped
  (Gemma 2: ``cap * tanh(logits / cap)``); softmax runs in f32.
* f32 inputs get full-f32 matmuls (``Precision.HIGHEST``) everywhere: on NVIDIA
  GPUs XLA and Triton would otherwise use TF32 (~1e-3 relative error). bf16
  inputs keep the default (fast) matmuls.
* ``sliding_window=W`` attends only to the last ``W`` tokens ``[len - W, len)``.
* A sequence with ``lengths[b] == 0`` gets output 0 and log-sum-exp ``-inf``
  (``merge_attention_states`` in ``cascade_attention`` relies on this).
* Whatever sits outside the attended tokens -- NaN/Inf in unused slots of the
  last page, in pages named by unused ``page_indices`` entries, in page 0, or
  out-of-range values in unused ``page_indices`` entries -- never reaches the
  output: scores *and* values are masked with selects, and page indices are
  clipped before any read.

``impl``: ``reference`` (plain ``jnp``, every backend), ``tpu`` (Pallas Mosaic,
``paged_attention_tpu``), ``gpu`` (Pallas Triton, ``paged_attention_gpu``) or
``auto`` (tpu on TPU, gpu on GPU, reference elsewhere). The Pallas flavours run
on CPU with ``interpret=True``; the TPU one also accepts
``interpret=pltpu.InterpretParams(...)`` for the strict interpreter.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from . import paged_attention_gpu
from . import paged_attention_tpu

IMPLS = ("auto", "reference", "tpu", "gpu")
_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_inputs(q, k_pages, v_pages, lengths, page_indices, *, sm_scale,
                  soft_cap, sliding_window) -> None:
  """Raises ValueError naming the first inconsistent argument."""
  for name, x, ndim, layout in (
      ("q", q, 3, "[batch, num_q_heads, head_dim]"),
      ("k_pages", k_pages, 4, "[num_kv_heads, num_pages, page_size, head_dim]"),
      ("v_pages", v_pages, 4, "[num_kv_heads, num_pages, page_size, head_dim]"),
      ("lengths", lengths, 1, "[batch]"),
      ("page_indices", page_indices, 2, "[batch, pages_per_seq]"),
  ):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
      got = getattr(x, "shape", type(x).__name__)
      raise ValueError(f"{name} must have rank {ndim} {layout}, got shape {got}.")
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, head_dim_k = k_pages.shape
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape "
                     f"{k_pages.shape}.")
  if head_dim_k != head_dim:
    raise ValueError(f"k_pages head_dim {head_dim_k} must equal q head_dim "
                     f"{head_dim}.")
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                     f"num_kv_heads={num_kv_heads}.")
  if num_pages < 1 or page_size < 1:
    raise ValueError(f"k_pages needs at least one page of at least one slot, "
                     f"got shape {k_pages.shape}.")
  if lengths.shape != (batch,):
    raise ValueError(f"lengths shape {lengths.shape} must be ({batch},) to "
                     f"match q's batch.")
  if page_indices.shape[0] != batch or page_indices.shape[1] < 1:
    raise ValueError(f"page_indices shape {page_indices.shape} must be "
                     f"({batch}, pages_per_seq>=1) to match q's batch.")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got dtype {x.dtype}.")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages dtype {k_pages.dtype} must equal v_pages dtype "
                     f"{v_pages.dtype}.")
  for name, x in (("lengths", lengths), ("page_indices", page_indices)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array (int32), got dtype "
                       f"{x.dtype}.")
  if isinstance(sm_scale, jax.core.Tracer) or not np.isscalar(sm_scale):
    raise ValueError(f"sm_scale must be a Python float (it is static), got "
                     f"{type(sm_scale).__name__}.")
  if soft_cap is not None and not (np.isscalar(soft_cap) and soft_cap > 0):
    raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}.")
  if sliding_window is not None and not (
      isinstance(sliding_window, (int, np.integer)) and sliding_window > 0):
    raise ValueError(f"sliding_window must be None or a positive int, got "
                     f"{sliding_window!r}.")

  # Value checks only where they are free of tracing: eager calls with concrete
  # arrays (they sync with the device). Inside jit nothing is checked.
  max_len = page_indices.shape[1] * page_size
  if _is_concrete(lengths):
    lengths_np = np.asarray(lengths)
    bad = np.flatnonzero((lengths_np < 0) | (lengths_np > max_len))
    if bad.size:
      b = int(bad[0])
      raise ValueError(f"lengths[{b}]={int(lengths_np[b])} must be in [0, "
                       f"pages_per_seq * page_size = {max_len}].")
    if _is_concrete(page_indices):
      pages_np = np.asarray(page_indices)
      used = (np.arange(pages_np.shape[1])[None, :]
              < -(-lengths_np[:, None] // page_size))
      bad = np.argwhere(used & ((pages_np < 0) | (pages_np >= num_pages)))
      if bad.size:
        b, j = (int(i) for i in bad[0])
        raise ValueError(f"page_indices[{b}, {j}]={int(pages_np[b, j])} is used "
                         f"(lengths[{b}]={int(lengths_np[b])}) and must be in "
                         f"[0, num_pages={num_pages}).")


def _resolve_impl(impl: str, interpret) -> str:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
  backend = jax.default_backend()
  if impl == "auto":
    if backend == "tpu":
      return "tpu"
    if backend in _GPU_BACKENDS:
      return "gpu"
    return "reference"
  if not interpret:
    if impl == "tpu" and backend != "tpu":
      raise ValueError(f"impl='tpu' needs a TPU backend (have {backend!r}); "
                       "pass interpret=True to run it anywhere.")
    if impl == "gpu" and backend not in _GPU_BACKENDS:
      raise ValueError(f"impl='gpu' needs a GPU backend (have {backend!r}); "
                       "pass interpret=True to run it anywhere.")
  return impl


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float,
    impl: str = "auto",
    interpret: Any = False,
    return_lse: bool = False,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
):
  """Decode attention of q[B, Hq, D] over paged K/V.

  Args:
    q: [B, Hq, D] one query token per sequence.
    k_pages, v_pages: [Hkv, N, P, D] page pools (same dtype).
    lengths: i32[B] tokens attended per sequence, in [0, pages_per_seq * P].
    page_indices: i32[B, pages_per_seq] page of each sequence's j-th P tokens;
      entries past a sequence's length may hold anything.
    sm_scale: static logit scale (usually D ** -0.5).
    impl: "auto" | "reference" | "tpu" | "gpu".
    interpret: run the Pallas kernel in interpret mode (CPU); for impl="tpu" a
      ``pltpu.InterpretParams`` selects the strict TPU interpreter.
    return_lse: also return the f32 [B, Hq] log-sum-exp of the attended logits
      (``-inf`` where ``lengths == 0``).
    soft_cap: Gemma 2 logit soft-capping ``cap * tanh(logits / cap)``.
    sliding_window: attend only to the last ``sliding_window`` tokens.
    pages_per_block: kernel tuning -- pages per inner-loop block (tpu, gpu).
    num_splits: kernel tuning -- sequence splits per (batch, KV head) combined
      by log-sum-exp, flash-decoding style (gpu only).

  Returns:
    [B, Hq, D] in q.dtype, and with return_lse the f32 [B, Hq] log-sum-exp.
  """
  _check_inputs(q, k_pages, v_pages, lengths, page_indices, sm_scale=sm_scale,
                soft_cap=soft_cap, sliding_window=sliding_window)
  impl = _resolve_impl(impl, interpret)
  options = dict(sm_scale=float(sm_scale),
                 soft_cap=None if soft_cap is None else float(soft_cap),
                 sliding_window=None if sliding_window is None else int(sliding_window))
  lengths = jnp.asarray(lengths, jnp.int32)
  page_indices = jnp.asarray(page_indices, jnp.int32)
  if impl == "reference":
    out, lse = paged_attention_reference(q, k_pages, v_pages, lengths,
                                         page_indices, **options)
  elif impl == "tpu":
    if num_splits not in (None, 1):
      raise ValueError(f"num_splits={num_splits} is supported by impl='gpu' only.")
    out, lse = paged_attention_tpu.paged_attention_tpu(
        q, k_pages, v_pages, lengths, page_indices, **options,
        pages_per_block=pages_per_block, interpret=interpret)
  else:
    out, lse = paged_attention_gpu.paged_attention_gpu(
        q, k_pages, v_pages, lengths, page_indices, **options,
        pages_per_block=pages_per_block, num_splits=num_splits,
        interpret=bool(interpret))
  return (out, lse) if return_lse else out


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "soft_cap", "sliding_window"))
def paged_attention_reference(q, k_pages, v_pages, lengths, page_indices, *,
                              sm_scale: float, soft_cap: float | None = None,
                              sliding_window: int | None = None):
  """Gathers every sequence's pages and runs a masked f32 softmax.

  Returns (out [B, Hq, D] in q.dtype, lse f32 [B, Hq]).
  """
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  max_len = page_indices.shape[1] * page_size
  group = num_q_heads // num_kv_heads
  pages = jnp.clip(page_indices, 0, num_pages - 1)
  k_HxBxTxD = k_pages[:, pages].reshape(num_kv_heads, batch, max_len, head_dim)
  v_HxBxTxD = v_pages[:, pages].reshape(num_kv_heads, batch, max_len, head_dim)
  q_BxHxGxD = q.reshape(batch, num_kv_heads, group, head_dim)

  compute_dtype = jnp.promote_types(q.dtype, k_pages.dtype)
  logits = jnp.einsum("bhgd,hbtd->bhgt", q_BxHxGxD.astype(compute_dtype),
                      k_HxBxTxD.astype(compute_dtype),
                      preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)

  pos = jnp.arange(max_len)[None, :]
  valid_BxT = pos < lengths[:, None]
  if sliding_window is not None:
    valid_BxT &= pos >= lengths[:, None] - sliding_window
  valid = valid_BxT[:, None, None, :]
  logits = jnp.where(valid, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid, jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  v_HxBxTxD = jnp.where(valid_BxT[None, :, :, None], v_HxBxTxD.astype(jnp.float32), 0.0)
  o = jnp.einsum("bhgt,hbtd->bhgd", p, v_HxBxTxD, precision=lax.Precision.HIGHEST)
  o = o / jnp.where(l > 0, l, 1.0)
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return (o.reshape(batch, num_q_heads, head_dim).astype(q.dtype),
          lse.reshape(batch, num_q_heads))
