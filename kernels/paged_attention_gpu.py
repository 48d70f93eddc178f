"""Paged decode attention as a Pallas GPU kernel (Triton lowering).

Why Triton-lowered Pallas and not Mosaic GPU: Mosaic GPU is JAX's supported GPU
path (Hopper+), but its kernels (TMA copies, mbarriers, warpgroup MMA) cannot
run under ``interpret=True`` on CPU, and this project validates kernels on CPU
machines. The Triton lowering is deprecated from JAX 0.11 but ships in 0.10 and
0.11, runs in interpret mode on CPU, and its Pallas -> Triton IR lowering runs
on CPU too (``jit(...).trace(...).lower(lowering_platforms=("cuda",))``, which
the tests do), so the only unchecked step is Triton's own PTX compile. Decode
attention is bandwidth-bound (one query token; the GQA group gives only a few
MMA rows), so plain Triton loads should reach most of the HBM bandwidth that
TMA would. If the Triton backend is removed, this module is the one to port;
the reference and the tests stay.

Layout: grid ``(batch, kv_head, split)``. Each program takes the ``G`` query
heads of one KV head, padded to ``Gp = max(16, next_pow2(G))`` rows (Triton
needs power-of-two tensors and MMA needs >= 16 rows), and walks its share of
the sequence ``pages_per_block`` pages at a time (``block = pages_per_block *
P`` >= 16 tokens): gather-load K, ``s = q @ k.T`` in f32, online softmax,
gather-load V, ``acc += p @ v``. With ``num_splits > 1`` (flash-decoding) each
split writes a normalised partial output and its log-sum-exp, merged outside
the kernel. Positions outside ``[max(0, len - window), len)`` are masked in the
scores and in V with selects, so garbage in unused slots never leaks.
Constraints: head_dim and page_size powers of two, head_dim >= 16.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

try:  # Deprecated from JAX 0.11; keep `rlx.kernels` importable without it.
  from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover
  pl_triton = None

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_DOT = 16  # Triton MMA needs every matmul dim >= 16.
_MAX_TILE = 8192  # Gp * block elements of the f32 score tile (register budget).
_MAX_BLOCK_TOKENS = 128


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _paged_decode_kernel(
    lengths_ref,  # i32[1] this sequence's length
    pages_ref,  # i32[cols] this sequence's page table, padded and clipped
    q_ref,  # [Gp, D]
    k_ref,  # [N, P, D] this KV head's page pool
    v_ref,  # [N, P, D]
    o_ref,  # f32[Gp, D] normalised output of this split
    lse_ref,  # f32[Gp] log-sum-exp of this split
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    blocks_per_split: int,
):
  split = pl.program_id(2)
  page_size, head_dim = k_ref.shape[1], k_ref.shape[2]
  rows = q_ref.shape[0]
  block = pages_per_block * page_size
  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  # f32 inputs get true f32 matmuls: Triton's default for f32 dots is TF32
  # (10 mantissa bits, ~1e-3 relative error); HIGHEST lowers to IEEE. 16-bit
  # inputs keep the default (the fast MMA path).
  precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

  length = lengths_ref[0]
  start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
  lo = jnp.maximum(lax.div(start, block), split * blocks_per_split)
  hi = jnp.minimum(lax.div(length + block - 1, block),
                   (split + 1) * blocks_per_split)
  q = q_ref[...].astype(compute_dtype)

  def body(i, carry):
    m_prev, l_prev, acc_prev = carry
    pages = pages_ref[pl.ds(i * pages_per_block, pages_per_block)]
    pos = i * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    valid = (pos >= start) & (pos < length)

    k = k_ref[pages].reshape(block, head_dim).astype(compute_dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid[None, :], s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid[None, :], jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1)

    v = v_ref[pages].reshape(block, head_dim).astype(compute_dtype)
    v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return m_next, l_next, alpha[:, None] * acc_prev + pv

  init = (jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, head_dim), jnp.float32))
  m, l, acc = lax.fori_loop(lo, hi, body, init)
  nonempty = l > 0
  l_safe = jnp.where(nonempty, l, 1.0)
  o_ref[...] = jnp.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)


def _num_sms() -> int:
  device = jax.devices()[0]
  if device.platform == "gpu":
    return getattr(device, "core_count", None) or 132  # H200 has 132 SMs.
  return 132


def default_pages_per_block(page_size: int, pages_per_seq: int, rows: int) -> int:
  block_tokens = max(_MIN_DOT, min(_MAX_BLOCK_TOKENS, _MAX_TILE // rows))
  pages = max(1, block_tokens // page_size)
  # No point in blocks longer than the sequence, but keep the dot dims >= 16.
  pages = min(pages, _next_pow2(pages_per_seq))
  return max(pages, _next_pow2(pl.cdiv(_MIN_DOT, page_size)))


def _check_gpu_shapes(head_dim: int, page_size: int, pages_per_block: int) -> None:
  if not (_is_pow2(head_dim) and head_dim >= _MIN_DOT):
    raise NotImplementedError(
        f"impl='gpu' needs head_dim to be a power of two >= {_MIN_DOT} (Triton "
        f"tensors), got {head_dim}; use impl='reference'.")
  if not _is_pow2(page_size):
    raise NotImplementedError(
        f"impl='gpu' needs page_size to be a power of two, got {page_size}; "
        "use impl='reference'.")
  if not _is_pow2(pages_per_block) or pages_per_block * page_size < _MIN_DOT:
    raise ValueError(
        f"pages_per_block={pages_per_block} must be a power of two with "
        f"pages_per_block * page_size >= {_MIN_DOT} (page_size={page_size}).")


def _merge_splits(o_S, lse_S):
  """Merges per-split (normalised output, lse) along axis 2 by log-sum-exp."""
  m = jnp.max(lse_S, axis=2)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w_S = jnp.where(jnp.isfinite(lse_S), jnp.exp(lse_S - m_safe[:, :, None]), 0.0)
  w = jnp.sum(w_S, axis=2)
  w_safe = jnp.where(w > 0, w, 1.0)
  o = jnp.sum(w_S[..., None] * o_S, axis=2) / w_safe[..., None]
  return o, jnp.where(w > 0, m_safe + jnp.log(w_safe), -jnp.inf)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "pages_per_block",
                     "num_splits", "num_warps", "num_stages", "interpret"))
def paged_attention_gpu(q, k_pages, v_pages, lengths, page_indices, *,
                        sm_scale: float, soft_cap: float | None = None,
                        sliding_window: int | None = None,
                        pages_per_block: int | None = None,
                        num_splits: int | None = None,
                        num_warps: int | None = None, num_stages: int = 2,
                        interpret: bool = False):
  """Inputs as ``paged_attention`` (already validated).

  Returns (out [B, Hq, D] in q.dtype, lse f32 [B, Hq]).
  """
  if pl_triton is None:
    raise NotImplementedError("impl='gpu' needs jax.experimental.pallas.triton, "
                              "which this JAX version does not ship.")
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  pages_per_seq = page_indices.shape[1]
  group = num_q_heads // num_kv_heads
  rows = max(_MIN_DOT, _next_pow2(group))
  if pages_per_block is None:
    pages_per_block = default_pages_per_block(page_size, pages_per_seq, rows)
  _check_gpu_shapes(head_dim, page_size, pages_per_block)
  num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
  if num_splits is None:
    # Flash-decoding: enough programs to fill the SMs about twice when
    # batch * Hkv is small. Interpret mode (CPU) gains nothing from splits.
    num_splits = 1 if interpret else pl.cdiv(2 * _num_sms(), batch * num_kv_heads)
  num_splits = max(1, min(num_splits, num_blocks))
  blocks_per_split = pl.cdiv(num_blocks, num_splits)
  num_splits = pl.cdiv(num_blocks, blocks_per_split)
  cols = num_blocks * pages_per_block
  if num_warps is None:
    num_warps = 4 if rows * head_dim <= 16 * 128 else 8

  pages = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
  pages = jnp.pad(pages, ((0, 0), (0, cols - pages_per_seq)))
  q_BxHxGxD = jnp.pad(q.reshape(batch, num_kv_heads, group, head_dim),
                      ((0, 0), (0, 0), (0, rows - group), (0, 0)))

  kernel = functools.partial(
      _paged_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, pages_per_block=pages_per_block,
      blocks_per_split=blocks_per_split)
  pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim),
                           lambda b, h, s: (h, 0, 0, 0))
  o_S, lse_S = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, num_splits),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, s: (b,)),
          pl.BlockSpec((None, cols), lambda b, h, s: (b, 0)),
          pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
          pool_spec,
          pool_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim),
                       lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows, head_dim),
                               jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows), jnp.float32),
      ],
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps,
                                               num_stages=num_stages),
      interpret=interpret,
      name="rlx_paged_attention_gpu",
  )(lengths.astype(jnp.int32), pages, q_BxHxGxD, k_pages, v_pages)

  if num_splits == 1:
    o, lse = o_S[:, :, 0], lse_S[:, :, 0]
  else:
    o, lse = _merge_splits(o_S, lse_S)
  o = o[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(q.dtype)
  return o, lse[:, :, :group].reshape(batch, num_q_heads)
