"""LoRA export: the merged Hugging Face checkpoint and the PEFT adapter directory give the same
logits as rlx's adapted model (transformers / peft on tiny random Llama and Qwen2 models)."""

import json
import os
import re

import jax
import numpy as np
import pytest

from rlx import checkpoint, export
from rlx.model import hf, lora, transformer
from rlx.model.config import ModelConfig

from test_hf import _assert_close, _hf_logits, _hf_model, _inputs, _rlx_logits, _save

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0  # scale 2


def _adapters(params, targets, seed=0):
  """Adapters on `targets` with random A and B (B nonzero: the adapted model is not the base)."""
  cfg = lora.LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets)
  adapters = lora.init_adapters(params, cfg, seed)
  rng = np.random.RandomState(seed)
  adapters = jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32),
                          adapters)
  return cfg, adapters


def _lora_modules(model):
  """Names of the modules PEFT put adapters on, as in the base model ('model.layers.0....')."""
  names = {n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
  return {re.sub(r"^base_model\.model\.", "", n) for n in names}


def _hf_modules(cfg, adapters):
  return {hf.hf_name(cfg, p)[0][:-len(".weight")] for p in lora.adapter_paths(adapters)}


# name, targets, the target_modules PEFT gets (a list, or None: a regex)
CASES = [
    ("llama_gqa4", (r"(q|k|v|o|gate|up|down)_proj$", "lm_head"),
     ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("qwen2", (r"(q|k|v|o|gate|up|down)_proj$",),
     ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("qwen2", (r"(q|v)_proj$",), ["q_proj", "v_proj"]),
    # some layers only, and different modules on different layers: a regex
    ("llama_gqa4", (r"layer_1/attn/(q|v)_proj$", r"layer_0/mlp/down_proj$", "lm_head"), None),
]


@pytest.mark.parametrize("name,targets,listed", CASES)
def test_merged_and_peft_match_rlx(name, targets, listed, tmp_path):
  model = _hf_model(name)
  base_dir = _save(model, tmp_path / "base")
  cfg, base = hf.load_hf(base_dir)
  lcfg, adapters = _adapters(base, targets)
  tokens, valid, pos = _inputs()
  merged = _rlx_logits(cfg, lora.merge(base, adapters, lcfg), tokens, valid, pos)
  unmerged = _rlx_logits(cfg, lora.attach(base, adapters, lcfg), tokens, valid, pos)
  _assert_close(unmerged, merged, valid)
  # not vacuous: the adapters change the model
  assert np.abs(merged - _rlx_logits(cfg, base, tokens, valid, pos))[valid].max() > 1e-2

  hf.save_hf(cfg, base, str(tmp_path / "merged"), adapters=adapters, lora_cfg=lcfg)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "merged"), attn_implementation="eager").eval()
  _assert_close(_hf_logits(reloaded, tokens, valid, pos), merged, valid)

  out = str(tmp_path / "adapter")
  hf.save_peft_adapter(cfg, adapters, lcfg, out, base_model_name_or_path=base_dir)
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
  with open(os.path.join(out, "adapter_config.json")) as f:
    acfg = json.load(f)
  assert (acfg["peft_type"], acfg["task_type"], acfg["r"], acfg["lora_alpha"]) == (
      "LORA", "CAUSAL_LM", RANK, 8)
  if listed is not None:
    assert acfg["target_modules"] == listed
  else:
    assert isinstance(acfg["target_modules"], str)
  peft_model = peft.PeftModel.from_pretrained(model, out).eval()
  assert _lora_modules(peft_model) == _hf_modules(cfg, adapters)  # exactly these modules
  _assert_close(_hf_logits(peft_model, tokens, valid, pos), unmerged, valid)


def test_bf16_base_merges_in_f32(tmp_path):
  """A bf16 frozen base: the merged f32 export adds the f32 delta to the bf16 weights."""
  cfg, base = hf.load_hf(_save(_hf_model("qwen2"), tmp_path / "base"))
  lcfg, adapters = _adapters(base, (r"(q|v)_proj$",))
  base16 = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), base)
  hf.save_hf(cfg, base16, str(tmp_path / "out"), adapters=adapters, lora_cfg=lcfg)
  _, got = hf.load_hf(str(tmp_path / "out"))
  w = np.asarray(base16["layer_1"]["attn"]["q_proj"]).astype(np.float32)
  ad = adapters["layer_1"]["attn"]["q_proj"]
  np.testing.assert_allclose(np.asarray(got["layer_1"]["attn"]["q_proj"]),
                             w + 2.0 * ad["a"] @ ad["b"], atol=1e-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(got["layer_1"]["attn"]["k_proj"]),
                                np.asarray(base16["layer_1"]["attn"]["k_proj"]).astype(np.float32))


# ------------------------------------------------------------------------------ bad inputs

TINY = ModelConfig(vocab_size=32, num_layers=2, d_model=16, num_heads=2, num_kv_heads=1,
                   head_dim=8, mlp_dim=24, tie_embeddings=True)


def _ab(d_in, d_out, r=RANK):
  return {"a": np.zeros((d_in, r), np.float32), "b": np.ones((r, d_out), np.float32)}


@pytest.mark.parametrize("adapters,pattern", [
    ({"layer_2": {"attn": {"q_proj": _ab(16, 16)}}},
     r"adapters for 'layer_2/attn/q_proj', which is not a projection of this model \(2 layers"),
    ({"lm_head": _ab(16, 32)}, r"adapters for 'lm_head', which is not a projection .*tied"),
    ({"layer_0": {"input_norm": {"scale": _ab(16, 16)}}},
     r"adapters for 'layer_0/input_norm/scale', which is not a projection"),
    ({"layer_0": {"attn": {"q_proj": _ab(16, 16, r=2)}}},
     r"adapter 'layer_0/attn/q_proj' has a \[16, 2\], b \[2, 16\]; rank 4 on a \[16, 16\] "
     r"weight implies a \[16, 4\], b \[4, 16\]"),
    ({"layer_0": {"attn": {"v_proj": _ab(16, 16)}}},
     r"adapter 'layer_0/attn/v_proj' has a \[16, 4\], b \[4, 16\]; rank 4 on a \[16, 8\] weight"),
    ({"layer_0": {"attn": {"q_proj": {"a": np.zeros((16, 4))}}}},
     r"adapter 'layer_0/attn/q_proj' has only \['a'\]; expected a and b"),
    ({"layer_0": {"attn": {"q_proj": np.zeros((16, 16))}}},
     r"adapter leaf 'layer_0/attn/q_proj'; expected paths ending in /a and /b"),
    ({}, r"adapters=dict \(empty\), expected a nested dict"),
    ({"layer_0": {"attn": {}}}, r"adapters hold no arrays; expected a nested dict"),
])
@pytest.mark.parametrize("writer", ["save_hf", "save_peft_adapter"])
def test_bad_adapters_one_line(adapters, pattern, writer, tmp_path):
  lcfg = lora.LoRAConfig(rank=RANK, alpha=ALPHA)
  with pytest.raises(ValueError) as e:
    if writer == "save_hf":
      hf.save_hf(TINY, transformer.init_params(TINY, 0)[1], str(tmp_path / "o"),
                 adapters=adapters, lora_cfg=lcfg)
    else:
      hf.save_peft_adapter(TINY, adapters, lcfg, str(tmp_path / "o"))
  msg = str(e.value)
  assert "\n" not in msg and re.search(f"^{writer}: " + pattern, msg), msg
  assert not os.path.exists(tmp_path / "o")  # nothing written


def test_save_hf_needs_both_adapters_and_config(tmp_path):
  _, params = transformer.init_params(TINY, 0)
  with pytest.raises(ValueError, match=r"^save_hf: pass adapters and lora_cfg together"):
    hf.save_hf(TINY, params, str(tmp_path / "o"), adapters={"lm_head": _ab(16, 32)})
  with pytest.raises(ValueError, match=r"lora_cfg=dict, expected an rlx.model.lora.LoRAConfig"):
    hf.save_peft_adapter(TINY, {"layer_0": {"attn": {"q_proj": _ab(16, 16)}}},
                         {"rank": 4, "alpha": 8}, str(tmp_path / "o"))
  with pytest.raises(ValueError, match=r"^save_peft_adapter: dtype='int8'"):
    hf.save_peft_adapter(TINY, {}, lora.LoRAConfig(rank=RANK, alpha=ALPHA), str(tmp_path / "o"),
                         dtype="int8")


def test_target_modules_expressions():
  t = hf.peft_target_modules
  both = [f"layer_{i}/attn/{m}_proj" for i in (0, 1) for m in "qv"]
  assert t(TINY, both) == ["q_proj", "v_proj"]
  pattern = t(TINY, ["layer_1/attn/q_proj", "layer_1/attn/v_proj", "layer_0/mlp/up_proj"])
  assert pattern == (r"model\.layers\.(?:0)\.(?:mlp\.up_proj)|"
                     r"model\.layers\.(?:1)\.(?:self_attn\.q_proj|self_attn\.v_proj)")
  assert re.fullmatch(pattern, "model.layers.1.self_attn.v_proj")
  assert not re.fullmatch(pattern, "model.layers.0.self_attn.v_proj")
  assert not re.fullmatch(pattern, "model.layers.1.mlp.up_proj")


# ------------------------------------------------------------------------------ rlx.export


def _lora_run(tmp_path, name="llama_gqa4", targets=(r"(q|v)_proj$",), lora_record=True,
              with_base=True):
  """A workdir as a LoRA run leaves it: base model in WORKDIR/base (the warm start's place),
  a checkpoint whose TrainState holds `params` (the adapters) and `base`."""
  wd = tmp_path / "run"
  model = _hf_model(name)
  base_dir = _save(model, wd / "base")
  cfg, base = hf.load_hf(base_dir)
  lcfg, adapters = _adapters(base, targets)
  state = {"params": adapters, "step": np.int32(3)}
  if with_base:
    state["base"] = jax.tree.map(np.asarray, base)
  config = {"model": {"path": ""}}
  if lora_record:
    config["lora"] = {"rank": RANK, "alpha": ALPHA, "targets": "|".join(targets),
                      "dropout": 0.0, "base_dtype": "", "merge_for_sampling": True}
  ckpt = checkpoint.Checkpointer(str(wd), async_save=False)
  ckpt.save(3, state, {"model": cfg.to_dict(), "config": config}, force=True)
  ckpt.close()
  return str(wd), model, cfg, base, lcfg, adapters


def test_export_lora_run_merged_and_peft(tmp_path):
  wd, _, cfg, base, lcfg, adapters = _lora_run(tmp_path)
  tokens, valid, pos = _inputs()
  want = _rlx_logits(cfg, lora.attach(base, adapters, lcfg), tokens, valid, pos)

  merged = export.export(wd, str(tmp_path / "merged"))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      merged, attn_implementation="eager").eval()
  _assert_close(_hf_logits(model, tokens, valid, pos), want, valid)

  assert export.main([wd, str(tmp_path / "peft"), "--peft"]) == 0
  with open(tmp_path / "peft" / "adapter_config.json") as f:
    assert json.load(f)["base_model_name_or_path"] == os.path.join(wd, "base")
  # the adapter directory names its base: AutoPeftModel loads both
  model = peft.AutoPeftModelForCausalLM.from_pretrained(
      str(tmp_path / "peft"), attn_implementation="eager").eval()
  assert _lora_modules(model) == _hf_modules(cfg, adapters)
  _assert_close(_hf_logits(model, tokens, valid, pos), want, valid)

  export.export(wd, str(tmp_path / "hub"), peft=True, base_model="org/some-model",
                dtype="bfloat16")
  with open(tmp_path / "hub" / "adapter_config.json") as f:
    assert json.load(f)["base_model_name_or_path"] == "org/some-model"
  path = str(tmp_path / "hub" / "adapter_model.safetensors")
  header = hf._read_header(path)  # pylint: disable=protected-access
  assert {i.dtype for i in header.values()} == {"BF16"} and len(header) == 4 * cfg.num_layers


def _one_line(capsys, pattern):
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and re.match("rlx: error: .*" + pattern, lines[0]), lines


def test_export_lora_errors(tmp_path, capsys):
  wd, *_ = _lora_run(tmp_path / "a", with_base=False)
  capsys.readouterr()  # transformers' progress bars
  with pytest.raises(SystemExit):
    export.main([wd, str(tmp_path / "o")])
  _one_line(capsys, r"holds no frozen base \(TrainState.base\), yet the run's config.lora.rank "
            r"is 4")
  with pytest.raises(SystemExit):
    export.main([wd, str(tmp_path / "o"), "--base_model", "x"])
  _one_line(capsys, r"--base_model names the base of a PEFT adapter; it needs --peft")

  wd, *_ = _lora_run(tmp_path / "b", lora_record=False)
  capsys.readouterr()
  with pytest.raises(SystemExit):
    export.main([wd, str(tmp_path / "o"), "--peft"])
  _one_line(capsys, r"--peft writes LoRA adapters, but the run in .* trained all parameters")
  with pytest.raises(SystemExit):
    export.main([wd, str(tmp_path / "o")])
  _one_line(capsys, r"holds LoRA adapters and a frozen base, yet the run's config has no "
            r"config.lora.rank > 0")

  # the run's base directory was replaced by another model: --peft would name the wrong base
  wd, *_ = _lora_run(tmp_path / "c")
  _save(_hf_model("llama_gqa4", num_hidden_layers=3), os.path.join(wd, "base"))
  capsys.readouterr()
  with pytest.raises(SystemExit):
    export.main([wd, str(tmp_path / "o"), "--peft"])
  _one_line(capsys, r"The run's base model .*base is not the model in the checkpoint "
            r"\(num_layers 3 vs 2\); pass --base_model")
  assert not os.path.exists(tmp_path / "o")
