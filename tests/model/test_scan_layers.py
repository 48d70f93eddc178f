"""model.scan_layers: the layers as one lax.scan over their stacked weights compute what the
unrolled layers compute (logits, log-prob gradients with and without remat, LoRA's unmerged
path, both samplers' draws), and the program no longer grows with depth. The reference
is the unrolled model on the same params tree."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest

from rlx import configs
from rlx.model import lora, transformer
from rlx.model.config import ModelConfig
from rlx.sampler import dense, paged, paged_kv
from rlx.sampler.sampling import SamplingParams

BASE = dict(vocab_size=61, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
            mlp_dim=48)
FAMILIES = {
    "llama": dict(tie_embeddings=False, rope_scaling="llama3", rope_scaling_factor=8.0),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
    # Gemma 2's shape with every layer global (alike layers): norms +1, post norms, softcaps.
    "gemma": dict(activation="gelu_tanh", norm_plus_one=True, embed_scale=True,
                  post_attn_norm=True, post_mlp_norm=True, attn_logit_softcap=50.0,
                  final_logit_softcap=30.0, query_pre_attn_scalar=16.0),
}


def _pair(**kw):
  cfg = ModelConfig(**{**BASE, **kw})
  graphdef, params = transformer.init_params(cfg, 0)
  # Non-trivial norms and biases, so a layer mixed up with another would show.
  params = jax.tree.map(
      lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape, x.dtype), params)
  scanned = transformer.graphdef_for(dataclasses.replace(cfg, scan_layers=True))
  return cfg, graphdef, scanned, params


def _inputs(b=3, t=9, vocab=61):
  tokens = jax.random.randint(jax.random.key(7), (b, t), 0, vocab)
  pad = (2 * jnp.arange(b) % 5)[:, None]  # left padding: 0, 2, 4, 1, ...
  valid = jnp.arange(t)[None] >= pad
  return tokens, jnp.maximum(jnp.arange(t)[None] - pad, 0), valid


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scanned_logits_equal_unrolled(family):
  cfg, unrolled, scanned, params = _pair(**FAMILIES[family])
  assert transformer.scans_layers(dataclasses.replace(cfg, scan_layers=True), None)
  tokens, pos, valid = _inputs()
  a, _ = transformer.apply(unrolled, params, tokens, pos, valid)
  b, _ = transformer.apply(scanned, params, tokens, pos, valid)
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=2e-5)
  # The scan is really there: one while loop in the program instead of the layers.
  text = jax.jit(lambda p: transformer.apply(scanned, p, tokens, pos, valid)[0]).lower(
      params).as_text()
  assert "while" in text


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_logprob_gradients_equal_unrolled(remat):
  _, unrolled, scanned, params = _pair(qkv_bias=True, qk_norm=True)
  tokens, pos, valid = _inputs()

  def grads(graphdef):
    loss = lambda p: transformer.token_logprobs(graphdef, p, tokens, pos, valid, first=2,
                                                remat=remat).sum()
    return jax.grad(loss)(params)

  ga, gb = grads(unrolled), grads(scanned)
  assert jax.tree.structure(ga) == jax.tree.structure(gb)  # the same params tree
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-5, rtol=1e-4)


def test_scanned_gradients_on_an_fsdp_and_tensor_mesh_equal_unrolled():
  """Params split as training splits them (data x fsdp 2 x tensor 2): the scanned program
  computes the unrolled model's gradients."""
  from rlx import sharding as shd  # pylint: disable=g-import-not-at-top
  _, unrolled, scanned, params = _pair(num_layers=2)
  mesh = shd.make_mesh(data=-1, fsdp=2, tensor=2)
  shardings = shd.param_shardings(params, mesh)
  params = shd.put(params, shardings)
  tokens, pos, valid = _inputs(b=4)

  def grads(graphdef):
    loss = lambda p: transformer.token_logprobs(graphdef, p, tokens, pos, valid,
                                                remat=True).sum()
    # As the update does: the gradient laid out like the params (train.make_step_fns).
    return jax.jit(jax.grad(loss), out_shardings=shardings)(params)

  ga, gb = grads(unrolled), grads(scanned)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-5, rtol=1e-4)


def test_scanned_lora_unmerged_path_equals_unrolled():
  _, unrolled, scanned, params = _pair()
  cfg = lora.LoRAConfig(rank=4, alpha=8.0)
  adapters = lora.init_adapters(params, cfg, seed=1)
  adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # B is zero at init: make it count
  tokens, pos, valid = _inputs()

  def grads(graphdef):
    loss = lambda ad: transformer.token_logprobs(
        graphdef, lora.attach(params, ad, cfg), tokens, pos, valid).sum()
    return jax.value_and_grad(loss)(adapters)

  (la, ga), (lb, gb) = grads(unrolled), grads(scanned)
  np.testing.assert_allclose(float(lb), float(la), rtol=1e-5)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-5, rtol=1e-4)


def test_lora_on_some_layers_only_runs_unrolled_and_equal():
  """A target regex that adapts layer 0 only leaves the layers' trees unalike: no shared
  scan body, so they run unrolled (same numbers, no tree-structure error)."""
  _, unrolled, scanned, params = _pair()
  cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=(r"layer_0/attn/q_proj",))
  adapters = jax.tree.map(lambda x: x + 0.05, lora.init_adapters(params, cfg, seed=1))
  tokens, pos, valid = _inputs()
  a = transformer.token_logprobs(unrolled, lora.attach(params, adapters, cfg), tokens, pos,
                                 valid)
  b = transformer.token_logprobs(scanned, lora.attach(params, adapters, cfg), tokens, pos,
                                 valid)
  np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_scanned_dense_sampler_draws_the_same_rollouts():
  _, unrolled, scanned, params = _pair(qk_norm=True)
  prompts = jax.random.randint(jax.random.key(1), (4, 6), 4, 61)
  lens = jnp.array([6, 3, 5, 2])
  keys = jax.random.split(jax.random.key(2), 4)
  sp = SamplingParams(max_new_tokens=10, eos_id=3)
  a = dense.generate(unrolled, params, prompts, lens, keys, params_cfg=sp)
  b = dense.generate(scanned, params, prompts, lens, keys, params_cfg=sp)
  np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
  np.testing.assert_array_equal(np.asarray(b.lengths), np.asarray(a.lengths))
  np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=1e-5)


@pytest.mark.parametrize("attention", ["reference", "cascade"])
def test_scanned_paged_sampler_draws_the_same_rollouts(attention):
  """The paged sampler's pool keeps every layer's pages on one page axis, so its prefill and
  decode contexts take the scan's traced layer index: same tokens as the unrolled layers,
  with continuous batching (3 slots for 8 sequences: admission, forks, page copies and
  releases all run), through the reference attention and through the Pallas kernels
  (interpreted) with cascade attention over the shared prompt pages."""
  _, unrolled, scanned, params = _pair(qk_norm=True)
  g = 2
  prompts = jnp.repeat(jax.random.randint(jax.random.key(1), (4, 7), 4, 61), g, axis=0)
  lens = jnp.repeat(jnp.array([7, 3, 6, 5]), g)
  keys = jax.random.split(jax.random.key(2), 8)
  sp = SamplingParams(max_new_tokens=9, eos_id=3)
  pc = paged.PagedConfig(page_size=4, max_slots=3, slot_buckets=1, context_buckets=1,
                         attention_impl="reference" if attention == "reference" else "interpret",
                         cascade=attention == "cascade")
  run = lambda gd: paged.generate(gd, params, prompts, lens, keys, sp, pc, group_size=g,
                                  return_stats=True)
  (a, sa), (b, sb) = run(unrolled), run(scanned)
  np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
  np.testing.assert_array_equal(np.asarray(b.lengths), np.asarray(a.lengths))
  np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=1e-5)
  assert int(sb.pages_at_end) == 0 and int(sb.iterations) == int(sa.iterations)
  if attention == "reference":
    # ... the dense sampler's draws too (same keys, same per-token fold-in) ...
    c = dense.generate(unrolled, params, prompts, lens, keys, params_cfg=sp)
    np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(c.tokens))
    # ... and the scan is there: the prefill's and the decode loop's layers are while loops
    # over the stacked weights (more while loops than unrolled).
    count = lambda gd: paged.generate.lower(gd, params, prompts, lens, keys, sp, pc,
                                            group_size=g).as_text().count("stablehlo.while")
    assert count(scanned) > count(unrolled)


def test_unalike_layers_run_unrolled():
  # Gemma 3's sliding/global mix: each layer its own window and RoPE base.
  mixed = ModelConfig(**{**BASE, "layer_types": ("sliding", "global", "sliding"),
                         "sliding_window": 4, "rope_local_theta": 100.0, "scan_layers": True})
  assert not mixed.layers_alike and not transformer.scans_layers(mixed, None)
  alike = dataclasses.replace(mixed, layer_types=(), sliding_window=None)
  assert transformer.scans_layers(alike, None)
  assert not transformer.scans_layers(dataclasses.replace(alike, num_layers=1), None)
  # Both samplers' contexts take a traced layer index.
  assert paged_kv.PrefillContext.scannable and paged_kv.DecodeContext.scannable
  cache = dense.DenseKVCache.init(alike, 1, 8)
  assert transformer.scans_layers(alike, cache)
  # The mixed model still runs (unrolled) and matches its unrolled self exactly.
  graphdef, params = transformer.init_params(mixed, 0)
  unrolled = transformer.graphdef_for(dataclasses.replace(mixed, scan_layers=False))
  tokens, pos, valid = _inputs()
  a, _ = transformer.apply(unrolled, params, tokens, pos, valid)
  b, _ = transformer.apply(graphdef, params, tokens, pos, valid)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_program_stays_flat_in_depth_when_scanned():
  """The lowered update-like program (log-prob gradients under remat) holds the layer's
  matmuls once when scanned: as many dot_generals at 24 layers as at 4 (unrolled: 6x), and
  what still grows with depth is only the stacking of the weights and the slicing of their
  gradients (text < 2x, unrolled > 4x). That is why compile time stops growing with depth
  (timed side by side by experiments/benchmarks/compile_depth.py, not here)."""
  tokens, pos, valid = _inputs()

  def program(layers, scan):
    cfg = ModelConfig(**{**BASE, "num_layers": layers, "scan_layers": scan})
    graphdef, params = transformer.init_params(cfg, 0)
    loss = lambda p: transformer.token_logprobs(graphdef, p, tokens, pos, valid,
                                                remat=True).sum()
    return jax.jit(jax.grad(loss)).lower(params).as_text()

  s4, s24, u4, u24 = program(4, True), program(24, True), program(4, False), program(24, False)
  assert s24.count("dot_general") == s4.count("dot_general") > 0
  assert u24.count("dot_general") > 5 * u4.count("dot_general") / 1.2
  assert len(s24) / len(s4) < 2.0, len(s24) / len(s4)
  assert len(u24) / len(u4) > 4.0, len(u24) / len(u4)


def test_config_key_reaches_the_model_and_is_checked():
  c = configs.defaults()
  assert c.model.scan_layers is False
  spec = configs.resolve(configs.with_overrides(c, {"model.scan_layers": True}))
  assert spec.model.tiny(50).scan_layers
  # Not architecture: a warm-start base made either way serves both.
  assert "scan_layers" not in spec.model.arch
  hf_like = ModelConfig(**BASE)
  assert spec.model.run_as(hf_like).scan_layers
  # (A config file that rebuilds its model section gets past ConfigDict's type check.)
  c.model = mlc.ConfigDict({**c.model.to_dict(), "scan_layers": "yes"})
  with pytest.raises(configs.ConfigError, match=r"model.scan_layers='yes'.*True or False"):
    configs.resolve(c)
