"""The paged sampler against the dense sampler (the oracle), on a tiny model.

Shapes are shared between tests where possible: each distinct (config, shapes) pair costs
one compilation of the whole decode loop (~3 s on CPU).
"""

import dataclasses

import jax
import numpy as np
import pytest

from rlx import sharding as shd
from rlx.model import ModelConfig, init_params
from rlx.sampler import dense, paged, sampling
from rlx.sampler.sampling import SamplingParams

CFG = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                  head_dim=16, mlp_dim=64)
# Gemma-2-like switches: sliding-window layer, soft-capping, qk-norm, GQA 4:1.
CFG_GEMMA = dataclasses.replace(
    CFG, num_kv_heads=1, layer_types=("sliding", "global"), sliding_window=5,
    attn_logit_softcap=20.0, final_logit_softcap=15.0, qk_norm=True, norm_plus_one=True,
    activation="gelu_tanh", post_attn_norm=True, post_mlp_norm=True, embed_scale=True)
WIDTH = 12  # prompt width (bucket)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, eos_id=3,
                        stop_ids=tuple(range(40, 52)))
# One decode width and no context buckets compile ~3x faster; the default (bucketed) loop
# runs in test_greedy_matches_dense, the G=4 sampling test and the forced-lengths test.
FAST = dict(slot_buckets=1, context_buckets=1)
HOT = SamplingParams(max_new_tokens=16, temperature=1.2, top_k=20, top_p=0.9, eos_id=3,
                     stop_ids=(5, 7))


@pytest.fixture(scope="module")
def model():
  return init_params(CFG, seed=0)


def make_batch(num_prompts, group_size, *, seed=0, width=WIDTH, min_len=1, max_len=WIDTH):
  """Group-major left-padded prompts with varied lengths, and one key per row."""
  rng = np.random.default_rng(seed)
  lens = rng.integers(min_len, max_len + 1, num_prompts).astype(np.int32)
  lens[0] = max_len  # always exercise the full width
  prompts = np.zeros((num_prompts, width), np.int32)
  for i, n in enumerate(lens):
    prompts[i, width - n:] = rng.integers(8, CFG.vocab_size, n)
  prompts = np.repeat(prompts, group_size, axis=0)
  lens = np.repeat(lens, group_size)
  keys = jax.random.split(jax.random.key(seed + 100), len(lens))
  return prompts, lens, keys


def assert_same_rollout(ref, got, atol=1e-5):
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
  np.testing.assert_array_equal(np.asarray(got.truncated), np.asarray(ref.truncated))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=atol,
                             rtol=0)


def run_dense(model, prompts, lens, keys, sp):
  graphdef, params = model
  return dense.generate(graphdef, params, prompts, lens, keys, params_cfg=sp)


def run_paged(model, prompts, lens, keys, sp, pc, group_size, mesh=None, **kw):
  graphdef, params = model
  return paged.generate(graphdef, params, prompts, lens, keys, sp=sp, pc=pc,
                        group_size=group_size, mesh=mesh, return_stats=True, **kw)


def test_greedy_matches_dense(model):
  prompts, lens, keys = make_batch(8, 1, seed=3)
  ref = run_dense(model, prompts, lens, keys, GREEDY)
  # Fewer slots than sequences: continuous batching, slots reused.
  got, stats = run_paged(model, prompts, lens, keys, GREEDY,
                         paged.PagedConfig(page_size=4, max_slots=3), 1)
  assert_same_rollout(ref, got)
  s = stats.summary()
  assert s["alloc_failures"] == 0 and s["pages_at_end"] == 0
  # Some sequences stop early, some run to max_new_tokens: both paths are covered.
  lengths = np.asarray(ref.lengths)
  assert (lengths < GREEDY.max_new_tokens).any() and np.asarray(ref.truncated).any()


@pytest.mark.parametrize("group_size", [1, 4])
def test_sampling_matches_dense_with_shared_prompts(model, group_size):
  """temperature / top-k / top-p draws equal dense's (same key + step -> same token);
  sharing a group's prompt pages (G=4) gives the same tokens and log-probs as G=1."""
  prompts, lens, keys = make_batch(4, 4, seed=1)
  ref = run_dense(model, prompts, lens, keys, HOT)
  buckets = {} if group_size == 4 else FAST
  got, stats = run_paged(model, prompts, lens, keys, HOT,
                         paged.PagedConfig(page_size=4, max_slots=5, **buckets), group_size)
  assert_same_rollout(ref, got)
  s = stats.summary()
  assert s["alloc_failures"] == 0 and s["pages_at_end"] == 0
  # Each prompt is prefilled once per group (4 groups of 4 rows).
  assert s["prompts_prefilled"] == 16 // group_size
  if group_size == 4:
    # Siblings differ (so sharing is exercised by distinct continuations).
    toks = np.asarray(got.tokens).reshape(4, 4, -1)
    assert any(len({t.tobytes() for t in grp}) > 1 for grp in toks)


def test_results_do_not_depend_on_batch_position(model):
  prompts, lens, keys = make_batch(8, 1, seed=2)
  pc = paged.PagedConfig(page_size=4, max_slots=3, **FAST)
  got, _ = run_paged(model, prompts, lens, keys, HOT, pc, 1)
  perm = np.random.default_rng(0).permutation(8)
  got_perm, _ = run_paged(model, prompts[perm], lens[perm], keys[perm], HOT, pc, 1)
  np.testing.assert_array_equal(np.asarray(got_perm.tokens), np.asarray(got.tokens)[perm])
  np.testing.assert_allclose(np.asarray(got_perm.logprobs), np.asarray(got.logprobs)[perm],
                             atol=1e-6)


def test_small_pool_waits_and_stays_correct(model):
  prompts, lens, keys = make_batch(4, 4, seed=1)
  ref = run_dense(model, prompts, lens, keys, HOT)
  minimum = paged.min_num_pages(WIDTH, HOT.max_new_tokens, 4, 4)
  pc = paged.PagedConfig(page_size=4, max_slots=5, num_pages=minimum, **FAST)
  got, stats = run_paged(model, prompts, lens, keys, HOT, pc, 4)
  assert_same_rollout(ref, got)
  s = stats.summary()
  assert s["peak_pages"] <= minimum - 1
  assert s["alloc_failures"] == 0 and s["pages_at_end"] == 0
  # With the same slots but an ample pool the loop needs fewer iterations: here
  # sequences waited for pages.
  _, ample = run_paged(model, prompts, lens, keys, HOT,
                       paged.PagedConfig(page_size=4, max_slots=5, **FAST), 4)
  assert s["iterations"] > ample.summary()["iterations"]


def test_pool_too_small_for_one_sequence_raises(model):
  prompts, lens, keys = make_batch(2, 2)
  minimum = paged.min_num_pages(WIDTH, GREEDY.max_new_tokens, 4, 2)
  # Worst prompt: 11 tokens = 2 full pages + 1 partial, held by the group; a non-last
  # child's 11 + 16 - 1 positions span 7 pages, 2 of them shared: 3 + 5 = 8 (+ page 0).
  assert minimum == 9
  pc = paged.PagedConfig(page_size=4, num_pages=minimum - 1)
  with pytest.raises(ValueError, match=f"num_pages >= {minimum} per shard"):
    run_paged(model, prompts, lens, keys, GREEDY, pc, 2)


def test_interpret_kernel_matches_dense(model):
  prompts, lens, keys = make_batch(3, 2, seed=3)
  ref = run_dense(model, prompts, lens, keys, GREEDY)
  got, _ = run_paged(model, prompts, lens, keys, GREEDY,
                     paged.PagedConfig(page_size=4, max_slots=4, attention_impl="interpret",
                                       **FAST),
                     2)
  assert_same_rollout(ref, got)


@pytest.mark.parametrize("max_slots,impl", [(0, "reference"), (5, "reference"),
                                             (6, "interpret")])
def test_cascade_attention_matches_dense(model, max_slots, impl):
  """Prompt pages attended once per group in flight, merged with each slot's own pages:
  the same tokens and log-probs as dense. 0 slots = one per sequence (every group whole);
  5 = continuous batching (groups split across admissions, slots packed in the tail, so
  the in-flight groups are any subset). Prompt lengths 12, 10, 1, 10 with pages of 4: a
  page-aligned prompt, partial last pages, and a prompt with no shared full page."""
  prompts, lens, keys = make_batch(4, 4, seed=5)
  assert list(lens[::4]) == [12, 10, 1, 10]
  ref = run_dense(model, prompts, lens, keys, HOT)
  buckets = {} if max_slots == 5 else FAST
  got, stats = run_paged(model, prompts, lens, keys, HOT,
                         paged.PagedConfig(page_size=4, max_slots=max_slots, cascade=True,
                                           attention_impl=impl, **buckets), 4)
  assert_same_rollout(ref, got)
  assert stats.summary()["pages_at_end"] == 0


def test_cascade_keeps_plain_attention_on_sliding_window_layers():
  model = init_params(CFG_GEMMA, seed=1)
  prompts, lens, keys = make_batch(4, 2, seed=4, min_len=4)
  sp = dataclasses.replace(GREEDY, stop_ids=())
  ref = run_dense(model, prompts, lens, keys, sp)
  got, _ = run_paged(model, prompts, lens, keys, sp,
                     paged.PagedConfig(page_size=4, max_slots=3, cascade=True, **FAST), 2)
  assert_same_rollout(ref, got, atol=2e-5)


def test_gemma_switches_sliding_window_match_dense():
  model = init_params(CFG_GEMMA, seed=1)
  prompts, lens, keys = make_batch(4, 2, seed=4)
  sp = dataclasses.replace(GREEDY, stop_ids=())  # this model stops early otherwise
  ref = run_dense(model, prompts, lens, keys, sp)
  got, _ = run_paged(model, prompts, lens, keys, sp,
                     paged.PagedConfig(page_size=4, max_slots=3, **FAST), 2)
  assert_same_rollout(ref, got)


def test_forced_lengths_keep_slots_busy(model):
  """Long-tailed lengths with fewer slots than sequences: every sequence ends exactly at
  its forced length and the slots stay busy until the queue drains."""
  prompts, lens, keys = make_batch(6, 4, seed=5)
  forced = np.random.default_rng(0).geometric(0.15, 24).clip(1, 16).astype(np.int32)
  got, stats = run_paged(model, prompts, lens, keys, HOT,
                         paged.PagedConfig(page_size=4, max_slots=4), 4,
                         forced_lengths_B=forced)
  np.testing.assert_array_equal(np.asarray(got.lengths), forced)
  tokens = np.asarray(got.tokens)
  last = tokens[np.arange(24), forced - 1]
  assert (last == HOT.eos_id).all()
  s = stats.summary()
  assert s["iterations"] >= forced.sum() / 4
  # The tail runs at widths 2 and 1: fewer wasted slot rows than a fixed-width loop.
  assert s["slot_utilisation"] > max(0.8, s["fixed_slot_utilisation"])
  assert s["pages_at_end"] == 0


def test_eight_devices_match_one(model):
  assert jax.device_count() == 8, "tests/conftest.py sets 8 CPU devices"
  prompts, lens, keys = make_batch(8, 2, seed=6)
  pc = paged.PagedConfig(page_size=4, max_slots=2, **FAST)
  one, _ = run_paged(model, prompts, lens, keys, HOT, pc, 2)
  mesh = shd.make_mesh(data=4, fsdp=2)
  graphdef, params = model
  # Parameters as the trainer holds them (rules place them on the mesh).
  params = jax.device_put(params, shd.param_shardings(params, mesh))
  eight, stats = run_paged((graphdef, params), prompts, lens, keys, HOT, pc, 2, mesh=mesh)
  assert_same_rollout(one, eight, atol=2e-6)  # f32: |logp| ~4, a few ulps
  assert np.asarray(stats.iterations).shape == (8,)  # one loop per shard
  assert eight.tokens.sharding.spec[0] == ("data", "fsdp")


def test_jit_cache_stable_across_prompt_lengths(model):
  graphdef, params = model
  pc = paged.PagedConfig(page_size=4, max_slots=3, **FAST)
  jitted = paged.generate
  before = None
  for seed, (lo, hi) in enumerate([(1, 4), (5, WIDTH), (WIDTH, WIDTH), (2, 9)]):
    prompts, lens, keys = make_batch(4, 2, seed=10 + seed, min_len=lo, max_len=hi)
    jitted(graphdef, params, prompts, lens, keys, sp=GREEDY, pc=pc, group_size=2)
    if before is None:
      before = jitted._cache_size()
  assert jitted._cache_size() == before


def test_fast_sample_tokens_equal_the_reference_formulation():
  logits = jax.random.normal(jax.random.key(0), (16, 50)) * 3
  logits = logits.at[:, 9].set(logits.max(axis=-1))  # ties resolve to the first index
  keys = jax.random.split(jax.random.key(1), 16)
  for sp in (GREEDY, HOT, SamplingParams(1, temperature=0.7)):
    want = sampling.sample_tokens_reference(logits, keys, sp)
    got = sampling.sample_tokens(logits, keys, sp)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=0), "page_size=0"),
    (dict(num_pages=1), "num_pages=1"),
    (dict(max_slots=-1), "max_slots=-1"),
    (dict(attention_impl="flash"), "attention_impl='flash'"),
    (dict(prefill_chunk=0), "prefill_chunk=0"),
    (dict(slot_buckets=0), "slot_buckets=0"),
    (dict(interpret_flavour="cuda"), "interpret_flavour='cuda'"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    paged.PagedConfig(**kwargs)


def test_rejects_groups_that_do_not_share_a_prompt(model):
  prompts, lens, keys = make_batch(4, 1, seed=7)
  graphdef, params = model
  with pytest.raises(ValueError, match="do not share one prompt"):  # checked when eager
    paged.generate_unjitted(graphdef, params, prompts, lens, keys, GREEDY, paged.PagedConfig(),
                            group_size=2)


def test_train_sample_paged_branch_matches_dense(model):
  """rlx.train.sample(sampler_impl="paged") inside jit, batch sharded over a mesh."""
  from rlx import train
  from rlx.rl.loss import LossConfig

  graphdef, params = model
  prompts, lens, keys = make_batch(4, 4, seed=1)
  ref = run_dense(model, prompts, lens, keys, HOT)  # shapes as in the test above: cached
  mesh = shd.make_mesh(data=4, fsdp=1, tensor=2)
  cfg = train.StepConfig(prompts_per_step=4, group_size=4, advantage="grpo", num_updates=1,
                         num_minibatches=1, loss=LossConfig(), sampling=HOT,
                         sampler_impl="paged",
                         paged=paged.PagedConfig(page_size=4, max_slots=3, **FAST))
  fn = jax.jit(lambda *a: train.sample(graphdef, *a, cfg=cfg, mesh=mesh))
  got = fn(params, *jax.device_put((prompts, lens, keys), shd.batch_sharding(mesh)))
  assert_same_rollout(ref, got)
