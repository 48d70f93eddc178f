"""metrics.jsonl: resuming keeps every readable line and quarantines damaged ones; one
read_metrics for a workdir or its file; the evaluation progress bar."""

import contextlib
import errno
import functools
import json
import os
import types
import warnings

import jax
import numpy as np
import pytest

import rlx
from rlx import metrics
from rlx.metrics import JsonlWriter, MetricsWarning, read_metrics


def write_lines(path, lines):
  with open(path, "w") as f:
    for line in lines:
      f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def steps(lines):
  return [l["step"] for l in lines]


@contextlib.contextmanager
def _no_metrics_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error", MetricsWarning)
    yield


def test_resume_keeps_the_lines_after_a_corrupt_one_and_quarantines_it(tmp_path):
  path = tmp_path / "metrics.jsonl"
  write_lines(path, [{"step": 0, "a": 0.5}, {"step": 1}, "{\"step\": 2, \"a\": 0.\x00 garbage",
                     {"step": 2}, "[1, 2]", {"step": 3}, {"step": 4}, {"step": 5}])
  with pytest.warns(MetricsWarning) as record:
    w = JsonlWriter(str(path), resume_step=4)
  assert len(record) == 1  # one warning for the file, not one per line
  text = str(record[0].message)
  assert f"{path}: skipped 2 unreadable lines (lines 3, 5); moved to {path}.corrupt" in text
  w.write(5, {"a": np.float32(0.25)})
  w.close()
  assert steps(read_metrics(path)) == [0, 1, 2, 3, 4, 5]  # step 5 was rewritten by the resume
  assert read_metrics(path)[0] == {"step": 0, "a": 0.5}
  assert read_metrics(path)[-1] == {"step": 5, "a": 0.25}
  assert (tmp_path / "metrics.jsonl.corrupt").read_text() == (
      "{\"step\": 2, \"a\": 0.\x00 garbage\n[1, 2]\n")


def test_resume_drops_a_torn_last_line_the_same_way(tmp_path):
  path = tmp_path / "metrics.jsonl"
  with open(path, "w") as f:
    f.write(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1}) + "\n" + '{"step": 2, "rew')
  with pytest.warns(MetricsWarning, match=r"skipped 1 unreadable line \(line 3\); moved to"):
    JsonlWriter(str(path), resume_step=2).close()
  assert steps(read_metrics(path)) == [0, 1]
  assert (tmp_path / "metrics.jsonl.corrupt").read_text() == '{"step": 2, "rew\n'
  # A second resume finds a clean file: no warning, and the quarantine is not duplicated.
  with _no_metrics_warning():
    JsonlWriter(str(path), resume_step=1).close()
  assert (tmp_path / "metrics.jsonl.corrupt").read_text() == '{"step": 2, "rew\n'


def test_a_fresh_run_starts_an_empty_file(tmp_path):
  path = tmp_path / "metrics.jsonl"
  write_lines(path, [{"step": 0}, "not json"])
  with _no_metrics_warning():
    w = JsonlWriter(str(path))
  w.write(0, {"x": float("nan")})
  w.close()
  assert read_metrics(path) == [{"step": 0, "x": "nan"}]
  assert not (tmp_path / "metrics.jsonl.corrupt").exists()


def test_a_directory_in_place_of_metrics_jsonl_is_one_clear_error(tmp_path):
  (tmp_path / "metrics.jsonl").mkdir()
  message = r"metrics.jsonl is a directory; expected the metrics.jsonl file of an rlx run"
  with pytest.raises(IsADirectoryError, match=message) as info:
    JsonlWriter(str(tmp_path / "metrics.jsonl"), resume_step=3)
  assert "\n" not in str(info.value)
  for arg in (tmp_path, tmp_path / "metrics.jsonl"):
    with pytest.raises(IsADirectoryError, match=message):
      read_metrics(arg)


def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
  # Regression (issue 37, N4): the raw "OSError: [Errno 28] No space left on device" of the
  # line-buffered write named no file.
  path = tmp_path / "metrics.jsonl"
  w = JsonlWriter(str(path))
  w.write(0, {"x": 1.0})

  class FullDisk:
    def write(self, text):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    close = lambda self: self.write("")

  w._f.close()
  w._f = FullDisk()
  want = (f"could not write {path} (No space left on device [Errno 28]); the last checkpoint "
          f"is kept: free space, then rerun the same command to resume from it.")
  with pytest.raises(metrics.WriteError) as info:
    w.write(1, {"x": 2.0})
  assert str(info.value) == want and info.value.errno == errno.ENOSPC
  with pytest.raises(metrics.WriteError, match=r"could not write .*metrics.jsonl \(No space"):
    w.close()
  w.close()  # once closed, closed
  assert read_metrics(path) == [{"step": 0, "x": 1.0}]


def test_read_metrics_takes_the_workdir_or_the_file(tmp_path):
  write_lines(tmp_path / "metrics.jsonl",
              [{"step": 0, "x": 1}, {"step": 1, "x": 2}, "{torn", {"step": 1, "y": 3},
               {"step": 2.0, "x": 4}])
  want = [{"step": 0, "x": 1}, {"step": 1, "x": 2, "y": 3}, {"step": 2, "x": 4}]
  for arg in (tmp_path, str(tmp_path), tmp_path / "metrics.jsonl"):
    with pytest.warns(MetricsWarning, match=r"skipped 1 unreadable line \(line 3\); the other"):
      assert read_metrics(arg) == want
  assert not (tmp_path / "metrics.jsonl.corrupt").exists()  # reading never rewrites
  assert rlx.read_metrics is read_metrics and metrics.read_jsonl is read_metrics


def test_read_metrics_names_a_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match=rf"{tmp_path}/metrics.jsonl does not exist; "
                     r"expected the WORKDIR of an rlx run"):
    read_metrics(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"nothing/metrics.jsonl does not exist"):
    read_metrics(tmp_path / "nothing" / "metrics.jsonl")


# ---- the evaluation progress bar -------------------------------------------------------------


def tiny_evaluator(show_progress):
  from rlx import evaluate, sharding as shd
  from rlx.data.tasks import PromptPool
  from rlx.model.config import ModelConfig
  from rlx.sampler.sampling import SamplingParams
  cfg = ModelConfig(vocab_size=16, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1,
                    head_dim=8, mlp_dim=32)
  graphdef, params = rlx.init_params(cfg, seed=0)
  n = 6
  pool = PromptPool(prompts=np.full((n, 4), 5, np.int32), prompt_lens=np.full((n,), 4, np.int32),
                    answers=np.full((n, 2), 3, np.int32), answer_lens=np.full((n,), 2, np.int32),
                    difficulty=np.arange(n, dtype=np.int32) % 2)
  mesh = shd.make_mesh(devices=jax.devices()[:1])
  sp = SamplingParams(max_new_tokens=2, temperature=0.0)
  ev = evaluate.Evaluator(graphdef, pool, sp, batch_size=2, mesh=mesh,
                          show_progress=show_progress)
  return ev, params


@pytest.mark.parametrize("show", [True, False])
def test_evaluator_shows_progress_over_its_batches(show, capsys):
  ev, params = tiny_evaluator(show)
  out = ev(params)
  assert set(out) == {f"eval/{k}{d}" for k in ("accuracy", "len_mean", "correct_len_mean")
                      for d in ("", "_d0", "_d1")}
  assert out["eval/len_mean"] == 2.0  # greedy to max_new_tokens=2 (the untrained model)
  err = capsys.readouterr().err
  if show:  # 6 prompts in batches of 2; captured, not a terminal: plain lines (rlx.progress)
    assert err.startswith("[rlx] eval: 0/3 batches; compiling the first batch ...\n"), err
    assert "[rlx] eval: 3/3 batches (100%)" in err and "\r" not in err, err
    ev(params)  # compiled now, and quick: nothing more
    assert capsys.readouterr().err == ""
  else:
    assert "eval" not in err, err


# ---- evaluation with the run's sampler: paged == dense (the oracle) --------------------------


@functools.lru_cache(maxsize=1)
def _eval_setup():
  """A tiny model and an 11-prompt pool with varied prompt and completion lengths, answers
  that half the greedy completions match (so accuracy and correct lengths are non-trivial)."""
  from rlx.data.tasks import PromptPool
  from rlx.model.config import ModelConfig
  from rlx.sampler import dense
  from rlx.sampler.sampling import SamplingParams
  cfg = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_dim=64)  # f32
  graphdef, params = rlx.init_params(cfg, seed=0)
  sp = SamplingParams(max_new_tokens=10, temperature=0.0, eos_id=3,
                      stop_ids=tuple(range(40, 52)))
  n, width = 11, 9
  rng = np.random.default_rng(0)
  lens = rng.integers(1, width + 1, n).astype(np.int32)
  lens[0] = width
  prompts = np.zeros((n, width), np.int32)
  for i, k in enumerate(lens):
    prompts[i, width - k:] = rng.integers(8, cfg.vocab_size, k)
  ro = dense.generate(graphdef, params, prompts, lens, jax.random.split(jax.random.key(0), n),
                      params_cfg=sp)
  answers = np.asarray(ro.tokens)[:, :2].copy()
  answers[1::2] = rng.integers(8, 40, (len(answers[1::2]), 2))  # odd rows: (almost) never right
  pool = PromptPool(prompts=prompts, prompt_lens=lens, answers=answers.astype(np.int32),
                    answer_lens=np.full((n,), 2, np.int32),
                    difficulty=np.arange(n, dtype=np.int32) % 3)
  return graphdef, params, pool, sp, np.asarray(ro.lengths)


@pytest.mark.parametrize("mesh_shape", [None, (4, 2)], ids=["1dev", "data4xfsdp2"])
def test_paged_evaluator_matches_dense(mesh_shape):
  """Greedy evaluation with the paged sampler (the run's default) gives exactly the dense
  sampler's scores, lengths and metrics: 11 prompts in batches that do not divide the pool
  (the last is padded), fewer slots than sequences and a pool that makes some wait."""
  from rlx import evaluate, sharding as shd
  from rlx.sampler import paged
  graphdef, params, pool, sp, want_lengths = _eval_setup()
  if mesh_shape is None:
    mesh, batch = shd.make_mesh(devices=jax.devices()[:1]), 4
  else:
    mesh, batch = shd.make_mesh(data=mesh_shape[0], fsdp=mesh_shape[1]), 8
    params = jax.device_put(params, shd.param_shardings(params, mesh))
  pc = paged.PagedConfig(page_size=4, max_slots=3, num_pages=8, slot_buckets=1,
                         context_buckets=1)
  kw = dict(band=(1,), sp=sp, batch_size=batch, mesh=mesh)
  ref = evaluate.Evaluator(graphdef, pool, **kw)  # dense by default
  got = evaluate.Evaluator(graphdef, pool, sampler_impl="paged", paged=pc, **kw)
  assert ref.sampler_impl == "dense" and pool.size % got.batch_size != 0
  s_ref, l_ref = ref.scores_and_lengths(params)
  s_got, l_got = got.scores_and_lengths(params)
  np.testing.assert_array_equal(l_ref, want_lengths)
  assert 1 < len(set(l_ref.tolist())) and 0 < s_ref.sum() < len(s_ref)  # a non-trivial check
  np.testing.assert_array_equal(s_got, s_ref)
  np.testing.assert_array_equal(l_got, l_ref)
  m_ref, m_got = ref(params), got(params)
  assert m_got.keys() == m_ref.keys() and "eval/band_correct_len_mean" in m_got
  np.testing.assert_equal(m_got, m_ref)  # NaN equals NaN (a level without a correct answer)
  if mesh_shape is not None:  # a few rows for display: off the mesh's batch split
    tok = types.SimpleNamespace(decode=lambda t: tuple(np.asarray(t).tolist()))
    assert got.completions(params, [0, 5, 10], tok) == ref.completions(params, [0, 5, 10], tok)


def test_evaluator_rejects_an_unknown_sampler():
  from rlx import evaluate
  ev, _ = tiny_evaluator(False)
  with pytest.raises(ValueError, match=r"sampler_impl='fast'; expected one of \('dense', "
                     r"'paged'\)"):
    evaluate.Evaluator(ev._graphdef, jax.tree.map(lambda x: x[:ev.n], ev.pool), ev.sp, 2,
                       ev.mesh, sampler_impl="fast")
