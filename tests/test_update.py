"""The update half against its plain reference: pi_old fused into the first gradient pass,
padding columns cut, log-probs chunked, layers rematerialised -- same parameters after a step."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlx import sharding as shd
from rlx import train
from rlx.model import ModelConfig, init_params
from rlx.rl.loss import LossConfig
from rlx.rl.replay import ReplayConfig
from rlx.sampler.sampling import SamplingParams

CFG = ModelConfig(vocab_size=23, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64)
T = 24  # max_new_tokens
B = 16  # 4 prompts x G=4
P = 6


def _rollouts(seed=0):
  """A batch of mixed lengths (longest 13 < T) with non-zero advantages; behaviour log-probs
  near, not equal to, the policy's (so importance weights are not all 1)."""
  rng = np.random.default_rng(seed)
  prompt_lens = rng.integers(2, P + 1, B).astype(np.int32)
  prompts = np.zeros((B, P), np.int32)
  for i, l in enumerate(prompt_lens):
    prompts[i, P - l:] = rng.integers(4, CFG.vocab_size, l)
  lengths = rng.integers(1, 14, B).astype(np.int32)
  completions = rng.integers(4, CFG.vocab_size, (B, T)).astype(np.int32)
  completions[np.arange(T)[None, :] >= lengths[:, None]] = 0
  g, params = init_params(CFG, 0)
  lp, mask = train.completion_logprobs(g, params, prompts, prompt_lens, completions, lengths,
                                       1.0)
  behaviour = np.where(mask, np.asarray(lp) + rng.normal(0, 0.05, lp.shape), 0.0)
  batch = train.Batch(
      prompts=jnp.asarray(prompts), prompt_lens=jnp.asarray(prompt_lens),
      completions=jnp.asarray(completions), behaviour_logp=jnp.asarray(behaviour, jnp.float32),
      lengths=jnp.asarray(lengths), truncated=jnp.zeros((B,), bool),
      rewards=jnp.asarray(rng.integers(0, 2, B), jnp.float32),
      advantages=jnp.asarray(rng.normal(0, 1, B), jnp.float32),
      prompt_ids=jnp.repeat(jnp.arange(4), 4), difficulty=jnp.ones((B,), jnp.int32),
      policy_version=jnp.zeros((B,), jnp.int32))
  return g, params, train.Rollouts(batch, {"ledger/tokens_discarded": jnp.zeros(())})


def _config(**kw):
  base = dict(prompts_per_step=4, group_size=4, advantage="grpo", num_updates=1,
              num_minibatches=1, loss=LossConfig(), sampling=SamplingParams(max_new_tokens=T))
  base.update(kw)
  return train.StepConfig(**base)


def _step(cfg, g, params, ro, width=None, seed=0, rows=None, parts=None):
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  # Plain SGD: parameters move linearly in the gradients (Adam's normalisation would magnify
  # f32 rounding in near-zero gradient entries to a full step).
  tx = optax.sgd(0.5)
  state = train.init_state(params, tx, seed, mesh, with_ref=cfg.loss.kl_coef > 0,
                           replay=cfg.replay, prompt_width=P, max_new_tokens=T)
  if cfg.replay is not None:  # a ring holding an earlier copy of the batch
    ring = train.replay_lib.add(state.replay, ro.batch, ro.batch.advantages != 0,
                                jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    state = state.replace(replay=ring, policy_version=jnp.ones((), jnp.int32))
  fn = jax.jit(functools.partial(train.update, graphdef=g, cfg=cfg, tx=tx, width=width,
                                 rows=rows, parts=parts))
  new_state, metrics = fn(state, ro)
  return new_state.params, jax.device_get(metrics)


CASES = {
    "one_minibatch": {},
    "minibatches_and_updates": dict(num_minibatches=2, num_updates=2),
    "replay": dict(replay=ReplayConfig(capacity=16, num_samples=8, max_staleness=4)),
    "kl_seq_sum_norm": dict(loss=LossConfig(kl_coef=0.1, aggregation="seq_mean_token_sum_norm")),
    "behaviour_anchor": dict(loss=LossConfig(anchor="behaviour"), num_minibatches=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_pi_old_and_cut_padding_equal_the_plain_update(case):
  g, params, ro = _rollouts()
  plain = _config(fuse_pi_old=False, **CASES[case])
  ref_params, ref_m = _step(plain, g, params, ro)
  assert ref_m["loss/policy"] != 0 and ref_m["grad_norm"] > 0  # the step learns something
  width = train.update_width(int(ro.batch.lengths.max()), T, 4)
  assert width == 16  # 13 tokens -> the 16-wide bucket (of 8, 16, 24): 8 padding columns cut
  for cfg, w in ((dataclasses.replace(plain, fuse_pi_old=True), width),
                 (dataclasses.replace(plain, logprob_chunk=5, remat=True), width)):
    got_params, got_m = _step(cfg, g, params, ro, w)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 ref_params, got_params)
    for key in ("loss/policy", "loss/ratio_mean", "loss/is_weight_mean",
                "ledger/logp_drift_max", "ledger/tokens_trained"):
      np.testing.assert_allclose(got_m[key], ref_m[key], rtol=1e-4, atol=1e-6, err_msg=key)
    if w is not None:
      assert got_m["ledger/update_width"] == width
      assert got_m["ledger/update_pad_frac"] < ref_m["ledger/update_pad_frac"]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_leaving_out_zero_advantage_rows_changes_nothing(aggregation):
  g, params, ro = _rollouts(seed=1)
  adv = np.asarray(ro.batch.advantages).copy()
  adv[::3] = 0.0  # 6 of 16 rows without signal (as in a zero-variance group)
  adv[1::3] = 0.0  # 11 of 16
  ro = ro._replace(batch=ro.batch.replace(advantages=jnp.asarray(adv)))
  cfg = _config(loss=LossConfig(aggregation=aggregation))
  shape = train.update_shape(ro, dataclasses.replace(cfg, update_parts=1))
  assert shape == {"width": 16, "rows": 8}  # 5 signal rows <= half of 16
  ref_params, ref_m = _step(cfg, g, params, ro)
  got_params, got_m = _step(cfg, g, params, ro, **shape)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               ref_params, got_params)
  np.testing.assert_allclose(got_m["loss/policy"], ref_m["loss/policy"], rtol=1e-5)
  # The drift check covers the rows computed on (left-out rows have no pi_old).
  assert 0 < got_m["ledger/logp_drift_max"] <= ref_m["ledger/logp_drift_max"] + 1e-6
  assert got_m["ledger/update_rows"] == 8 and got_m["guard/signal_rows_left_out"] == 0
  # Not taken where zero-advantage rows still matter (a KL term) or a minibatch split.
  assert "rows" not in train.update_shape(ro, _config(loss=LossConfig(kl_coef=0.1)))
  assert "rows" not in train.update_shape(ro, _config(num_minibatches=2))


def test_fusing_pi_old_removes_a_forward_pass():
  # With one minibatch the plain update runs forward (pi_old) + forward/backward; the fused one
  # only the latter: XLA's own FLOP count shows the saved pass.
  g, params, ro = _rollouts()
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  tx = train.make_optimizer(1e-2, 10)
  state = train.init_state(params, tx, 0, mesh)

  def flops(cfg):
    fn = jax.jit(functools.partial(train.update, graphdef=g, cfg=cfg, tx=tx))
    return fn.lower(state, ro).compile().cost_analysis()["flops"]

  plain, fused = flops(_config(fuse_pi_old=False)), flops(_config(fuse_pi_old=True))
  assert fused < 0.85 * plain, (fused, plain)


def test_update_widths_are_a_bounded_set():
  widths = {train.update_width(n, 256, 4) for n in range(0, 257)}
  assert widths == {64, 128, 192, 256}
  assert all(train.update_width(n, 256, 4) >= n for n in range(0, 257))
  assert train.update_width(3, 20, 4) == 8 and train.update_width(20, 20, 4) == 20
  assert {train.update_width(n, 24, 4) for n in range(25)} == {8, 16, 24}
  assert {train.update_width(n, 24, 1) for n in range(25)} == {24}


PARTS_CASES = {
    "one_minibatch": {},
    "replay": dict(replay=ReplayConfig(capacity=16, num_samples=8, max_staleness=4)),
    "kl_seq_sum_norm": CASES["kl_seq_sum_norm"],
    "seq_mean_token_mean_two_updates": dict(
        loss=LossConfig(aggregation="seq_mean_token_mean"), num_updates=2),
    "zero_adv_rows_left_out": {},
    "behaviour_anchor": dict(loss=LossConfig(anchor="behaviour")),
}


@pytest.mark.parametrize("case", sorted(PARTS_CASES))
def test_length_sorted_micro_batches_equal_the_padded_update(case):
  # Rows sorted by length into two micro-batches, each cut to its own width, gradients summed:
  # the same step as the padded update over the whole batch at max_new_tokens.
  g, params, ro = _rollouts(seed=3)
  lengths = np.asarray(ro.batch.lengths).copy()
  lengths[:3] = (20, 19, 18)  # a long tail: 3 rows need the 24-wide bucket, most fit in 8-16
  lengths[3:] = np.minimum(lengths[3:], 7)
  comp = np.asarray(ro.batch.completions).copy()
  comp[np.arange(T)[None, :] >= lengths[:, None]] = 0
  comp[np.arange(T)[None, :] < lengths[:, None]] = np.maximum(
      comp[np.arange(T)[None, :] < lengths[:, None]], 4)
  behaviour = np.where(np.arange(T)[None, :] < lengths[:, None],
                       np.asarray(ro.batch.behaviour_logp) - 1.0, 0.0)
  adv = np.asarray(ro.batch.advantages).copy()
  if case == "zero_adv_rows_left_out":
    adv[1::2] = 0.0  # 8 of 16 rows without signal: half the rows are computed on
  batch = ro.batch.replace(lengths=jnp.asarray(lengths), completions=jnp.asarray(comp),
                           behaviour_logp=jnp.asarray(behaviour, jnp.float32),
                           advantages=jnp.asarray(adv))
  stats = dict(ro.stats)
  cfg = _config(**PARTS_CASES[case])
  if cfg.replay is not None:  # the ring holds this batch (see _step): its longest row is 20
    stats["replay/ring_max_len"] = jnp.asarray(20.0)
  ro = train.Rollouts(batch, stats)
  ref_params, ref_m = _step(dataclasses.replace(cfg, fuse_pi_old=False), g, params, ro)
  assert ref_m["loss/policy"] != 0 and ref_m["grad_norm"] > 0
  shape = train.update_shape(ro, cfg)
  assert shape["width"] == 24 and len(shape["parts"]) == 2, shape
  assert shape["parts"][0] == 24 and shape["parts"][1] < 24, shape
  if case == "zero_adv_rows_left_out":
    assert shape["rows"] == 8
  one_part = {k: v for k, v in shape.items() if k != "parts"}
  _, one_m = _step(cfg, g, params, ro, **one_part)
  got_params, got_m = _step(cfg, g, params, ro, **shape)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               ref_params, got_params)
  keys = ["loss/policy", "loss/ratio_mean", "loss/is_weight_mean", "loss/clip_frac",
          "ledger/logp_drift_max", "ledger/tokens_trained"]
  if case == "zero_adv_rows_left_out":  # token means over the rows computed on (as one_m)
    keys = ["loss/policy", "ledger/tokens_trained"]
    for key in ("loss/ratio_mean", "loss/is_weight_mean", "ledger/logp_drift_max"):
      np.testing.assert_allclose(got_m[key], one_m[key], rtol=1e-4, atol=1e-6, err_msg=key)
  for key in keys:
    np.testing.assert_allclose(got_m[key], ref_m[key], rtol=1e-4, atol=1e-6, err_msg=key)
  assert got_m["ledger/update_parts"] == 2 and got_m["guard/rows_over_width"] == 0
  assert got_m["guard/signal_rows_left_out"] == 0
  # The short micro-batch's columns past its width are not computed: less padding.
  assert got_m["ledger/update_pad_frac"] < one_m["ledger/update_pad_frac"] - 0.1, (
      got_m["ledger/update_pad_frac"], one_m["ledger/update_pad_frac"])


@pytest.mark.parametrize("case", ["one_minibatch", "kl_seq_sum_norm", "replay"])
def test_gradient_accumulation_at_equal_widths_equals_the_whole_batch(case):
  """update_shape.micro_rows: micro-batches of <= 4 rows, one after the other, also where every
  row needs the full width (update_parts alone would keep one micro-batch): same step."""
  g, params, ro = _rollouts(seed=5)
  lengths = np.full(B, T - 1, np.int32)  # every row as long: equal widths
  comp = np.where(np.arange(T)[None, :] < lengths[:, None], 5, 0).astype(np.int32)
  lp, mask = train.completion_logprobs(g, params, ro.batch.prompts, ro.batch.prompt_lens,
                                       comp, lengths, 1.0)
  behaviour = np.where(mask, np.asarray(lp) + 0.05, 0.0)
  stats = dict(ro.stats)
  cfg = _config(**PARTS_CASES[case])
  if cfg.replay is not None:  # the ring holds this batch (see _step)
    stats["replay/ring_max_len"] = jnp.asarray(float(T - 1))
  ro = train.Rollouts(ro.batch.replace(lengths=jnp.asarray(lengths), completions=jnp.asarray(comp),
                                       behaviour_logp=jnp.asarray(behaviour, jnp.float32)),
                      stats)
  assert "parts" not in train.update_shape(ro, cfg)  # equal widths: one micro-batch
  micro = dataclasses.replace(cfg, update_micro_rows=4)
  shape = train.update_shape(ro, micro)
  rows = B + (cfg.replay.num_samples if cfg.replay is not None else 0)
  assert shape["parts"] == (T,) * (rows // 4), shape
  ref_params, ref_m = _step(cfg, g, params, ro, width=shape["width"])
  got_params, got_m = _step(micro, g, params, ro, **shape)
  assert ref_m["grad_norm"] > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               ref_params, got_params)
  for key in ("loss/policy", "grad_norm", "ledger/tokens_trained", "ledger/logp_drift_max"):
    np.testing.assert_allclose(got_m[key], ref_m[key], rtol=1e-4, atol=1e-6, err_msg=key)
  assert got_m["ledger/update_parts"] == rows // 4
  # 6 rows per micro-batch do not divide 16: the fewest parts that do (4 of 4 rows).
  if cfg.replay is None:
    assert train.update_shape(ro, dataclasses.replace(cfg, update_micro_rows=6))["parts"] == (
        T,) * 4


def test_gradient_accumulation_on_the_host_reward_path():
  """score_update (rewards from the host, advantages computed in the step): micro-batches
  sized from the lengths alone (scored=False) give the same step as the whole batch."""
  g, params, ro = _rollouts(seed=6)
  cfg = _config()
  micro = dataclasses.replace(cfg, update_micro_rows=4)
  assert "parts" not in train.update_shape(ro, cfg, scored=False)
  shape = train.update_shape(ro, micro, scored=False)
  assert "rows" not in shape and len(shape["parts"]) == 4, shape
  rewards = jnp.asarray(np.random.default_rng(6).integers(0, 2, B), jnp.float32)
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  tx = optax.sgd(0.5)
  out = []
  for c, kw in ((cfg, {"width": shape["width"]}), (micro, shape)):
    state = train.init_state(params, tx, 0, mesh, prompt_width=P, max_new_tokens=T)
    fn = jax.jit(functools.partial(train.score_update, graphdef=g, cfg=c, tx=tx, **kw))
    new_state, m = fn(state, ro, rewards)
    out.append((new_state.params, jax.device_get(m)))
  (ref_params, ref_m), (got_params, got_m) = out
  assert ref_m["grad_norm"] > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               ref_params, got_params)
  np.testing.assert_allclose(got_m["loss/policy"], ref_m["loss/policy"], rtol=1e-4, atol=1e-6)
  assert got_m["ledger/update_parts"] == 4


@pytest.mark.parametrize("micro", [0, 2])
def test_micro_batch_widths_bound_their_rows_and_are_a_bounded_set(micro):
  """micro=2: gradient accumulation in 8 parts of 2 rows (4 where half the rows are left
  out); their widths are those of the update_parts=2 length groups, so the compiled shapes
  stay as few as without it (one width per part gave a new program most steps)."""
  rng = np.random.default_rng(0)
  cfg = dataclasses.replace(_config(), update_micro_rows=micro)
  keys = set()
  for _ in range(200):  # many batches of long-tailed lengths, some with zero-adv rows
    lengths = np.minimum(rng.geometric(rng.uniform(0.05, 0.5), B), T).astype(np.int32)
    adv = rng.normal(0, 1, B) * (rng.uniform(size=B) < rng.uniform(0.2, 1.0))
    batch = _rollouts_like(lengths, adv)
    shape = train.update_shape(batch, cfg)
    keys.add(tuple(sorted((k, v) for k, v in shape.items())))
    widths = shape.get("parts", (shape["width"],))
    assert list(widths) == sorted(widths, reverse=True) and widths[0] == shape["width"]
    if micro:
      assert len(widths) == shape.get("rows", B) // micro, shape
    # Every row the update computes on fits its micro-batch (as `update` orders them).
    rows = shape.get("rows", B)
    sig = adv != 0
    chosen = (np.concatenate([lengths[sig], np.sort(lengths[~sig])]) if rows < B
              else lengths)[:rows]
    r = rows // len(widths)
    for i, w in enumerate(widths):
      assert np.sort(chosen)[::-1][i * r:(i + 1) * r].max() <= w
  # Widths from the buckets {8, 16, 24}: single widths and non-increasing unequal pairs, x
  # two row counts -> at most (3 + 3) x 2 compiled update shapes.
  assert len(keys) <= 12, keys


def _rollouts_like(lengths, adv):
  batch = train.Batch(
      prompts=jnp.zeros((B, P), jnp.int32), prompt_lens=jnp.ones((B,), jnp.int32),
      completions=jnp.zeros((B, T), jnp.int32), behaviour_logp=jnp.zeros((B, T)),
      lengths=jnp.asarray(lengths), truncated=jnp.zeros((B,), bool),
      rewards=jnp.zeros((B,)), advantages=jnp.asarray(adv, jnp.float32),
      prompt_ids=jnp.zeros((B,), jnp.int32), difficulty=jnp.ones((B,), jnp.int32),
      policy_version=jnp.zeros((B,), jnp.int32))
  return train.Rollouts(batch, {})


def test_row_order_is_one_rule_for_host_and_device():
  # The host plans the update's rows (rlx.update_plan, numpy) with the same rule the update
  # applies on the device (jax.numpy): replayed rows, fresh rows with signal as they come,
  # then the shortest zero-advantage rows.
  from rlx import update_plan
  rng = np.random.default_rng(0)
  for _ in range(20):
    n = int(rng.integers(4, 40))
    is_rep = np.arange(n) >= n - int(rng.integers(0, 4))
    zero = (rng.random(n) < 0.6) & ~is_rep
    lengths = rng.integers(0, 17, n)
    rows = int(rng.integers(1, n + 1))
    host = update_plan.row_order(is_rep, zero, lengths, 16, rows)
    dev = update_plan.row_order(jnp.asarray(is_rep), jnp.asarray(zero), jnp.asarray(lengths),
                                16, rows, xp=jnp)
    np.testing.assert_array_equal(host, np.asarray(dev))
    keep = set(host.tolist())
    # Every replayed and every signal row comes before any zero-advantage row ...
    kinds = [0 if is_rep[i] else (2 if zero[i] else 1) for i in host]
    assert kinds == sorted(kinds)
    # ... and the zero-advantage rows kept are the shortest ones.
    left = [i for i in range(n) if i not in keep and zero[i]]
    took = [i for i in host if zero[i]]
    if left and took:
      assert max(lengths[took]) <= min(lengths[left])
