"""experiments/bench_peers.py: the shared model directory loads the same in rlx and
transformers (ids, special tokens, weights shape), and TRL's config is one generation of
4 prompts x G=8 per optimizer step."""

import json
import os

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import rlx  # noqa: E402
from experiments import bench_peers  # noqa: E402


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
