"""Cascade (shared-prefix) attention equals plain paged attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.kernels import cascade_paged_attention
from rlx.kernels import merge_attention_states
from rlx.kernels import paged_attention


def make_groups(*, num_groups, group_size, num_kv_heads, per_kv, head_dim,
                page_size, prefix_lengths, suffix_lengths, prefix_pages,
                suffix_pages, dtype=jnp.float32, seed=0):
  """Poisoned pool with one page run per prompt and per sample's suffix.

  Returns (cascade inputs, plain paged inputs over prefix + suffix pages or None
  when a prefix is not page-aligned, dense per-sample K/V token lists).
  """
  rng = np.random.default_rng(seed)
  P, D, batch = page_size, head_dim, num_groups * group_size
  next_page = [1]  # page 0 stays NaN

  def alloc(n):
    pages = np.arange(next_page[0], next_page[0] + n, dtype=np.int32)
    next_page[0] += n
    return pages

  prefix_table = np.zeros((num_groups, prefix_pages), np.int32)
  suffix_table = np.zeros((batch, suffix_pages), np.int32)
  prefix_tokens, suffix_tokens = [], []
  for g, n in enumerate(prefix_lengths):
    prefix_table[g, :-(-n // P)] = alloc(-(-n // P))
    prefix_tokens.append(rng.standard_normal((2, num_kv_heads, n, D)))
  for b, n in enumerate(suffix_lengths):
    suffix_table[b, :-(-n // P)] = alloc(-(-n // P))
    suffix_tokens.append(rng.standard_normal((2, num_kv_heads, n, D)))
  num_pages = next_page[0] + 1
  pool = np.full((2, num_kv_heads, num_pages, P, D), np.nan, np.float32)
  for table, tokens in ((prefix_table, prefix_tokens), (suffix_table, suffix_tokens)):
    for row, kv in enumerate(tokens):
      for t in range(kv.shape[2]):
        pool[:, :, table[row, t // P], t % P] = kv[:, :, t]
  # Garbage in unused table entries.
  for table, lengths in ((prefix_table, prefix_lengths), (suffix_table, suffix_lengths)):
    for row, n in enumerate(lengths):
      table[row, -(-n // P):] = -1 if row % 2 else num_pages - 1

  q = jnp.asarray(rng.standard_normal((batch, num_kv_heads * per_kv, D)), dtype)
  k_pages, v_pages = jnp.asarray(pool[0], dtype), jnp.asarray(pool[1], dtype)
  cascade_inputs = (q, k_pages, v_pages, jnp.asarray(prefix_lengths, jnp.int32),
                    jnp.asarray(prefix_table), jnp.asarray(suffix_lengths, jnp.int32),
                    jnp.asarray(suffix_table))
  dense = []
  for b in range(batch):
    kv = np.concatenate([prefix_tokens[b // group_size], suffix_tokens[b]], axis=2)
    dense.append(np.asarray(jnp.asarray(kv, dtype), np.float64))

  plain_inputs = None
  if all(n % P == 0 for n in prefix_lengths):
    plain_table = np.full((batch, prefix_pages + suffix_pages), -1, np.int32)
    for b in range(batch):
      used_prefix = prefix_table[b // group_size, :prefix_lengths[b // group_size] // P]
      row = np.concatenate([used_prefix, suffix_table[b]])
      plain_table[b, :len(row)] = row
    plain_lengths = (np.repeat(prefix_lengths, group_size) + np.asarray(suffix_lengths))
    plain_inputs = (q, k_pages, v_pages, jnp.asarray(plain_lengths, jnp.int32),
                    jnp.asarray(plain_table))
  return cascade_inputs, plain_inputs, dense


ALIGNED = dict(num_groups=3, group_size=4, num_kv_heads=2, per_kv=2, head_dim=64,
               page_size=16, prefix_lengths=[32, 0, 16], prefix_pages=2,
               suffix_lengths=[0, 1, 16, 23, 5, 0, 31, 32, 7, 9, 0, 1],
               suffix_pages=2)
UNALIGNED = dict(num_groups=2, group_size=2, num_kv_heads=1, per_kv=7, head_dim=128,
                 page_size=8, prefix_lengths=[13, 21], prefix_pages=3,
                 suffix_lengths=[0, 9, 4, 16], suffix_pages=2)


COMPILED = [] if jax.default_backend() == "cpu" else [("auto", jnp.bfloat16, False)]


@pytest.mark.parametrize("impl,dtype,interpret", [
    ("reference", jnp.float32, False), ("tpu", jnp.float32, True),
    ("gpu", jnp.bfloat16, True), *COMPILED])
def test_cascade_equals_plain_paged_attention(impl, dtype, interpret):
  cascade_inputs, plain_inputs, _ = make_groups(**ALIGNED, dtype=dtype)
  kw = dict(sm_scale=0.125, soft_cap=20.0)
  want_out, want_lse = paged_attention(*plain_inputs, **kw, impl="reference",
                                       return_lse=True)
  out, lse = cascade_paged_attention(*cascade_inputs, group_size=4, **kw, impl=impl,
                                     interpret=interpret, return_lse=True)
  atol = 1e-5 if dtype == jnp.float32 else 2e-2
  out = np.asarray(out, np.float32)
  assert out.dtype == np.float32 and np.isfinite(out).all()
  np.testing.assert_allclose(out, np.asarray(want_out, np.float32), atol=atol, rtol=atol)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-4, rtol=1e-4)
  # Sample 5 (group 1: no prefix) has no suffix either; 0 and 10 are prefix-only.
  assert np.all(out[5] == 0) and np.all(np.asarray(lse)[5] == -np.inf)
  assert np.isfinite(np.asarray(lse)[[0, 10]]).all()


@pytest.mark.parametrize("impl", ["reference", "tpu"])
def test_cascade_unaligned_prefix_matches_dense_attention(impl):
  cascade_inputs, _, dense = make_groups(**UNALIGNED)
  q = np.asarray(cascade_inputs[0], np.float64)
  out = cascade_paged_attention(*cascade_inputs, group_size=2, sm_scale=0.1, impl=impl,
                                interpret=True, pages_per_block=1)
  want = np.zeros_like(q)
  for b, (k, v) in enumerate(dense):
    logits = np.einsum("hd,td->ht", q[b], k[0]) * 0.1  # Hkv = 1
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want[b] = (w / w.sum(-1, keepdims=True)) @ v[0]
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)


def test_merge_attention_states_equals_attention_over_union():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((3, 10)) * 3
  v = rng.standard_normal((10, 4))

  def attend(idx):
    w = np.exp(logits[:, idx] - logits[:, idx].max(-1, keepdims=True))
    return w @ v[idx] / w.sum(-1, keepdims=True), np.log(np.exp(logits[:, idx]).sum(-1))

  o1, l1 = attend(np.arange(4))
  o2, l2 = attend(np.arange(4, 10))
  o, lse = merge_attention_states(*(jnp.asarray(x, jnp.float32) for x in (o1, l1, o2, l2)))
  want_o, want_lse = attend(np.arange(10))
  np.testing.assert_allclose(np.asarray(o), want_o, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=1e-5)


def test_merge_attention_states_empty_sides():
  o = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
  lse = jnp.asarray([0.5, -2.0])
  nan_o = jnp.full_like(o, jnp.nan)
  neg_inf = jnp.full((2,), -jnp.inf)
  for args in ((o, lse, nan_o, neg_inf), (nan_o, neg_inf, o, lse)):
    merged_o, merged_lse = merge_attention_states(*args)
    np.testing.assert_array_equal(np.asarray(merged_o), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(merged_lse), np.asarray(lse))
  merged_o, merged_lse = merge_attention_states(nan_o, neg_inf, nan_o, neg_inf)
  np.testing.assert_array_equal(np.asarray(merged_o), 0.0)
  np.testing.assert_array_equal(np.asarray(merged_lse), -np.inf)


def test_cascade_validation():
  cascade_inputs, _, _ = make_groups(**UNALIGNED)
  with pytest.raises(ValueError, match=r"q batch 4 must equal num_groups \* group_size = 2 \* 3"):
    cascade_paged_attention(*cascade_inputs, group_size=3, sm_scale=0.1)
  with pytest.raises(ValueError, match=r"group_size must be a positive int, got 0"):
    cascade_paged_attention(*cascade_inputs, group_size=0, sm_scale=0.1)
  with pytest.raises(NotImplementedError, match=r"does not support sliding_window"):
    cascade_paged_attention(*cascade_inputs, group_size=2, sm_scale=0.1, sliding_window=8)
  bad = list(cascade_inputs)
  bad[5] = bad[5][:-1]  # suffix_lengths
  with pytest.raises(ValueError, match=r"lengths shape \(3,\) must be \(4,\)"):
    cascade_paged_attention(*bad, group_size=2, sm_scale=0.1)
