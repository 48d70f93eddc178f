"""Replay ring invariants, caps, sampling, and the off-policy correction weights."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.rl import replay
from rlx.rl.loss import importance_weights


def fake_batch(n, start, p=3, t=4):
  ids = np.arange(start, start + n, dtype=np.int32)
  return types.SimpleNamespace(
      prompts=np.tile(ids[:, None], (1, p)), prompt_lens=np.full(n, p, np.int32),
      completions=np.tile(ids[:, None], (1, t)), behaviour_logp=-np.ones((n, t), np.float32),
      lengths=np.full(n, t, np.int32), rewards=np.ones(n, np.float32),
      advantages=(ids % 3 - 1).astype(np.float32), prompt_ids=ids, difficulty=ids % 2)


def test_add_packs_kept_rows_and_wraps_around():
  ring = replay.ReplayState.init(capacity=8, prompt_width=3, max_new_tokens=4)
  b = fake_batch(6, 100)
  keep = np.array([1, 0, 1, 1, 0, 1], bool)
  ring = replay.add(ring, b, keep, policy_version=3, step=7)
  assert int(ring.write_ptr) == 4
  np.testing.assert_array_equal(ring.prompt_ids[:4], [100, 102, 103, 105])
  np.testing.assert_array_equal(ring.valid, [1, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(ring.policy_version[:4], 3)
  np.testing.assert_array_equal(ring.step_added[:4], 7)
  ring = replay.add(ring, fake_batch(6, 200), np.ones(6, bool), policy_version=4, step=8)
  # 4 + 6 = 10 rows into 8 slots: the two oldest were overwritten.
  assert int(ring.write_ptr) == 2
  np.testing.assert_array_equal(ring.prompt_ids, [204, 205, 103, 105, 200, 201, 202, 203])
  assert bool(ring.valid.all())
  np.testing.assert_array_equal(ring.completions[0], [204] * 4)


def test_more_rows_than_capacity_in_one_add():
  ring = replay.ReplayState.init(capacity=4, prompt_width=3, max_new_tokens=4)
  ring = replay.add(ring, fake_batch(6, 0), np.ones(6, bool), 0, 0)
  assert int(ring.write_ptr) == 0 and bool(ring.valid.all())
  np.testing.assert_array_equal(ring.prompt_ids, [0, 1, 2, 3])  # extra rows dropped


def test_sample_respects_staleness_reuse_and_validity():
  cfg = replay.ReplayConfig(capacity=8, num_samples=8, max_staleness=2, max_reuse=2,
                            priority="uniform")
  ring = replay.ReplayState.init(8, 3, 4)
  ring = replay.add(ring, fake_batch(3, 0), np.ones(3, bool), policy_version=1, step=1)
  ring = replay.add(ring, fake_batch(3, 10), np.ones(3, bool), policy_version=4, step=4)
  # At version 5: rows from version 1 are 4 versions old (> 2): not eligible.
  idx, used, ring2 = replay.sample(ring, cfg, jax.random.key(0), policy_version=5)
  got = sorted(np.asarray(ring.prompt_ids)[np.asarray(idx)[np.asarray(used)]])
  assert got == [10, 11, 12]
  assert int(used.sum()) == 3  # only 3 eligible rows; the other 5 draws are unused
  np.testing.assert_array_equal(ring2.times_used[3:6], [1, 1, 1])
  np.testing.assert_array_equal(ring2.times_used[:3], [0, 0, 0])
  # Reuse cap: after two uses a row is no longer drawn.
  _, used3, ring3 = replay.sample(ring2, cfg, jax.random.key(1), policy_version=5)
  _, used4, _ = replay.sample(ring3, cfg, jax.random.key(2), policy_version=5)
  assert int(used3.sum()) == 3 and int(used4.sum()) == 0
  # Gathered unused rows carry no loss tokens.
  rows = replay.gather(ring3, *replay.sample(ring3, cfg, jax.random.key(3), 5)[:2])
  assert int(rows["lengths"].sum()) == 0 and float(jnp.abs(rows["advantages"]).sum()) == 0


def test_abs_advantage_priority_prefers_large_advantages():
  cfg = replay.ReplayConfig(capacity=64, num_samples=8, max_staleness=10, max_reuse=100)
  ring = replay.ReplayState.init(64, 3, 4)
  b = fake_batch(64, 0)
  b.advantages = np.where(np.arange(64) < 8, 5.0, 0.05).astype(np.float32)
  ring = replay.add(ring, b, np.ones(64, bool), 0, 0)
  hits = 0
  for k in range(20):
    idx, used, _ = replay.sample(ring, cfg, jax.random.key(k), 0)
    hits += int((np.asarray(idx) < 8).sum())
  assert hits / (20 * 8) > 0.8  # uniform would give 1/8


def test_recency_priority_prefers_new_rows():
  cfg = replay.ReplayConfig(capacity=16, num_samples=4, max_staleness=100, max_reuse=100,
                            priority="recency")
  ring = replay.ReplayState.init(16, 3, 4)
  for v in range(4):
    ring = replay.add(ring, fake_batch(4, 10 * v), np.ones(4, bool), policy_version=v, step=v)
  newest = 0
  for k in range(20):
    idx, used, _ = replay.sample(ring, cfg, jax.random.key(k), 4)
    newest += int((np.asarray(ring.policy_version)[np.asarray(idx)] == 3).sum())
  assert newest / 80 > 0.8  # 4 of the 16 rows are newest: uniform would give 1/4


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_correction_weights_equal_numpy(mode):
  rng = np.random.default_rng(0)
  old = rng.normal(-1, 0.5, (4, 6)).astype(np.float32)
  mu = (old + rng.normal(0, 1.0, (4, 6))).astype(np.float32)
  w, capped = importance_weights(old, mu, 1.5, mode)
  raw = np.exp(old.astype(np.float64) - mu)
  want = np.minimum(raw, 1.5) if mode == "truncate" else np.where(raw > 1.5, 0.0, raw)
  np.testing.assert_allclose(w, want, rtol=1e-5)
  np.testing.assert_array_equal(capped, raw > 1.5)
  assert 0 < (raw > 1.5).mean() < 1


def test_effective_sample_size():
  w = jnp.asarray([[1.0, 1.0, 4.0, 0.0]])
  m = jnp.asarray([[1, 1, 1, 0]], bool)
  # Kish: (sum w)^2 / sum w^2 / n = 36 / 18 / 3
  np.testing.assert_allclose(replay.effective_sample_size(w, m), 36 / 18 / 3, rtol=1e-6)


def test_staleness_histogram():
  h = replay.staleness_histogram(jnp.asarray([0, 1, 2, 3, 5, 9, 40]), jnp.ones(7, bool))
  np.testing.assert_array_equal(h, [1, 1, 2, 1, 1, 1])  # bins 0,1,2-3,4-7,8-15,16+


@pytest.mark.parametrize("kwargs, match", [
    ({"priority": "td"}, "replay priority 'td'"),
    ({"num_samples": 10, "capacity": 4}, "exceeds capacity=4"),
    ({"max_reuse": 0}, "max_reuse=0"),
])
def test_bad_replay_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    replay.ReplayConfig(**kwargs)
