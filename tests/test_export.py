"""rlx.export: a trained run -> a Hugging Face directory that transformers loads, same logits."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import checkpoint, export, trainer
from rlx.data.tokenizer import Tokenizer
from rlx.model import hf, transformer
from rlx.model.config import ModelConfig
from test_main import REPO, runlocal_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A 2-step runlocal run, plus a step 3 whose params differ from the base model's.

  runlocal's first steps have all-zero advantages, so their params equal the warm start's;
  step 3 (the same state with perturbed params) shows that the checkpoint's params, not the
  base model's, are what gets exported.
  """
  wd = str(tmp_path_factory.mktemp("run"))
  trainer.run(runlocal_config(**{"total_steps": 2, "checkpoint_every": 1, "mesh.data": 1}),
              wd, log=lambda s: None, show_progress=False, devices=jax.devices()[:1])
  state = checkpoint.read_arrays(wd, 2)
  rng = np.random.RandomState(0)
  state["params"] = jax.tree.map(
      lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), state["params"])
  ckpt = checkpoint.Checkpointer(wd, keep=5, async_save=False)
  ckpt.save(3, state, ckpt.read_meta(2), force=True)
  ckpt.close()
  return wd


def _model_cfg(workdir, step):
  ckpt = checkpoint.Checkpointer(workdir, async_save=False)
  try:
    return ModelConfig.from_dict(ckpt.read_meta(step)["model"])
  finally:
    ckpt.close()


def _inputs(vocab, seed=0):
  tokens = np.random.RandomState(seed).randint(0, vocab, (2, 16))
  valid = np.ones((2, 16), bool)
  valid[1, :5] = False  # left padding
  tokens[1, :5] = 0
  pos = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  return tokens, valid, pos


def _rlx_logits(cfg, params, tokens, valid, pos):
  logits, _ = transformer.apply(transformer.graphdef_for(cfg), params, jnp.asarray(tokens),
                                jnp.asarray(pos, jnp.int32), jnp.asarray(valid))
  return np.asarray(logits)


def test_export_loads_in_transformers_with_rlx_logits(run_dir, tmp_path):
  out = export.export(run_dir, str(tmp_path / "hf"))
  assert out == str(tmp_path / "hf")
  assert {"config.json", "model.safetensors", "tokenizer.model"} <= set(os.listdir(out))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  assert type(model).__name__ == "LlamaForCausalLM"
  cfg = _model_cfg(run_dir, 3)
  tokens, valid, pos = _inputs(cfg.vocab_size)
  with torch.no_grad():
    want = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(int)),
                 position_ids=torch.tensor(pos)).logits.numpy()
  got = _rlx_logits(cfg, checkpoint.read_arrays(run_dir, 3)["params"], tokens, valid, pos)
  np.testing.assert_allclose(want[valid], got[valid], atol=1e-4, rtol=0)
  _, base = hf.load_hf(os.path.join(run_dir, "base"))
  assert np.abs(_rlx_logits(cfg, base, tokens, valid, pos) - got)[valid].max() > 1e-2

  # The sentencepiece tokenizer comes along, with its ids in config.json.
  with open(os.path.join(out, "config.json")) as f:
    hf_cfg = json.load(f)
  assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (2, 3, 0)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ours = Tokenizer.load(os.path.join(run_dir, "base", "tokenizer.model"))
  for text in ("12+34=", "What is 7*8? 56"):
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text)


def test_step_and_force(run_dir, tmp_path):
  out = export.export(run_dir, str(tmp_path / "hf"), step=1, dtype="bfloat16")
  cfg, params = hf.load_hf(out)
  assert cfg.param_dtype == "float32"  # load_hf's default; the file holds bf16
  want = checkpoint.read_arrays(run_dir, 1)["params"]["layer_0"]["mlp"]["up_proj"]
  np.testing.assert_array_equal(np.asarray(params["layer_0"]["mlp"]["up_proj"]),
                                want.astype(jnp.bfloat16).astype(np.float32))
  with pytest.raises(FileExistsError, match=r"hf is not empty; pass --force to overwrite it"):
    export.export(run_dir, out)
  assert export.export(run_dir, out, force=True) == out
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 7 has no checkpoint in .*; saved steps are \[1, 2, 3\]"):
    export.export(run_dir, str(tmp_path / "other"), step=7)
  with pytest.raises(ValueError, match="is the run's workdir, checkpoints or base model"):
    export.export(run_dir, os.path.join(run_dir, "base"), force=True)


def test_hf_base_model_tokenizer_files(run_dir, tmp_path):
  """A run from config.model.path: that directory's tokenizer files and token ids come along."""
  src = export.export(run_dir, str(tmp_path / "src"), step=1)
  with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 64}, f)
  with open(os.path.join(src, "config.json")) as f:
    src_cfg = json.load(f)
  with open(os.path.join(src, "config.json"), "w") as f:
    json.dump({**src_cfg, "eos_token_id": [3, 5]}, f)
  wd = str(tmp_path / "run")
  shutil.copytree(run_dir, wd)
  ckpt = checkpoint.Checkpointer(wd, keep=5, async_save=False)
  meta = ckpt.read_meta(3)
  meta["config"]["model"]["path"] = src
  ckpt.save(4, checkpoint.read_arrays(wd, 3), meta, force=True)
  ckpt.close()
  out = export.export(wd, str(tmp_path / "out"))
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    assert json.load(f)["model_max_length"] == 64
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["eos_token_id"] == [3, 5]
  shutil.rmtree(src)
  with pytest.raises(FileNotFoundError, match=r"src, which holds the tokenizer of the run in "
                     r".*, does not exist"):
    export.export(wd, str(tmp_path / "out2"))


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "rlx.export", *args], capture_output=True,
                        text=True, timeout=120, cwd=REPO)


def test_cli(run_dir, tmp_path):
  out = _cli(run_dir, str(tmp_path / "hf"), "--step", "2")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == f"wrote {tmp_path / 'hf'}"
  for args, pattern in [((str(tmp_path / "missing"), str(tmp_path / "o")),
                         r"workdir '.*missing' does not exist"),
                        ((run_dir,), r"the following arguments are required: out_dir")]:
    out = _cli(*args)
    assert out.returncode == 2, (args, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match("rlx: error: " + pattern, lines[0]), out.stderr


@pytest.mark.parametrize("args,pattern", [
    (("{tmp}", "{tmp}/o"), r"is not an rlx run: it has no checkpoints/ directory"),
    (("{run}", "{tmp}/o", "--step", "9"),
     r"step 9 has no checkpoint .*saved steps are \[1, 2, 3\]"),
    (("{run}", "{tmp}/full"), r"full is not empty; pass --force to overwrite it"),
    (("{run}", "{tmp}/o", "--dtype", "int8"), r"argument --dtype: invalid choice: 'int8'"),
])
def test_cli_errors_in_process(run_dir, tmp_path, capsys, args, pattern):
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(SystemExit) as e:
    export.main([a.format(tmp=tmp_path, run=run_dir) for a in args])
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and re.match("rlx: error: .*" + pattern, lines[0]), lines
  assert not os.path.exists(tmp_path / "o")
