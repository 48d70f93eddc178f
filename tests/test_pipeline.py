"""Overlap mode (rlx.pipeline): generation and training on two sub-meshes at once.

The reference for overlap mode is a sequential one-step-off-policy run written here with the
plain step functions on one device: batch t+k generated with the policy of step t, the
learner training batch t with the RNG state that followed it.
"""

import functools

import jax
import numpy as np
import pytest
import test_train

from rlx import pipeline
from rlx import sharding as shd
from rlx import train
from rlx.checkpoint import Checkpointer
from rlx.model import init_params
from rlx.rl.loss import LossConfig
from rlx.rl.replay import ReplayConfig
from rlx.rl.selection import SelectionConfig
from rlx.sampler.sampling import SamplingParams

CFG = test_train.CFG
N_PROMPTS = 40


def make_pool(n=N_PROMPTS):
  """test_train's pool (answer "stop at once": a random policy is sometimes right) with two
  difficulty buckets, so the band selector has groups to track."""
  pool = test_train.make_pool(n)
  return pool.replace(difficulty=(np.arange(n) % 2 + 1).astype(np.int32))


def step_config(**kw):
  base = dict(prompts_per_step=4, group_size=8, advantage="grpo", num_updates=1,
              num_minibatches=1, loss=LossConfig(is_mode="truncate", is_cap=2.0),
              sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
              selection=SelectionConfig(mode="band"),
              replay=ReplayConfig(capacity=64, num_samples=8, max_staleness=4))
  base.update(kw)
  return train.StepConfig(**base)


def fresh_state(mesh, cfg, tx):
  _, params = init_params(CFG, 0)
  return train.init_state(params, tx, 0, mesh, num_prompts=N_PROMPTS,
                          prompt_groups=make_pool().difficulty - 1, replay=cfg.replay,
                          prompt_width=8, max_new_tokens=cfg.sampling.max_new_tokens)


@functools.lru_cache(maxsize=None)
def _pipeline(n_gen, steps, k, cfg):
  """One compiled pipeline per setting, reused by every run of it (Overlap.start resets)."""
  g, _ = init_params(CFG, 0)
  devices = jax.devices()
  gen_mesh = shd.make_mesh(-1, devices=devices[:n_gen])
  learn_mesh = shd.make_mesh(-1, devices=devices[n_gen:])
  tx = train.make_optimizer(1e-2, steps)
  abstract = jax.eval_shape(lambda: fresh_state(learn_mesh, cfg, tx))
  fns = train.make_step_fns(g, cfg, tx, learn_mesh, abstract)
  ov = pipeline.Overlap(g, cfg, fns, gen_mesh=gen_mesh, learn_mesh=learn_mesh,
                        pool=make_pool(), abstract_state=abstract, max_staleness=k,
                        total_steps=steps)
  return ov, abstract, learn_mesh, tx


def overlap_run(n_gen, steps, k, cfg=None, *, upto=None, restored=None, start=0):
  """Runs the pipeline on generator devices [:n_gen] and learner devices [n_gen:]."""
  cfg = cfg or step_config()
  ov, abstract, learn_mesh, tx = _pipeline(n_gen, steps, k, cfg)
  state = ov.start(fresh_state(learn_mesh, cfg, tx), start, restored)
  hist = []
  for step in range(start, upto if upto is not None else steps):
    state, m = ov.step(state, step)
    hist.append(m)
  return state, hist, ov, abstract


def reference_run(steps, k, cfg=None):
  """The sequential one-step-off-policy schedule on one device, without rlx.pipeline."""
  cfg = cfg or step_config()
  g, _ = init_params(CFG, 0)
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  tx = train.make_optimizer(1e-2, steps)
  state = fresh_state(mesh, cfg, tx)
  pool = make_pool()
  gen = jax.jit(functools.partial(train.generate, graphdef=g, cfg=cfg))
  score = jax.jit(functools.partial(train.score, cfg=cfg))
  upd = jax.jit(functools.partial(train.update, graphdef=g, cfg=cfg, tx=tx))
  gen_rng = state.rng
  queue = []

  def generate(state, step):
    nonlocal gen_rng
    s, ro, rewards = gen(state.replace(rng=gen_rng, step=np.int32(step)), pool)
    gen_rng = s.rng
    queue.append((ro, rewards, s.rng))

  for i in range(min(k, steps)):
    generate(state, i)
  hist = []
  for t in range(steps):
    if t + k < steps:
      generate(state, t + k)  # with the policy of step t
    ro, rewards, rng = queue.pop(0)
    state, ro = score(state.replace(rng=rng), ro, rewards)
    state, m = upd(state, ro)
    hist.append(jax.device_get(m))
  return state, hist


def assert_params_close(a, b, rtol=2e-4, atol=1e-4):
  # atol is 1% of one Adam step at lr 1e-2: the learner's gradients are summed over 1 device
  # in the reference and over 2-6 here, and Adam's m / sqrt(v) turns a last-bit difference in
  # a near-zero gradient into up to ~1e-4 after 5 steps (on one CPU model 6.4e-5 at 5e-5's
  # bound, one element of 2048; on another within it). A wrong schedule moves whole steps.
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# 2 + 6 devices: rows and the replay ring split over 6 learner devices.
CFG_2_6 = step_config(prompts_per_step=3,
                      replay=ReplayConfig(capacity=48, num_samples=6, max_staleness=4))


@pytest.mark.parametrize("n_gen", [4, 2])
def test_overlap_equals_the_sequential_one_step_off_reference(n_gen):
  steps = 5
  # 4 + 4: completions long enough for each generation to be seen running (timestamps).
  cfg = step_config(sampling=SamplingParams(max_new_tokens=32, temperature=1.0)) if (
      n_gen == 4) else CFG_2_6
  ref, ref_hist = reference_run(steps, 1, cfg)
  assert any(h["reward/mean"] > 0 for h in ref_hist)  # there was a learning signal
  state, hist, ov, _ = overlap_run(n_gen, steps, 1, cfg)
  assert_params_close(ref.params, state.params)
  for h, r in zip(hist, ref_hist):
    for key in ("reward/mean", "loss/policy", "ledger/tokens_generated", "replay/rows"):
      np.testing.assert_allclose(h[key], r[key], rtol=1e-3, atol=1e-5, err_msg=key)
  # Every batch after the first was generated one update before it was trained on.
  assert [h["ledger/staleness_max"] for h in hist] == [0.0] + [1.0] * (steps - 1)
  assert [h["ledger/staleness_mean"] for h in hist] == [0.0] + [1.0] * (steps - 1)
  # The roles ran on disjoint devices.
  gen_devs = {d for leaf in jax.tree.leaves(ov.gen_params) for d in leaf.sharding.device_set}
  learn_devs = {d for leaf in jax.tree.leaves(state.params) for d in leaf.sharding.device_set}
  assert len(gen_devs) == n_gen and len(learn_devs) == 8 - n_gen
  assert not gen_devs & learn_devs
  if n_gen == 4:
    assert_both_in_flight(hist)
  else:
    assert_transfer_is_device_to_device(ov, state)


def assert_both_in_flight(hist):
  later = hist[2:]  # steps 1-2 include compilation
  # The generation of batch t+1 was dispatched before the learner finished batch t ...
  for prev, cur in zip(hist[1:], hist[2:]):
    assert cur["pipeline/gen_start"] <= prev["pipeline/learn_ready"]
  # ... and both sub-meshes computed at the same time (dispatch/ready timestamps).
  assert sum(h["pipeline/overlap_s"] for h in later) > 0, [h["pipeline/overlap_s"]
                                                          for h in later]
  for h in later:
    assert 0 <= h["pipeline/overlap_frac"] <= 1 + 1e-6
    assert h["pipeline/gen_idle_s"] >= 0 and h["pipeline/learn_idle_s"] >= 0


def assert_transfer_is_device_to_device(ov, state):
  """The learner's params reach the generator leaf by leaf, never through the host."""
  with jax.transfer_guard_device_to_host("disallow"), \
       jax.transfer_guard_host_to_device("disallow"):
    ov._sync_generator(state)  # pylint: disable=protected-access
    jax.block_until_ready(ov.gen_params)
  gen_devices = set(ov.gen_mesh.devices.flat)
  src, dst = jax.tree.leaves(state.params), jax.tree.leaves(ov.gen_params)
  assert len(src) == len(dst) > 0
  for a, b in zip(src, dst):
    assert b.sharding.device_set == gen_devices
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_overlap_with_max_staleness_0_equals_the_sync_step():
  steps = 3
  cfg = step_config()
  g, _ = init_params(CFG, 0)
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  tx = train.make_optimizer(1e-2, steps)
  state = fresh_state(mesh, cfg, tx)
  fns = train.make_step_fns(g, cfg, tx, mesh, jax.eval_shape(lambda: state))
  pool = jax.device_put(make_pool(), fns.pool_sharding)
  sync_hist = []
  for _ in range(steps):
    state, ro = fns.rollout(state, pool)
    state, m = fns.update(state, ro, **train.update_shape(ro, cfg))
    sync_hist.append(jax.device_get(m))
  ov_state, hist, _, _ = overlap_run(4, steps, 0)
  assert_params_close(state.params, ov_state.params)
  np.testing.assert_array_equal(np.asarray(state.rng), np.asarray(ov_state.rng))
  np.testing.assert_array_equal(np.asarray(state.selector.visits),
                                np.asarray(ov_state.selector.visits))
  for h, r in zip(hist, sync_hist):
    assert h["ledger/staleness_max"] == 0.0
    np.testing.assert_allclose(h["reward/mean"], r["reward/mean"], rtol=1e-6)


def test_resume_from_a_checkpoint_with_batches_in_flight_is_bitwise_exact(tmp_path):
  steps, k = 5, 2
  full, full_hist, _, _ = overlap_run(4, steps, k)
  # Interrupted after 2 steps: the checkpoint holds the learner and the 2 batches in flight.
  part, _, ov, abstract = overlap_run(4, steps, k, upto=2)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(2, ov.checkpoint(part), {})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path))
  restored, _ = ckpt.restore(2, *ov.abstract_checkpoint(abstract, 2), CFG)
  assert len(restored.in_flight) == 2
  ckpt.close()
  resumed, hist, _, _ = overlap_run(4, steps, k, restored=restored, start=2)
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(full.replay), jax.tree.leaves(resumed.replay)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for h, r in zip(hist, full_hist[2:]):
    for key in r:
      if not key.startswith(("pipeline/", "time/")):
        assert h[key] == r[key], key


class _Crash(Exception):
  pass


def test_trainer_overlap_crash_then_resume_equals_uninterrupted(tmp_path, monkeypatch):
  """The trainer's overlap loop: a run that dies between a batch's rollout and its update
  (step 3, two batches in flight) resumes from the step-2 checkpoint to the uninterrupted
  run's final parameters and metrics, bitwise."""
  from rlx import report, resume, trainer  # pylint: disable=g-import-not-at-top
  from rlx.checkpoint import read_arrays  # pylint: disable=g-import-not-at-top
  from rlx.metrics import read_jsonl  # pylint: disable=g-import-not-at-top
  from test_main import runlocal_config  # pylint: disable=g-import-not-at-top
  devices = jax.devices()[:2]  # generator 1 device, learner 1 device
  over = {"total_steps": 4, "checkpoint_every": 1, "eval_every": 4, "sft.steps": 300,
          "pipeline.mode": "overlap", "pipeline.max_staleness": 2, "selection.mode": "band"}
  ref, run = tmp_path / "ref", tmp_path / "crashed"
  trainer.run(runlocal_config(**over), str(ref), log=lambda s: None, show_progress=False,
              devices=devices)
  over["warm_start.dir"] = str(ref / "base")

  def fault(point, step):
    if point == "kill_after_rollout" and step == 3:
      raise _Crash()
  monkeypatch.setattr(resume, "fault", fault)
  with pytest.raises(_Crash):
    trainer.run(runlocal_config(**over), str(run), log=lambda s: None, show_progress=False,
                devices=devices)
  monkeypatch.undo()
  logs = []
  trainer.run(runlocal_config(**over), str(run), log=logs.append, show_progress=False,
              devices=devices)
  assert any("resumed from" in l and l.endswith("/2") for l in logs), logs
  ref_lines = read_jsonl(ref / "metrics.jsonl")
  assert [l.get("ledger/staleness_max") for l in ref_lines[1:]] == [0, 1, 2, 2]
  rows = 4 * 4  # runlocal: 4 prompts x 4 samples per step
  # Fresh rows by staleness: the first batch on-policy, the second 1 behind, then 2.
  assert [[l[f"ledger/staleness_hist_{b}"] for b in (0, 1, 2)] for l in ref_lines[1:]] == [
      [rows, 0, 0], [0, rows, 0], [0, 0, rows], [0, 0, rows]]
  assert sum(l.get("grad_norm", 0.0) > 0 for l in ref_lines[3:]) >= 1  # after the resume too
  a, b = read_arrays(str(ref), 4), read_arrays(str(run), 4)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  rep = report.make_report(str(ref))  # the timeline of the two sub-meshes
  assert "timeline" in rep.plots and "overlapped" in rep.summary, rep.summary
  drop = ("time/", "pipeline/", "ledger/generated_tokens_per_s")
  strip = lambda ls: [{k: v for k, v in l.items() if not k.startswith(drop)} for l in ls]
  assert strip(read_jsonl(run / "metrics.jsonl")) == strip(ref_lines)


def test_dry_run_plans_each_sub_mesh():
  from rlx import memory, memory_overlap, trainer  # pylint: disable=g-import-not-at-top
  from test_main import runlocal_config  # pylint: disable=g-import-not-at-top
  cfg = runlocal_config(**{"pipeline.mode": "overlap", "pipeline.generator_devices": 2,
                           "pipeline.max_staleness": 2, "mesh.data": 3, "mesh.fsdp": 2,
                           "rl.prompts_per_step": 3})
  _, text = trainer.dry_run(cfg, "/nonexistent-rlx-workdir")
  assert "== generator sub-mesh {'data': 2" in text, text
  assert "== learner sub-mesh {'data': 3, 'fsdp': 2" in text, text
  spec, learn_mesh = trainer.resolve(cfg)
  gen_mesh = pipeline.make_meshes(spec)[0]
  model_cfg = spec.model.tiny(spec.tokenizer.vocab_size)
  gen, learn = memory_overlap.plan_overlap(spec, model_cfg, dict(gen_mesh.shape),
                                           dict(learn_mesh.shape))
  whole = memory.plan(spec, model_cfg, dict(learn_mesh.shape))
  gen_names, learn_names = {it.name for it in gen.items}, {it.name for it in learn.items}
  # The generator: a policy copy and the samplers, no optimizer or update; the learner: the
  # whole training state and the batches in flight, no sampler and no prompt pool.
  assert "policy copy (params)" in gen_names and "optimizer (adamw mu, nu)" not in gen_names
  assert not any(it.phase in ("update", "grad", "logp") for it in gen.items)
  # The generator's copy is split by its own sub-mesh (replicated here), the learner's by
  # FSDP over 2.
  assert gen.item("policy copy (params)").bytes == memory.plan(
      spec, model_cfg, dict(gen_mesh.shape)).item("params").bytes
  assert gen.item("policy copy (params)").bytes > learn.item("params").bytes == whole.item(
      "params").bytes
  assert "optimizer (adamw mu, nu)" in learn_names and "prompt pool" not in learn_names
  assert not any(it.phase in ("rollout", "eval") for it in learn.items)
  rows = spec.rl.prompts_per_step * spec.rl.group_size
  per_row = (spec.sampler.max_prompt_len + 2 * spec.sampler.max_new_tokens + 8) * 4
  assert learn.item("batches in flight (max_staleness=2)").bytes == 2 * (-(-rows // 6)) * per_row
  assert gen.phase_bytes()["rollout"] > gen.item("policy copy (params)").bytes
