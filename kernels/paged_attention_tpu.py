"""Paged decode attention as a Pallas TPU (Mosaic) kernel.

Grid ``(batch, kv_head)``; one grid step serves all ``G = Hq // Hkv`` query
heads of one KV head (GQA), so each K/V page is read from HBM once per step.
Lengths and the (flattened, clipped) page table are scalar-prefetched into
SMEM; the page pools stay in HBM (``memory_space=ANY``) and the kernel copies
``pages_per_block`` pages at a time into a two-slot VMEM buffer with
``make_async_copy``: block ``i + 1`` is in flight while block ``i`` is computed.
Each grid step starts and waits for all of its own copies, so steps are
independent and both grid axes are ``parallel`` (megacore-safe).

Online softmax in f32 (running max ``m``, denominator ``l``, accumulator
``acc``). Positions outside ``[max(0, len - window), len)`` are masked in the
scores and in V with selects, so garbage in unused slots never leaks.
Semantics match ``paged_attention.paged_attention_reference``.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LANES = 128  # lse is written lane-dense, [G, 128], and sliced outside.
_TARGET_BLOCK_TOKENS = 512


def _paged_decode_kernel(
    lengths_ref,  # SMEM i32[B]
    pages_ref,  # SMEM i32[B * cols], page table padded to cols and clipped
    q_ref,  # VMEM [G, D]
    k_hbm_ref,  # HBM [Hkv, N, P, D]
    v_hbm_ref,  # HBM [Hkv, N, P, D]
    o_ref,  # VMEM [G, D]
    lse_ref,  # VMEM f32[G, LANES]
    k_buf,  # VMEM [2, pages_per_block, P, D]
    v_buf,  # VMEM [2, pages_per_block, P, D]
    k_sems,  # DMA semaphores [2]
    v_sems,  # DMA semaphores [2]
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    cols: int,
    compute_dtype,
):
  b, h = pl.program_id(0), pl.program_id(1)
  page_size, head_dim = k_hbm_ref.shape[2], k_hbm_ref.shape[3]
  group = q_ref.shape[0]
  block = pages_per_block * page_size

  length = lengths_ref[b]
  start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
  first_block = lax.div(start, block)
  end_block = lax.div(length + block - 1, block)

  def block_copies(i, slot):
    k_copies, v_copies = [], []
    for j in range(pages_per_block):
      page = pages_ref[b * cols + i * pages_per_block + j]
      k_copies.append(pltpu.make_async_copy(
          k_hbm_ref.at[h, page], k_buf.at[slot, j], k_sems.at[slot]))
      v_copies.append(pltpu.make_async_copy(
          v_hbm_ref.at[h, page], v_buf.at[slot, j], v_sems.at[slot]))
    return k_copies, v_copies

  @pl.when(first_block < end_block)
  def _start_first_block():
    for copy in sum(block_copies(first_block, 0), []):
      copy.start()

  q = q_ref[...].astype(compute_dtype)
  # f32 inputs get true f32 matmuls (Mosaic's default f32 contraction, and
  # XLA's on GPU in interpret mode, may use reduced-precision passes); 16-bit
  # inputs keep the default.
  precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

  def body(i, carry):
    m_prev, l_prev, acc_prev = carry
    slot = lax.rem(i - first_block, 2)

    @pl.when(i + 1 < end_block)
    def _prefetch_next_block():
      for copy in sum(block_copies(i + 1, 1 - slot), []):
        copy.start()

    k_copies, v_copies = block_copies(i, slot)
    for copy in k_copies:
      copy.wait()
    k = k_buf[slot].reshape(block, head_dim).astype(compute_dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    pos = i * block + lax.broadcasted_iota(jnp.int32, (group, block), 1)
    valid = (pos >= start) & (pos < length)
    s = jnp.where(valid, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)

    for copy in v_copies:
      copy.wait()
    v = v_buf[slot].reshape(block, head_dim).astype(compute_dtype)
    v_pos = i * block + lax.broadcasted_iota(jnp.int32, (block, head_dim), 0)
    v = jnp.where((v_pos >= start) & (v_pos < length), v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv

  init = (jnp.full((group, 1), -jnp.inf, jnp.float32),
          jnp.zeros((group, 1), jnp.float32),
          jnp.zeros((group, head_dim), jnp.float32))
  m, l, acc = lax.fori_loop(first_block, end_block, body, init)
  nonempty = l > 0
  l_safe = jnp.where(nonempty, l, 1.0)
  o_ref[...] = jnp.where(nonempty, acc / l_safe, 0.0).astype(o_ref.dtype)
  lse = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)
  lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def default_pages_per_block(page_size: int, pages_per_seq: int) -> int:
  return max(1, min(pages_per_seq, _TARGET_BLOCK_TOKENS // page_size))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window",
                     "pages_per_block", "interpret"))
def paged_attention_tpu(q, k_pages, v_pages, lengths, page_indices, *,
                        sm_scale: float, soft_cap: float | None = None,
                        sliding_window: int | None = None,
                        pages_per_block: int | None = None, interpret=False):
  """Inputs as ``paged_attention`` (already validated).

  Returns (out [B, Hq, D] in q.dtype, lse f32 [B, Hq]).
  """
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  pages_per_seq = page_indices.shape[1]
  group = num_q_heads // num_kv_heads
  if pages_per_block is None:
    pages_per_block = default_pages_per_block(page_size, pages_per_seq)
  if pages_per_block < 1:
    raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}.")
  num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
  cols = num_blocks * pages_per_block
  # Clipping makes every DMA in-bounds whatever unused entries hold; padded
  # columns only ever cover masked positions.
  pages = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
  pages = jnp.pad(pages, ((0, 0), (0, cols - pages_per_seq))).reshape(-1)

  # Like JAX's kernel: small groups travel as f32 so the [G, D] block keeps a
  # plain (8, 128) f32 tiling; the matmuls still run in compute_dtype.
  io_dtype = q.dtype if group % 16 == 0 else jnp.float32
  compute_dtype = jnp.promote_types(q.dtype, k_pages.dtype)
  q_spec = pl.BlockSpec((None, None, group, head_dim),
                        lambda b, h, *_: (b, h, 0, 0))
  lse_spec = pl.BlockSpec((None, None, group, _LANES),
                          lambda b, h, *_: (b, h, 0, 0))
  buf = (2, pages_per_block, page_size, head_dim)
  kernel = functools.partial(
      _paged_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, pages_per_block=pages_per_block, cols=cols,
      compute_dtype=compute_dtype)
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_kv_heads),
          in_specs=[q_spec,
                    pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=[q_spec, lse_spec],
          scratch_shapes=[pltpu.VMEM(buf, k_pages.dtype),
                          pltpu.VMEM(buf, v_pages.dtype),
                          pltpu.SemaphoreType.DMA((2,)),
                          pltpu.SemaphoreType.DMA((2,))],
      ),
      out_shape=[
          jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), io_dtype),
          jax.ShapeDtypeStruct((batch, num_kv_heads, group, _LANES), jnp.float32),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel")),
      interpret=interpret,
      name="rlx_paged_attention_tpu",
  )(lengths.astype(jnp.int32), pages,
    q.reshape(batch, num_kv_heads, group, head_dim).astype(io_dtype),
    k_pages, v_pages)
  return (out.reshape(batch, num_q_heads, head_dim).astype(q.dtype),
          lse[..., 0].reshape(batch, num_q_heads))
