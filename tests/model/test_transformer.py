"""The NNX transformer: cached decoding equals the full forward, padding invariance, dtypes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.model import ModelConfig, apply, init_params
from rlx.model.transformer import rope_inv_freq
from rlx.sampler.dense import DenseKVCache

BASE = ModelConfig(vocab_size=29, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=48)
VARIANTS = {
    "llama_gqa": BASE,
    "mha_untied": dataclasses.replace(BASE, num_kv_heads=4, tie_embeddings=False),
    "qwen2_bias": dataclasses.replace(BASE, qkv_bias=True, num_kv_heads=1),
    "qwen3_qknorm": dataclasses.replace(BASE, qk_norm=True),
    "gemma2": dataclasses.replace(
        BASE, norm_plus_one=True, embed_scale=True, activation="gelu_tanh",
        post_attn_norm=True, post_mlp_norm=True, attn_logit_softcap=20.0,
        final_logit_softcap=15.0, query_pre_attn_scalar=12.0, sliding_window=3,
        layer_types=("sliding", "global")),
    "gemma3": dataclasses.replace(
        BASE, norm_plus_one=True, embed_scale=True, activation="gelu_tanh", qk_norm=True,
        post_attn_norm=True, post_mlp_norm=True, sliding_window=4,
        layer_types=("sliding", "global"), rope_local_theta=100.0, rope_theta=1e4,
        rope_scaling="linear", rope_scaling_factor=4.0),
    "llama3_rope": dataclasses.replace(BASE, rope_scaling="llama3", rope_scaling_factor=8.0,
                                       rope_original_max_position=64, rope_theta=500.0),
}


def _randomize(params, seed=1):
  # Norm scales and biases start at constants; perturb everything so no switch is a no-op.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                   for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decode_matches_full_forward(name):
  cfg = VARIANTS[name]
  g, params = init_params(cfg, 0)
  params = _randomize(params)
  b, t, prefill = 2, 9, 5
  tokens = jax.random.randint(jax.random.key(2), (b, t), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  full, _ = apply(g, params, tokens, pos)

  cache = DenseKVCache.init(cfg, b, t).begin(pos[:, :prefill], jnp.ones((b, prefill), bool))
  logits, cache = apply(g, params, tokens[:, :prefill], pos[:, :prefill], None, cache)
  cache = cache.end(prefill)
  steps = [logits]
  for i in range(prefill, t):
    c = cache.begin(pos[:, i:i + 1], jnp.ones((b, 1), bool))
    logits, c = apply(g, params, tokens[:, i:i + 1], pos[:, i:i + 1], None, c)
    cache = c.end(1)
    steps.append(logits)
  np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=2e-5, rtol=1e-5)


def test_left_padding_does_not_change_logits():
  cfg = VARIANTS["gemma2"]  # sliding window + softcaps: the position-based masks matter
  g, params = init_params(cfg, 0)
  params = _randomize(params)
  seq = jax.random.randint(jax.random.key(3), (1, 6), 0, cfg.vocab_size)
  pad = 4
  tokens = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), seq], 1)
  valid = jnp.arange(pad + 6)[None] >= pad
  pos = jnp.where(valid, jnp.arange(pad + 6)[None] - pad, 0)
  # NaN-free garbage in the padding must not leak either.
  tokens = tokens.at[0, :pad].set(cfg.vocab_size - 1)
  padded, _ = apply(g, params, tokens, pos, valid)
  plain, _ = apply(g, params, seq, jnp.arange(6)[None])
  np.testing.assert_allclose(padded[:, pad:], plain, atol=2e-5, rtol=1e-5)


def test_sliding_window_limits_attention():
  cfg = dataclasses.replace(BASE, num_layers=1, sliding_window=2, layer_types=("sliding",))
  g, params = init_params(cfg, 0)
  tokens = jax.random.randint(jax.random.key(4), (1, 8), 0, cfg.vocab_size)
  pos = jnp.arange(8)[None]
  out, _ = apply(g, params, tokens, pos)
  changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % cfg.vocab_size)
  out2, _ = apply(g, params, changed, pos)
  # Token 0 is visible to queries 0 and 1 only (window 2) in a one-layer model.
  diff = np.abs(np.asarray(out2 - out)).max(-1)[0]
  assert diff[:2].min() > 1e-6 and diff[2:].max() == 0.0


def test_llama3_rope_scaling_keeps_high_frequencies():
  cfg = VARIANTS["llama3_rope"]
  plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling="none"), 0)
  scaled = rope_inv_freq(cfg, 0)
  assert scaled[0] == plain[0]  # highest frequency untouched
  np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0)  # lowest divided by the factor


def test_bf16_is_selectable_and_close():
  cfg = dataclasses.replace(BASE, dtype="bfloat16")
  g, params = init_params(cfg, 0)
  g32, _ = init_params(BASE, 0)
  tokens = jax.random.randint(jax.random.key(5), (2, 7), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  lo, _ = apply(g, params, tokens, pos)
  hi, _ = apply(g32, params, tokens, pos)
  assert lo.dtype == jnp.float32  # logits are always f32
  np.testing.assert_allclose(lo, hi, atol=0.1)
  assert np.abs(np.asarray(lo - hi)).max() > 0  # bf16 really ran


@pytest.mark.parametrize("kwargs, match", [
    ({"num_heads": 6, "num_kv_heads": 4}, "num_heads=6 must be a multiple of num_kv_heads=4"),
    ({"activation": "relu"}, "activation='relu'"),
    ({"layer_types": ("sliding",)}, "layer_types has 1 entries, expected num_layers=2"),
    ({"d_model": 0}, "d_model=0, expected a positive int"),
])
def test_bad_model_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(BASE, **kwargs)


def _autodiff_dense(x2, w, out_dtype=None):
  return jax.lax.dot_general(x2, w, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)


@pytest.mark.parametrize("name", ["llama_gqa", "mha_untied", "qwen2_bias", "gemma2"])
def test_projection_backward_equals_autodiff(name, monkeypatch):
  """The projections' hand-written backward (rlx.model.lora.dense: dw = x^T @ g as a plain
  GEMM) gives autodiff's gradients for every parameter of the model."""
  from rlx.model import lora, transformer  # pylint: disable=g-import-not-at-top
  cfg = VARIANTS[name]
  g, params = init_params(cfg, 0)
  params = _randomize(params)
  tokens = jax.random.randint(jax.random.key(3), (3, 9), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(9), (3, 9))
  adv = jnp.asarray([1.0, -0.5, 2.0])

  def loss(p):
    lp = transformer.token_logprobs(g, p, tokens, pos, jnp.ones((3, 9), bool), first=2)
    return (lp * adv[:, None]).sum()

  ours = jax.jit(jax.value_and_grad(loss))(params)
  calls = []
  monkeypatch.setattr(lora, "dense", lambda *a: calls.append(1) or _autodiff_dense(*a))
  ref = jax.jit(jax.value_and_grad(loss))(params)
  assert len(calls) >= 7 * cfg.num_layers  # the reference replaced every projection's matmul
  np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(ref[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype, out", [(jnp.float32, None), (jnp.bfloat16, None),
                                        (jnp.bfloat16, jnp.float32)])
def test_dense_values_and_gradients(dtype, out):
  from rlx.model import lora  # pylint: disable=g-import-not-at-top
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (6, 5), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (5, 7), jnp.float32).astype(dtype)
  r = jax.random.normal(kg, (6, 7), jnp.float32)
  y = lora.dense(x, w, out)
  assert y.dtype == (out or dtype)
  f = lambda fn: jax.grad(lambda x, w: (fn(x, w, out).astype(jnp.float32) * r).sum(), (0, 1))
  (dx, dw), (rx, rw) = f(lora.dense)(x, w), f(_autodiff_dense)(x, w)
  assert dx.dtype == dtype and dw.dtype == dtype
  tol = 1e-6 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.float32(dx), np.float32(rx), rtol=tol, atol=tol)
  np.testing.assert_allclose(np.float32(dw), np.float32(rw), rtol=tol, atol=tol)
  np.testing.assert_allclose(np.float32(dw), np.float32(x).T @ np.asarray(r), rtol=tol, atol=tol)


def test_linear_takes_only_projection_equations():
  from rlx.model import lora  # pylint: disable=g-import-not-at-top
  x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
  assert lora.linear("btd,de->bte", x, w, jnp.float32).shape == (2, 3, 5)
  assert lora.linear("bd,de->be", x[0], w, jnp.float32).shape == (3, 5)
  for eq in ("btd,ed->bte", "btd,de->bet", "btd,dd->btd", "btd,de->bt", "bte,ed->bte",
             "btd,dr->btr"):
    with pytest.raises(ValueError, match=f"linear: equation '{eq}'; expected a projection"):
      lora.linear(eq, x, w, jnp.float32)


ATTENTION_CASES = {  # (heads, kv heads, softcap, window)
    "gqa": (6, 2, None, None),
    "mha": (4, 4, None, None),
    "mqa_softcap": (4, 1, 5.0, None),
    "gqa_window_softcap": (6, 3, 20.0, 3),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_keys_major_attention_equals_dot_attention(case, dtype):
  """The no-cache path's attention (keys-major layout, hand-written VJP) equals autodiff of
  the plain-jnp `dot_attention` in value and in the gradients of q, k and v, on rows with
  right padding, left padding (queries with no key to see) and a sliding window."""
  from rlx.model import transformer  # pylint: disable=g-import-not-at-top
  h, kv, softcap, window = ATTENTION_CASES[case]
  b, t, d = 3, 11, 8
  spec = transformer.AttentionSpec(scale=d ** -0.5, softcap=softcap, window=window)
  kq, kk, kvv, kg = jax.random.split(jax.random.key(0), 4)
  q = (2 * jax.random.normal(kq, (b, t, h, d))).astype(dtype)
  k = (2 * jax.random.normal(kk, (b, t, kv, d))).astype(dtype)
  v = jax.random.normal(kvv, (b, t, kv, d)).astype(dtype)
  valid = np.ones((b, t), bool)
  valid[1, 7:] = False  # right padding
  valid[2, :3] = False  # left padding: its first queries see no key
  pos = jnp.asarray(np.where(valid, np.cumsum(valid, axis=1) - 1, -1))
  allowed = transformer.attention_mask(pos, jnp.where(jnp.asarray(valid), pos, -1), window)
  sees = np.asarray(allowed.any(-1))  # queries with at least one key; the others are garbage
  assert not sees.all() and sees.any()
  ct = jax.random.normal(kg, (b, t, h, d)) * sees[:, :, None, None]

  def run(fn):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, allowed, spec), q, k, v)
    return out, vjp(ct.astype(out.dtype))

  out, grads = jax.jit(lambda: run(transformer.keys_major_attention))()
  ref, ref_grads = jax.jit(lambda: run(transformer.dot_attention))()
  assert out.dtype == dtype and [x.dtype for x in grads] == [dtype] * 3
  assert np.isfinite(np.float32(out)).all()
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
  np.testing.assert_allclose(np.float32(out)[sees], np.float32(ref)[sees], **tol)
  for a, r in zip(grads, ref_grads):
    np.testing.assert_allclose(np.float32(a), np.float32(r), **tol)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma2"])
def test_model_gradients_with_plain_attention(name, monkeypatch):
  """Every parameter's gradient of a log-prob loss is the same with the no-cache path's
  keys-major attention replaced by `dot_attention` under autodiff (gemma2: softcap and a
  window); below KEYS_MAJOR_MIN_KEYS tokens the model does not use it."""
  from rlx.model import transformer  # pylint: disable=g-import-not-at-top
  cfg = VARIANTS[name]
  g, params = init_params(cfg, 0)
  params = _randomize(params)
  b, t = 3, transformer.KEYS_MAJOR_MIN_KEYS + 2
  tokens = jax.random.randint(jax.random.key(3), (b, t), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  valid = jnp.ones((b, t), bool).at[1, t - 5:].set(False)
  adv = jnp.asarray([1.0, -0.5, 2.0])

  def loss(p, t=t):
    lp = transformer.token_logprobs(g, p, tokens[:, :t], pos[:, :t], valid[:, :t], first=2)
    return (lp * adv[:, None] * valid[:, 3:t]).sum()

  ours = jax.jit(jax.value_and_grad(loss))(params)
  calls = []
  monkeypatch.setattr(transformer, "keys_major_attention",
                      lambda *a: calls.append(1) or transformer.dot_attention(*a))
  ref = jax.jit(jax.value_and_grad(loss))(params)
  assert len(calls) == cfg.num_layers  # the reference replaced every layer's attention
  np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6)
  for a, r in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(ref[1])):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())
  jax.jit(functools.partial(loss, t=transformer.KEYS_MAJOR_MIN_KEYS - 1))(params)
  assert len(calls) == cfg.num_layers  # shorter sequences: autodiff of dot_attention
