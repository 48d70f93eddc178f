"""bf16 compute with f32 master weights (config.model.dtype, "auto" = bfloat16 on GPU/TPU):
the dtype's resolution, the sampler's bf16 weight copy, and the bf16 numbers against f32
ones at stated tolerances. The bf16 path is forced through the model config on CPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from rlx import configs
from rlx import train
from rlx.errors import ConfigError
from rlx.model import ModelConfig, init_params
from rlx.model.config import resolve_dtype
from rlx.sampler import paged
from rlx.sampler.sampling import SamplingParams

import test_update  # pylint: disable=g-bad-import-order  (tests/ is on sys.path)

CFG = ModelConfig(vocab_size=64, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, mlp_dim=128)
B, P, T, G = 8, 6, 16, 4


# ----------------------------------------------------------------------------- the dtype


@pytest.mark.parametrize("platform,want", [("cpu", "float32"), ("gpu", "bfloat16"),
                                           ("tpu", "bfloat16"), ("cuda", "bfloat16")])
def test_auto_resolves_for_the_platform(platform, want):
  assert resolve_dtype("auto", platform) == want


@pytest.mark.parametrize("explicit", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept_on_every_platform(explicit):
  assert {resolve_dtype(explicit, p) for p in ("cpu", "gpu", "tpu")} == {explicit}


def test_the_default_config_computes_in_f32_on_cpu_and_records_it():
  assert jax.default_backend() == "cpu"
  config = configs.defaults()
  assert config.model.dtype == "auto"
  spec = configs.resolve(config)
  assert (spec.model.dtype, spec.model.param_dtype) == ("float32", "float32")
  assert spec.model.auto_dtype
  # config.json and the checkpoints hold what the run computed with, not "auto".
  assert spec.record["model"]["dtype"] == "float32"
  assert spec.model.arch["dtype"] == "float32"
  assert configs.model_config(config, 64).dtype == "float32"
  config.model.dtype = "bfloat16"
  spec = configs.resolve(config)
  assert (spec.model.dtype, spec.record["model"]["dtype"], spec.model.auto_dtype) == (
      "bfloat16", "bfloat16", False)


@pytest.mark.parametrize("key,value,expected", [
    ("dtype", "bf16", "expected 'auto' (bfloat16 on GPU/TPU, float32 on CPU) or one of"),
    ("dtype", "float64", "expected 'auto'"),
    ("param_dtype", "auto", "'auto' is for config.model.dtype"),
    ("param_dtype", "fp32", "expected one of ('float32', 'bfloat16', 'float16')"),
])
def test_a_bad_dtype_is_one_config_error_naming_it(key, value, expected):
  config = configs.defaults()
  config.model[key] = value
  with pytest.raises(ConfigError) as e:
    configs.resolve(config)
  assert f"config.model.{key}={value!r}" in str(e.value) and expected in str(e.value)


# ----------------------------------------------------------------------------- the sampler


def _step_config(impl: str, compute_dtype: str) -> train.StepConfig:
  return train.StepConfig(
      prompts_per_step=B // G, group_size=G, advantage="grpo", num_updates=1,
      num_minibatches=1, loss=train.LossConfig(),
      sampling=SamplingParams(max_new_tokens=T, eos_id=3, pad_id=0), sampler_impl=impl,
      paged=paged.PagedConfig(page_size=4) if impl == "paged" else None,
      compute_dtype=compute_dtype)


def _prompts():
  """G rows per prompt (group-major, as the step samples them), left-padded."""
  rng = np.random.default_rng(0)
  lens = np.repeat(rng.integers(2, P + 1, B // G), G).astype(np.int32)
  prompts = np.zeros((B, P), np.int32)
  for i in range(0, B, G):
    prompts[i:i + G, P - lens[i]:] = rng.integers(4, CFG.vocab_size, lens[i])
  return prompts, lens, jax.random.split(jax.random.key(1), B)


def _state(params) -> train.TrainState:
  return train.TrainState(params=params, opt_state=None, rng=jnp.zeros(2, jnp.uint32),
                          step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32))


def _sampler(dtype: str, impl: str, copy: bool = True):
  """(graphdef, f32 master params, sample(state, prompts, lens, keys)): the step's sampler
  computing in `dtype`, from the weights `policy_params` gives it."""
  g, params = init_params(dataclasses.replace(CFG, dtype=dtype), 0)
  cfg = _step_config(impl, dtype if copy else "")
  sample = lambda s, pr, pl, k: train.sample(g, train.policy_params(s, cfg), pr, pl, k, cfg, None)
  return g, params, sample


def _rollout(dtype: str, impl: str):
  """(graphdef, f32 master params, rollout)."""
  g, params, sample = _sampler(dtype, impl)
  return g, params, jax.jit(sample)(_state(params), *_prompts())


def _trainer_logprobs(g, params, ro):
  prompts, lens, _ = _prompts()
  fn = jax.jit(functools.partial(train.completion_logprobs, g), static_argnums=5)
  lp, mask = fn(params, prompts, lens, ro.tokens, ro.lengths, 1.0)
  return np.asarray(lp), np.asarray(mask)


def test_the_sampling_copy_casts_matrices_once_and_keeps_f32_vectors():
  _, params = init_params(dataclasses.replace(CFG, dtype="bfloat16"), 0)
  copy = train.sampling_copy(params, "bfloat16")
  for x, c in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
    assert x.dtype == jnp.float32  # the masters
    assert c.dtype == (jnp.bfloat16 if x.ndim >= 2 else jnp.float32)
    np.testing.assert_array_equal(np.asarray(c, np.float32),
                                  np.asarray(x.astype(c.dtype), np.float32))
  # f32 compute (the CPU default): no copy at all, the same arrays.
  same = train.sampling_copy(params, "float32")
  assert all(c is x for x, c in zip(jax.tree.leaves(params), jax.tree.leaves(same)))


def _weight_casts_in_decode_loop(sample, params) -> int:
  """convert_element_type ops inside the sampler's while loop whose operand has a weight
  matrix's shape: casts that run once per decoded token."""
  prompts, lens, keys = _prompts()
  shapes = {x.shape for x in jax.tree.leaves(params) if x.ndim >= 2}
  jaxpr = jax.make_jaxpr(sample)(_state(params), prompts, lens, keys)

  def walk(eqns, in_loop):
    n = 0
    for e in eqns:
      if in_loop and e.primitive.name == "convert_element_type" and (
          tuple(e.invars[0].aval.shape) in shapes):
        n += 1
      for sub in jex_core.jaxprs_in_params(e.params):
        n += walk(sub.eqns, in_loop or e.primitive.name == "while")
    return n
  return walk(jaxpr.jaxpr.eqns, False)


@pytest.mark.parametrize("impl", ["dense", "paged"])
def test_the_decode_loop_casts_no_weight_per_token(impl):
  _, params, sample = _sampler("bfloat16", impl)
  assert _weight_casts_in_decode_loop(sample, params) == 0
  # Without the copy every matmul casts its f32 weight inside the loop: the check can fail.
  _, _, uncopied = _sampler("bfloat16", impl, copy=False)
  assert _weight_casts_in_decode_loop(uncopied, params) > 0


@pytest.mark.parametrize("impl", ["dense", "paged"])
def test_bf16_behaviour_logprobs_match_the_trainers_recomputation(impl):
  """The sampler's behaviour log-probs (bf16 weight copy, bf16 KV cache) against the trainer's
  recomputation of the same tokens (f32 masters cast at each matmul, one full-sequence
  forward), both upcast to f32 logits before the log-softmax.

  Tolerance: both sides compute in bf16 from the same bf16-rounded weights, but round their
  activations at different points (incremental decode with a KV cache vs one forward; the
  paged sampler's attention over pages), and bf16 keeps 8 significant bits: a rounding of a
  logit of size ~5 moves it by up to ~0.01. max 0.05 / mean 0.01 nats allows a few such
  roundings per token; in f32 the same comparison agrees to 1e-5 (asserted below), and the
  bf16 log-probs differ from the f32 model's by more than that (bf16 is really in effect).
  """
  g, params, ro = _rollout("bfloat16", impl)
  assert ro.logprobs.dtype == jnp.float32
  lp, mask = _trainer_logprobs(g, params, ro)
  assert lp.dtype == np.float32 and mask.sum() > B
  diff = np.abs(lp - np.asarray(ro.logprobs))[mask]
  assert diff.max() < 0.05 and diff.mean() < 0.01, (diff.max(), diff.mean())

  g32, _, ro32 = _rollout("float32", impl)
  lp32, mask32 = _trainer_logprobs(g32, params, ro32)
  np.testing.assert_allclose(np.asarray(ro32.logprobs)[mask32], lp32[mask32], atol=1e-5)
  lp32_same_tokens, _ = _trainer_logprobs(g32, params, ro)
  assert np.abs(lp32_same_tokens - lp)[mask].max() > 1e-4  # bf16 changed the numbers


# ----------------------------------------------------------------------------- the update


def test_the_bf16_update_matches_the_f32_one_and_keeps_f32_masters():
  """One update step (tests/test_update.py's batch: mixed lengths, behaviour log-probs near the
  policy's) with the model computing in bf16 vs f32, from the same f32 params.

  Tolerances: the loss is a token mean of importance-weighted advantages whose log-probs carry
  bf16's ~0.4% rounding (see above), so loss and gradient norm agree to 2% relative (measured
  ~0.3% / ~0.7%); the f32 masters move by plain SGD, and their bf16 step differs from the f32
  step by < 10% of the step's size (measured ~3.5%). Params stay f32.
  """
  _, params, ro = test_update._rollouts()  # pylint: disable=protected-access
  cfg = test_update._config()  # pylint: disable=protected-access
  out = {}
  for dtype in ("float32", "bfloat16"):
    g, _ = init_params(dataclasses.replace(test_update.CFG, dtype=dtype), 0)
    out[dtype] = test_update._step(cfg, g, params, ro)  # pylint: disable=protected-access
  (p32, m32), (p16, m16) = out["float32"], out["bfloat16"]
  for key in ("loss/policy", "grad_norm"):
    assert np.isfinite(m16[key]) and m16[key] != m32[key]
    np.testing.assert_allclose(m16[key], m32[key], rtol=2e-2, err_msg=key)
  assert {x.dtype for x in jax.tree.leaves(p16)} == {jnp.dtype(jnp.float32)}
  step = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p32),
                                                             jax.tree.leaves(params)))
  off = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p16),
                                                            jax.tree.leaves(p32)))
  assert 0 < off < 0.1 * step, (off, step)
