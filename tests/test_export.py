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
from rlx.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece
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
  assert out.stdout.strip() == f"wrote {tmp_path / 'hf'} (checkpoint step 2)"
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


# ------------------------------------------------------------------------------ the user's path:
# AutoTokenizer + AutoModelForCausalLM.generate on OUT gives rlx's own greedy completions.

PROMPTS = ("123+456=", "4821+3907=", "7+8=", "350+12=")
NEW_TOKENS = 6


def _rlx_greedy(cfg, params, tok, prompt_ids):
  """rlx's greedy completions (its dense sampler, as evaluation decodes), as text."""
  from rlx.sampler import dense  # pylint: disable=g-import-not-at-top
  from rlx.sampler.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  width = max(map(len, prompt_ids))
  prompts = np.full((len(prompt_ids), width), tok.pad_id, np.int32)
  for i, p in enumerate(prompt_ids):
    prompts[i, width - len(p):] = p
  sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=tok.eos_id,
                      pad_id=tok.pad_id, stop_ids=tuple(tok.stop_ids))
  ro = dense.generate(transformer.graphdef_for(cfg), params, jnp.asarray(prompts),
                      jnp.asarray([len(p) for p in prompt_ids], jnp.int32),
                      jax.random.split(jax.random.key(0), len(prompt_ids)), params_cfg=sp)
  return [tok.decode(np.asarray(t)[:l]) for t, l in zip(ro.tokens, ro.lengths)]


def _check_user_path(out, cfg, params, tok, prompts=PROMPTS, chat=False):
  """OUT through transformers, as a user runs it: AutoTokenizer encodes each prompt as rlx
  did (bos included), and greedy generate() decodes to rlx's greedy completions."""
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  if chat:  # rlx renders the chat template and encodes without special tokens on top
    texts = [hf_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                        add_generation_prompt=True) for p in prompts]
    hf_ids = [hf_tok(t, add_special_tokens=False).input_ids for t in texts]
    ours = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
  else:
    hf_ids = [hf_tok(p).input_ids for p in prompts]
    ours = [tok.encode(p, add_special_tokens=True) for p in prompts]
  assert hf_ids == ours
  got = []
  with torch.no_grad():
    for ids in hf_ids:
      seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                           max_new_tokens=NEW_TOKENS, do_sample=False)
      got.append(hf_tok.decode(seq[0, len(ids):], skip_special_tokens=True))
  want = _rlx_greedy(cfg, params, tok, ours)
  assert got == want
  assert any(w for w in want)  # not vacuous: something was generated
  return hf_tok


def test_user_path_sentencepiece(run_dir, tmp_path):
  """The built-in warm start's sentencepiece model: OUT gets a tokenizer_config.json that adds
  bos and a converted tokenizer.json (transformers' own conversion of a bare tokenizer.model
  adds no bos, and the arithmetic model then answers wrong)."""
  out = export.export(run_dir, str(tmp_path / "hf"))
  ours = Tokenizer.load(os.path.join(run_dir, "base", "tokenizer.model"))
  cfg = _model_cfg(run_dir, 3)
  _check_user_path(out, cfg, checkpoint.read_arrays(run_dir, 3)["params"], ours)
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    tc = json.load(f)
  assert (tc["bos_token"], tc["eos_token"], tc["pad_token"], tc["add_bos_token"]) == (
      "<s>", "</s>", "<pad>", True)
  # rlx reading OUT back (tokenizer.json now wins) encodes as the run did.
  again = load_tokenizer(out)
  for text in PROMPTS + ("", " 12 +  3 =\n", "x"):
    assert again.encode(text, add_special_tokens=True) == ours.encode(text, True), text


def test_sentencepiece_conversion_encodes_as_sentencepiece(tmp_path):
  """Tokenizer.save_pretrained: AutoTokenizer gives sentencepiece's ids on varied text, for
  rlx's own models (no dummy prefix, split digits, a user symbol) and a dummy-prefix one."""
  import io
  import sentencepiece as spm
  rng = np.random.RandomState(0)
  corpus = [f"Question: what is {a}+{b}? Carry the one, then #### {a + b}"
            for a, b in rng.randint(0, 999, (300, 2))] + ["café naïve x² Ω"] * 3
  models = {"rlx": train_sentencepiece(corpus, 100, symbols=["####"])}
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=proto,
                                 vocab_size=100, model_type="bpe", split_digits=True,
                                 character_coverage=1.0, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                 num_threads=1, minloglevel=2)
  models["dummy_prefix"] = Tokenizer(proto.getvalue())
  words = ["what", "is", "Carry", "the", "####", "café", "ｆｕｌｌ", "🙂", "\n", "\t", "+", "="]
  texts = ["", " ", "  a  b  ", "12+34=", " leading", "trailing ", "x\n\ny", "#### 12"]
  for _ in range(300):
    parts = [str(rng.randint(0, 10**rng.randint(1, 6))) if rng.rand() < 0.4
             else words[rng.randint(len(words))] for _ in range(rng.randint(1, 8))]
    texts.append(["", " ", "  "][rng.randint(3)].join(parts) + ["", " "][rng.randint(2)])
  for name, tok in models.items():
    tok.save_pretrained(str(tmp_path / name))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
    for text in texts:
      want = tok.encode(text, add_special_tokens=True)
      assert hf_tok(text).input_ids == want, (name, text)
      assert hf_tok.decode(want, skip_special_tokens=True) == tok.decode(want), (name, text)


CHAT = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")


def _json_tokenizer_model(path):
  """A tiny Llama with a byte-level BPE tokenizer.json whose bos comes from
  tokenizer_config.json's add_bos_token (its post-processor adds none), and a chat template."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  rng = np.random.RandomState(0)
  tok.train_from_iterator(
      [f"{a}+{b}={a + b} Compute the sum." for a, b in rng.randint(0, 9999, (200, 2))],
      tokenizers.trainers.BpeTrainer(
          vocab_size=120, special_tokens=["<|pad|>", "<|begin|>", "<|end|>", "<|start|>"],
          initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  os.makedirs(path)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin|>",
               "eos_token": "<|end|>", "pad_token": "<|pad|>", "add_bos_token": True,
               "chat_template": CHAT}, f)
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32,
                                 intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=True,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
  transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
  return path


def _hand_run(workdir, cfg, params, config, base=None):
  """A workdir holding one checkpoint (step 5) of `params` (a LoRA run: adapters, with the
  frozen `base`), as a run with `config` leaves it."""
  state = {"params": params, "step": np.int32(5)}
  if base is not None:
    state["base"] = base
  ckpt = checkpoint.Checkpointer(workdir, async_save=False)
  ckpt.save(5, state, {"model": cfg.to_dict(), "config": config}, force=True)
  ckpt.close()
  return workdir


def _perturbed(params, seed=1, scale=0.3):
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: np.asarray(x) + scale * rng.standard_normal(x.shape).astype(
      np.float32), params)


def _lora(base, seed=2):
  from rlx.model import lora  # pylint: disable=g-import-not-at-top
  lcfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=(r"(q|v|up)_proj$",))
  rng = np.random.RandomState(seed)
  adapters = jax.tree.map(lambda x: (0.5 * rng.standard_normal(x.shape)).astype(np.float32),
                          lora.init_adapters(base, lcfg, seed))
  record = {"rank": 2, "alpha": 4.0, "targets": r"(q|v|up)_proj$", "base_dtype": ""}
  return adapters, lora.merge(base, adapters, lcfg), record


@pytest.mark.parametrize("use_lora", [False, True])
def test_user_path_tokenizer_json(tmp_path, use_lora):
  """A Hugging Face base model with a tokenizer.json (config.model.path): plain prompts get
  the bos its tokenizer_config.json asks for, chat prompts its template; merged LoRA too."""
  src = _json_tokenizer_model(str(tmp_path / "src"))
  cfg, base = hf.load_hf(src)
  base = _perturbed(base)
  config = {"model": {"path": src}}
  if use_lora:
    adapters, policy, config["lora"] = _lora(base)
    wd = _hand_run(str(tmp_path / "run"), cfg, adapters, config, base=base)
  else:
    policy = base
    wd = _hand_run(str(tmp_path / "run"), cfg, base, config)
  out = export.export(wd, str(tmp_path / "hf"))
  ours = load_tokenizer(src)  # as the trainer loads it
  assert ours.encode("1+2=", add_special_tokens=True)[0] == 1  # bos, from the config
  _check_user_path(out, cfg, policy, ours)
  _check_user_path(out, cfg, policy, ours, chat=True)


def test_user_path_sentencepiece_lora(run_dir, tmp_path):
  """A LoRA run on the built-in warm start: the merged export encodes and answers as rlx."""
  wd = str(tmp_path / "run")
  shutil.copytree(os.path.join(run_dir, "base"), os.path.join(wd, "base"))
  cfg, base = hf.load_hf(os.path.join(wd, "base"))
  adapters, policy, record = _lora(base)
  _hand_run(wd, cfg, adapters, {"model": {"path": ""}, "lora": record}, base=base)
  out = export.export(wd, str(tmp_path / "hf"))
  assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
  _check_user_path(out, cfg, policy,
                   Tokenizer.load(os.path.join(run_dir, "base", "tokenizer.model")))


# ------------------------------------------------------------------ which step; a full disk


def test_latest_step_without_state_is_refused(run_dir, tmp_path, capsys):
  """A newest step directory without state/ (damaged, partly copied) is not passed over in
  silence for an older step; the step exported is named."""
  wd = str(tmp_path / "run")
  shutil.copytree(run_dir, wd)
  os.makedirs(os.path.join(wd, "checkpoints", "9"))
  with pytest.raises(SystemExit) as e:
    export.main([wd, str(tmp_path / "o")])
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and re.match(
      r"rlx: error: the latest checkpoint .*checkpoints/9 has no state/ \(damaged or partly "
      r"copied\); pass --step 3 to export the newest complete one\.$", lines[0]), lines
  assert not os.path.exists(tmp_path / "o")
  with pytest.raises(SystemExit):
    export.main([wd, str(tmp_path / "o"), "--step", "9"])
  assert re.match(r"rlx: error: .*checkpoints/9 has no state/ \(damaged or partly copied\); "
                  r"complete steps are \[1, 2, 3\]", capsys.readouterr().err)
  assert export.main([wd, str(tmp_path / "o"), "--step", "3"]) == 0
  assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'o'} (checkpoint step 3)"


def _disk_fills(monkeypatch):
  """hf.write_safetensors writes part of the weights, then the disk is full."""
  import errno  # pylint: disable=g-import-not-at-top

  def full(out_dir, *args, **kwargs):
    path = os.path.join(out_dir, "model.safetensors")
    with open(path, "wb") as f:
      f.write(b"\0" * 1000)
    raise OSError(errno.ENOSPC, "No space left on device", path)

  monkeypatch.setattr(hf, "write_safetensors", full)


def test_full_disk_leaves_out_dir_as_it_was(run_dir, tmp_path, monkeypatch, capsys):
  """The export is written beside OUT_DIR and moved in at the end: a full disk leaves no
  partial OUT_DIR (and no scratch directory), and the same command then succeeds."""
  out = str(tmp_path / "a" / "b" / "hf")  # its parents do not exist either
  with monkeypatch.context() as m:
    _disk_fills(m)
    with pytest.raises(SystemExit) as e:
      export.main([run_dir, out])
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and re.match(
      rf"rlx: error: Could not write {re.escape(out)} \(No space left on device\); nothing was "
      r"written there: free space \(or fix permissions\) and run the same command again\.$",
      lines[0]), lines
  assert os.listdir(tmp_path) == []
  assert export.main([run_dir, out]) == 0  # no --force needed
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))

  # An empty OUT_DIR stays, empty; a non-empty one with --force keeps what it had.
  empty = tmp_path / "empty"
  empty.mkdir()
  with monkeypatch.context() as m:
    _disk_fills(m)
    with pytest.raises(SystemExit):
      export.main([run_dir, str(empty)])
  assert os.listdir(empty) == [] and sorted(os.listdir(tmp_path)) == ["a", "empty"]
  before = {n: (tmp_path / "a" / "b" / "hf" / n).read_bytes() for n in os.listdir(out)}
  with monkeypatch.context() as m:
    _disk_fills(m)
    with pytest.raises(SystemExit):
      export.main([run_dir, out, "--force", "--step", "1"])
  assert {n: (tmp_path / "a" / "b" / "hf" / n).read_bytes() for n in os.listdir(out)} == before
  assert os.listdir(tmp_path / "a" / "b") == ["hf"]


def test_force_replaces_the_exports_files_only(run_dir, tmp_path):
  """--force into a non-empty OUT_DIR: weights and tokenizer files of an earlier export are
  replaced (stale shards removed), other files kept."""
  out = tmp_path / "hf"
  out.mkdir()
  (out / "README.md").write_text("mine")
  (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
  (out / "model.safetensors.index.json").write_text("{}")
  (out / "chat_template.jinja").write_text("old")
  export.export(run_dir, str(out), force=True)
  assert sorted(os.listdir(out)) == [
      "README.md", "config.json", "model.safetensors", "special_tokens_map.json",
      "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
  assert (out / "README.md").read_text() == "mine"
  transformers.AutoModelForCausalLM.from_pretrained(str(out))
