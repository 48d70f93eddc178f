"""LoRA: adapters start at the base, the unmerged path equals the merged one, only adapters
train (and hold optimizer state), the KL reference is the base with the adapters off,
behaviour log-probs equal the trainer's, and LoRA checkpoints resume exactly and refuse a
full-parameter config."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import checkpoint as ckpt_lib
from rlx import configs
from rlx import sharding as shd
from rlx import pipeline, train, trainer
from rlx.model import ModelConfig, init_params, lora, transformer
from rlx.rl.loss import LossConfig
from test_main import runlocal_config
from test_train import CFG, make_pool, step_config

QUIET = dict(log=lambda s: None, show_progress=False, devices=jax.devices()[:1])
LCFG = lora.LoRAConfig(rank=4, alpha=8.0, targets=(r"(q|v|o|up|down)_proj$",))


def _noisy(adapters, seed=1, scale=0.3):
  """Adapters with nonzero B (fresh ones are exactly the base)."""
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


def _tokens(b=3, t=7, vocab=CFG.vocab_size):
  tok = jax.random.randint(jax.random.key(2), (b, t), 0, vocab)
  return tok, jnp.broadcast_to(jnp.arange(t), (b, t))


def test_adapters_start_at_the_base_and_unmerged_equals_merged():
  cfg = ModelConfig(vocab_size=23, num_layers=2, d_model=16, num_heads=2, num_kv_heads=1,
                    head_dim=8, mlp_dim=32, tie_embeddings=False, qkv_bias=True)
  g, params = init_params(cfg, 0)
  lc = lora.LoRAConfig(rank=3, alpha=6.0, targets=(r"_proj$", r"lm_head$"))
  ad = lora.init_adapters(params, lc, seed=0)
  assert len(lora.adapter_paths(ad)) == 2 * 7 + 1
  # A [in, r], B [r, out]; B = 0.
  assert ad["layer_0"]["mlp"]["down_proj"]["a"].shape == (32, 3)
  assert ad["layer_0"]["mlp"]["down_proj"]["b"].shape == (3, 16)
  tok, pos = _tokens(vocab=23)
  base_logits, _ = transformer.apply(g, params, tok, pos)
  fresh, _ = transformer.apply(g, lora.attach(params, ad, lc), tok, pos)
  np.testing.assert_array_equal(np.asarray(fresh), np.asarray(base_logits))
  ad = _noisy(ad)
  unmerged, _ = transformer.apply(g, lora.attach(params, ad, lc), tok, pos)
  merged, _ = transformer.apply(g, lora.merge(params, ad, lc), tok, pos)
  np.testing.assert_allclose(unmerged, merged, atol=2e-5, rtol=1e-5)
  assert np.abs(np.asarray(merged) - np.asarray(base_logits)).max() > 1e-2
  # The merge by hand: W + alpha/r * A @ B.
  w = np.asarray(params["layer_1"]["attn"]["q_proj"], np.float64)
  a = np.asarray(ad["layer_1"]["attn"]["q_proj"]["a"], np.float64)
  b = np.asarray(ad["layer_1"]["attn"]["q_proj"]["b"], np.float64)
  np.testing.assert_allclose(lora.merge(params, ad, lc)["layer_1"]["attn"]["q_proj"],
                             w + 2.0 * a @ b, rtol=1e-5, atol=1e-6)


def test_targets_that_match_nothing_or_a_non_projection_fail_with_one_line():
  _, params = init_params(CFG, 0)
  with pytest.raises(ValueError, match=r"match no parameter.*layer_0/attn/q_proj"):
    lora.target_paths(params, lora.LoRAConfig(rank=2, alpha=2, targets=("qproj$",)))
  with pytest.raises(ValueError, match="not a projection matrix"):
    lora.target_paths(params, lora.LoRAConfig(rank=2, alpha=2, targets=("embedding",)))
  c = runlocal_config(**{"lora.rank": 4, "lora.targets": "["})
  with pytest.raises(configs.ConfigError, match=r"config.lora.*not a regex"):
    configs.resolve(c)
  with pytest.raises(configs.ConfigError, match="lora.dropout"):
    configs.resolve(runlocal_config(**{"lora.rank": 4, "lora.dropout": 0.1}))
  with pytest.raises(configs.ConfigError, match="lora.rank"):
    configs.resolve(runlocal_config(**{"lora.rank": -1}))


def _lora_state(cfg, mesh, *, noisy=0.3, lr=1e-2, with_ref=False, lc=LCFG):
  g, params = init_params(CFG, 0)
  tx = train.make_optimizer(lr, 10)
  state = train.init_state(params, tx, 0, mesh, lora=lc, with_ref=with_ref)
  if noisy:
    state = state.replace(params=jax.device_put(_noisy(state.params, scale=noisy),
                                                jax.tree.map(lambda x: x.sharding, state.params)))
  fns = train.make_step_fns(g, cfg, tx, mesh, jax.eval_shape(lambda: state))
  return g, params, tx, state, fns


@pytest.mark.parametrize("merge_for_sampling,base_dtype", [
    (True, ""), (False, ""), (True, "bfloat16")])
def test_only_adapters_train_and_behaviour_logprobs_equal_the_trainers(merge_for_sampling,
                                                                       base_dtype):
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  # A bf16 base under f32 compute merges into f32 (what configs.lora_config sets): rounding
  # the merged weights to bf16 would lose small adapter updates the trainer's path keeps.
  lc = lora.LoRAConfig(rank=4, alpha=8.0, targets=LCFG.targets,
                       merge_for_sampling=merge_for_sampling, base_dtype=base_dtype,
                       merge_dtype="float32" if base_dtype else "")
  cfg = step_config(num_updates=1, num_minibatches=1, lora=lc)
  # Adapters of a trained run's size (noise 0.1: |delta W| ~ |W| / 3). Much larger ones make
  # logits large enough that f32 rounding alone moves log-probs by ~1e-5, with or without
  # LoRA (measured: the full-parameter step on the same merged weights drifts as much).
  g, params, _, state, fns = _lora_state(cfg, mesh, lc=lc, noisy=0.1)
  assert state.ref_params is None
  assert jax.tree.leaves(state.base)[0].dtype == (base_dtype or "float32")
  n_adapter = lora.num_params(state.params)
  opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert sum(x.size for x in opt_leaves) == 2 * n_adapter  # Adam moments of the adapters only
  base_before = jax.device_get(state.base)
  ad_before = jax.device_get(state.params)
  pool = jax.device_put(make_pool(), fns.pool_sharding)
  rewarded = 0
  for _ in range(3):
    state, m = fns.train_step(state, pool)
    m = jax.device_get(m)
    rewarded += m["reward/mean"] > 0
    # Behaviour log-probs (sampler, merged or unmerged) vs the trainer's (unmerged) recompute.
    assert m["ledger/logp_drift_max"] <= 1e-5, m["ledger/logp_drift_max"]
  assert rewarded  # the steps had a learning signal
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(jax.device_get(state.base))):
    np.testing.assert_array_equal(a, b)  # the base is frozen
  changed = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(ad_before),
                                                 jax.tree.leaves(jax.device_get(state.params)))]
  assert min(changed) > 0


def test_kl_reference_is_the_base_with_adapters_off():
  """LoRA's KL term (reference = state.base, no copy) equals a full-parameter step whose
  params are the merged LoRA weights and whose reference is a separately loaded base copy."""
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  loss = LossConfig(kl_coef=0.1)
  cfg_l = step_config(num_updates=1, num_minibatches=1, lora=LCFG, loss=loss)
  g, params, tx, state_l, fns_l = _lora_state(cfg_l, mesh, with_ref=True)
  assert state_l.ref_params is None  # no second copy of the weights
  merged = jax.device_get(train.policy_params(state_l, cfg_l))
  cfg_f = step_config(num_updates=1, num_minibatches=1, loss=loss)
  state_f = train.init_state(merged, tx, 0, mesh, with_ref=True)
  separate_base = jax.tree.map(lambda x: jnp.asarray(np.array(x)), params)  # loaded apart
  state_f = state_f.replace(ref_params=shd.put(separate_base,
                                                train.state_shardings(
                                                    jax.eval_shape(lambda: state_f),
                                                    mesh).ref_params))
  fns_f = train.make_step_fns(g, cfg_f, tx, mesh, jax.eval_shape(lambda: state_f))
  pool = jax.device_put(make_pool(), fns_l.pool_sharding)
  _, m_l = fns_l.train_step(state_l, pool)
  _, m_f = fns_f.train_step(state_f, pool)
  m_l, m_f = jax.device_get(m_l), jax.device_get(m_f)
  assert m_l["loss/kl_ref"] > 1e-4  # the adapters moved the policy away from the base
  np.testing.assert_allclose(m_l["loss/kl_ref"], m_f["loss/kl_ref"], rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(m_l["loss/policy"], m_f["loss/policy"], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(m_l["reward/mean"], m_f["reward/mean"])


def test_lora_shards_like_one_device():
  """The base shards like full-parameter params (FSDP), the adapters replicate, and 2 steps
  on 4 x 2 devices equal one device."""
  cfg = step_config(num_updates=1, num_minibatches=2, lora=LCFG)
  out = []
  for mesh in (shd.make_mesh(1, 1, devices=jax.devices()[:1]), shd.make_mesh(4, 2)):
    _, _, _, state, fns = _lora_state(cfg, mesh)
    pool = jax.device_put(make_pool(), fns.pool_sharding)
    for _ in range(2):
      state, m = fns.train_step(state, pool)
    out.append((jax.device_get(state.params), jax.device_get(m)))
  assert state.base["layer_0"]["mlp"]["up_proj"].sharding.spec[0] == "fsdp"
  for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(out[0][1]["loss/policy"], out[1][1]["loss/policy"], rtol=1e-3,
                             atol=1e-6)


def test_lora_checkpoint_resumes_exactly(tmp_path):
  """Adapters, their optimizer state and the frozen base go through an orbax checkpoint
  (the trainer's Checkpointer) and the resumed steps equal the uninterrupted ones bitwise."""
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  cfg = step_config(num_updates=1, num_minibatches=1, lora=LCFG)
  _, _, _, state, fns = _lora_state(cfg, mesh, noisy=0.1)
  pool = jax.device_put(make_pool(), fns.pool_sharding)
  abstract = jax.eval_shape(lambda: state)
  for _ in range(2):
    state, _ = fns.train_step(state, pool)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(2, state, {"model": CFG.to_dict()})
  ckpt.wait()
  ref, hist = state, []
  for _ in range(2):
    ref, m = fns.train_step(ref, pool)
    hist.append(jax.device_get(m))
  assert sum(h["grad_norm"] > 0 for h in hist)  # the adapters really moved
  restored, _ = ckpt.restore(2, abstract, fns.state_sharding, CFG)
  ckpt.close()
  assert restored.base is not None and restored.ref_params is None
  for _ in range(2):
    restored, m = fns.train_step(restored, pool)
  for x, y in zip(jax.tree.leaves(jax.device_get(ref)), jax.tree.leaves(
      jax.device_get(restored))):
    np.testing.assert_array_equal(x, y)
  assert jax.device_get(m)["loss/policy"] == hist[-1]["loss/policy"]


@pytest.mark.parametrize("later", [("base", "length_guard"), ("length_guard",)])
def test_a_checkpoint_from_before_the_base_field_restores(tmp_path, later):
  """Checkpoints written before TrainState.base existed (no such entry on disk) still
  restore into today's state when it has no base (full-parameter runs); so do those written
  with `base` but before `length_guard` (2026-12-06)."""
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  g, params = init_params(CFG, 0)
  tx = train.make_optimizer(1e-2, 10)
  state = train.init_state(params, tx, 0, mesh)
  old_layout = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
                if f.name not in later}
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(1, old_layout, {"model": CFG.to_dict()})
  ckpt.wait()
  abstract = jax.eval_shape(lambda: state)
  shardings = train.state_shardings(abstract, mesh)
  restored, _ = ckpt.restore(1, abstract, shardings, CFG)
  ckpt.close()
  assert isinstance(restored, train.TrainState)
  assert restored.base is None and restored.length_guard is None
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(x, y)
  # The same for an overlap checkpoint, whose state nests the learner's.
  over = pipeline.OverlapState(learner=state, gen_rng=state.rng, in_flight=())
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "overlap"), async_save=False)
  ckpt.save(1, {"learner": old_layout, "gen_rng": state.rng, "in_flight": ()},
            {"model": CFG.to_dict()})
  ckpt.wait()
  abstract = jax.eval_shape(lambda: over)
  restored, _ = ckpt.restore(1, abstract, pipeline.OverlapState(
      learner=shardings, gen_rng=shardings.rng, in_flight=()), CFG)
  ckpt.close()
  assert isinstance(restored, pipeline.OverlapState)
  assert isinstance(restored.learner, train.TrainState) and restored.learner.base is None
  for x, y in zip(jax.tree.leaves(over), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(x, y)


def test_a_lora_workdir_refuses_a_full_parameter_config(tmp_path):
  over = {"lora.rank": 2, "total_steps": 1, "checkpoint_every": 1, "sft.steps": 2}
  logs = []
  trainer.run(runlocal_config(**over), str(tmp_path), log=logs.append, show_progress=False,
              devices=jax.devices()[:1])
  assert any("LoRA rank 2" in l and "trainable" in l for l in logs)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"other LoRA settings \(lora.alpha: "
                     r"checkpoint 32.0, now 16.0\)"):
    trainer.run(runlocal_config(**over, **{"lora.alpha": 16.0}), str(tmp_path), **QUIET)
  full = {k: v for k, v in over.items() if not k.startswith("lora.")}
  full["total_steps"] = 2
  with pytest.raises(ckpt_lib.CheckpointError, match=r"trains LoRA adapters \(lora.rank=2\) "
                     r"and this config trains all parameters \(lora.rank=0\): a run cannot "
                     r"switch between LoRA and full-parameter"):
    trainer.run(runlocal_config(**full), str(tmp_path), **QUIET)
