"""experiments/benchmarks/bench_peers.py: the shared model directory loads the same in rlx and
transformers (ids, special tokens, weights shape), TRL's config is one generation of
4 prompts x G=8 per optimizer step, the turn-taking worker processes (rlx; Tunix where it is
installed) deliver one row per step (and a clear error when a worker dies), and the report has
one row per peer."""

import argparse
import json
import os

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import rlx  # noqa: E402
from experiments.benchmarks import bench_peers  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("peers_model"))
  bench_peers.make_model_dir(path, bench_peers.MODELS["tiny"])
  return path


def test_rlx_and_transformers_read_the_same_directory(model_dir):
  ids = bench_peers.check_tokenizers(model_dir)  # raises when the two disagree
  assert len({len(i) for i in ids}) == 1  # equal prompt lengths: no padding on either side
  vocab = bench_peers.MODELS["tiny"].vocab_size
  tok = rlx.load_tokenizer(model_dir)
  assert tok.eos_id == vocab  # outside the model: neither sampler can stop early
  assert tok.decode(ids[0]) == bench_peers.PROMPTS[0]
  cfg, _ = rlx.load_hf(model_dir, dtype="float32")
  hf_cfg = transformers.AutoConfig.from_pretrained(model_dir)
  assert (cfg.vocab_size, cfg.num_layers, cfg.d_model) == (
      hf_cfg.vocab_size, hf_cfg.num_hidden_layers, hf_cfg.hidden_size)
  with open(os.path.join(model_dir, "generation_config.json")) as f:
    assert json.load(f)["eos_token_id"] == vocab


def test_even_reward():
  assert bench_peers.even_reward(["p"] * 3, ["2 4 7 x", "", "1 3"]) == [0.5, 0.0, 0.0]


def test_trl_config_is_one_generation_per_step(tmp_path):
  pytest.importorskip("trl")
  args = bench_peers.trl_config(bench_peers.Workload(), str(tmp_path), total_steps=3)
  assert (args.generation_batch_size, args.steps_per_generation, args.num_generations) == (
      32, 1, 8)
  assert (args.beta, args.num_iterations, args.activation_checkpointing, args.bf16) == (
      0.0, 1, False, False)


def _turn_args(**kw):
  base = dict(size="tiny", steps=2, warmup=0, sampler="paged", schedule="turns")
  base.update(kw)
  return argparse.Namespace(**base)


def test_rlx_worker_takes_turns(model_dir, tmp_path):
  """The rlx trainer in its own process, stepped by the parent: one row per step, each a
  full 4 x 8 x 128 generation (EOS outside the vocabulary) and a finite update time."""
  root = str(tmp_path)
  os.symlink(model_dir, os.path.join(root, "model"))
  bench_peers.write_prompts(os.path.join(root, "data"))
  tok = rlx.load_tokenizer(model_dir)
  prompt_len = max(len(tok.encode(q, add_special_tokens=True)) for q in bench_peers.PROMPTS)
  rows = bench_peers.take_turns(["rlx"], _turn_args(), root, prompt_len, total=2)
  assert list(rows) == ["rlx"] and len(rows["rlx"]) == 2
  for gen_s, upd_s, tokens, reward, _ in rows["rlx"]:
    assert gen_s > 0 and upd_s > 0 and tokens == 4 * 8 * 128 and 0.0 <= reward <= 1.0


def test_dead_worker_is_one_clear_error(tmp_path):
  with pytest.raises(RuntimeError, match="the rlx worker exited"):
    bench_peers.take_turns(["rlx"], _turn_args(size="no-such-size"), str(tmp_path), 8, 1)


def test_tunix_worker_takes_turns(model_dir, tmp_path):
  """Tunix's GRPOLearner on the same directory, in its own process: one row per step, each
  a 4 x 8 x 128 generation (Tunix's completion mask drops sampled pad ids, so <= 4096)."""
  pytest.importorskip("tunix")
  root = str(tmp_path)
  os.symlink(model_dir, os.path.join(root, "model"))
  prompt_len = max(map(len, bench_peers.check_tokenizers(model_dir)))
  rows = bench_peers.take_turns(["tunix"], _turn_args(), root, prompt_len, total=2)
  assert list(rows) == ["tunix"] and len(rows["tunix"]) == 2
  for step_s, gen_s, tokens, reward, _ in rows["tunix"]:
    assert step_s > gen_s > 0 and 0.95 * 4 * 8 * 128 <= tokens <= 4 * 8 * 128
    assert 0.0 <= reward <= 1.0


def test_report_has_one_row_per_peer():
  """rlx's cells repeat on each peer's row; the ratio is peer step / rlx step (medians)."""
  rlx_rows = [(9.0, 9.0, 4096, 0.5, 1.0), (1.0, 2.0, 4096, 0.5, 1.0), (1.0, 4.0, 4096, 0.5, 2.0)]
  trl = [(99.0, 50.0, 4096, 0.5, 1.0), (6.0, 2.0, 4096, 0.5, 1.0), (12.0, 4.0, 4096, 0.5, 1.0)]
  tunix = [(99.0, 50.0, 4000, 0.5, 1.0), (3.0, 1.0, 4000, 0.5, 1.0), (5.0, 1.0, 4000, 0.5, 1.0)]
  table = bench_peers.report("tiny", 1e6, rlx_rows, {"trl": trl, "tunix": tunix}, 1, (1.0, 1.0))
  rows = [line for line in table.splitlines() if line.startswith("| tiny")]
  assert len(rows) == 2 and "| TRL |" in rows[0] and "| Tunix |" in rows[1]
  # rlx step median = median(3, 5) = 4; TRL median(6, 12) = 9; Tunix median(3, 5) = 4.
  assert "| 4.00 (1.00 + 3.00) |" in rows[0] and "**2.25x**" in rows[0]
  assert "| 4.00 (1.00 + 3.00) |" in rows[1] and "**1.00x**" in rows[1]
  alone = bench_peers.report("tiny", 1e6, rlx_rows, {}, 1, (1.0, 1.0))
  assert [line for line in alone.splitlines() if line.startswith("| tiny")][0].count("| - ") == 5
