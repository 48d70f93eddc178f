"""Hugging Face import / export: logit parity with transformers on tiny random models."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.model import hf, transformer
from rlx.model.config import ModelConfig
from rlx.sampler import dense
from rlx.sampler.sampling import SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 128  # vocabulary of every tiny model
T = 24  # tokens per row
PAD = 5  # left padding of row 1

COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
              initializer_range=0.1)
# name -> (config class name, kwargs); each case covers one family's switches.
CASES = {
    # GQA 4 query heads / 1 kv head, non-default theta, untied.
    "llama_gqa4": ("LlamaConfig", dict(num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=1, rope_theta=5000.0,
                                       tie_word_embeddings=False)),
    # Llama 3.x rope scaling, tied (as Llama 3.2 1B/3B); small original context so the
    # low / medium / high frequency bands all occur at head_dim 16.
    "llama3_rope": ("LlamaConfig", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # Qwen2.5: q/k/v biases, GQA 6/2 = 3, tied, theta 1e6.
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, hidden_size=96, num_attention_heads=6,
                                  num_key_value_heads=2, rope_theta=1e6,
                                  tie_word_embeddings=True)),
    # Qwen3: q/k norm, head_dim != hidden / heads, untied.
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", dict(num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, head_dim=16)),
    # Gemma 2: soft-capping small enough to bite, sliding window 8 < 24 tokens on even layers,
    # query_pre_attn_scalar != head_dim.
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0)),
    # Gemma 3: sliding / global mix from sliding_window_pattern, window 6 < 24 tokens, local
    # rope base, linear rope scaling on global layers only, q/k norm.
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=6, sliding_window_pattern=2, rope_theta=100000.0,
        rope_local_base_freq=1000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
        query_pre_attn_scalar=24)),
}


def _hf_model(name, seed=0, **overrides):
  cls, kw = CASES[name]
  torch.manual_seed(seed)
  config = getattr(transformers, cls)(**{**COMMON, **kw, **overrides})
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():  # norms start at 1 (or 0) and biases at 0: make them matter
    for pname, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn_like(p))
  return model.eval()


def _save(model, path, **kw):
  model.save_pretrained(path, **kw)
  return str(path)


def _inputs(seed=0):
  tokens = np.random.RandomState(seed).randint(0, V, (2, T))
  valid = np.ones((2, T), bool)
  valid[1, :PAD] = False
  tokens[1, :PAD] = 0
  pos = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  return tokens, valid, pos


def _hf_logits(model, tokens, valid, pos):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(int)),
                position_ids=torch.tensor(pos))
  return out.logits.float().numpy()


def _rlx_logits(cfg, params, tokens, valid, pos):
  logits, _ = transformer.apply(transformer.graphdef_for(cfg), params, jnp.asarray(tokens),
                                jnp.asarray(pos, jnp.int32), jnp.asarray(valid))
  return np.asarray(logits)


def _assert_close(got, want, valid, tol=1e-4):
  err = np.abs(got - want)[valid].max()
  assert err <= tol, f"max abs logit diff {err:.3g} > {tol}"
  assert np.abs(want[valid]).max() > 0.1  # the comparison is not vacuous


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
  model = _hf_model(name)
  cfg, params = hf.load_hf(_save(model, tmp_path / name))
  tokens, valid, pos = _inputs()
  _assert_close(_rlx_logits(cfg, params, tokens, valid, pos), _hf_logits(model, tokens, valid, pos),
                valid)


def test_config_switches():
  """The parity cases exercise what they claim to."""
  cfgs = {n: hf.config_from_hf(_hf_model(n).config.to_dict()) for n in ("llama3_rope",
                                                                          "gemma2", "gemma3")}
  assert cfgs["llama3_rope"].rope_scaling == "llama3" and cfgs["llama3_rope"].tie_embeddings
  assert cfgs["gemma2"].layer_types == ("sliding", "global", "sliding")
  assert cfgs["gemma2"].attn_logit_softcap == 2.0 and cfgs["gemma2"].final_logit_softcap == 3.0
  g3 = cfgs["gemma3"]
  assert g3.layer_types == ("sliding", "global", "sliding", "global")
  assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling) == (1e5, 1e3, "linear")
  assert g3.sliding_window == 6 < T and g3.qk_norm and g3.query_pre_attn_scalar == 24


def test_legacy_config_keys():
  """transformers 4.x files: top-level rope_theta / rope_scaling / rope_local_base_freq."""
  base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=131072)
  llama = hf.config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                             "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}})
  assert (llama.rope_theta, llama.rope_scaling_factor, llama.num_kv_heads) == (5e5, 32.0, 4)
  assert llama.max_position == 131072 and not llama.tie_embeddings
  g3 = hf.config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"],
                          "text_config": {**base, "rope_scaling": {"rope_type": "linear",
                                                                   "factor": 8.0},
                                          "sliding_window": 1024}})
  assert g3.rope_theta == 1e6 and g3.rope_local_theta == 1e4 and g3.rope_scaling_factor == 8.0
  assert g3.head_dim == 256 and g3.num_kv_heads == 4  # Gemma3TextConfig defaults
  qwen = hf.config_from_hf({**base, "architectures": ["Qwen2ForCausalLM"],
                            "use_sliding_window": False, "sliding_window": 4096,
                            "tie_word_embeddings": True})
  assert qwen.layer_types == () and qwen.qkv_bias and qwen.tie_embeddings


def test_gemma3_multimodal_checkpoint_loads_text_model(tmp_path):
  _, kw = CASES["gemma3"]
  text = {**COMMON, **kw}
  vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=28, patch_size=14)
  torch.manual_seed(0)
  model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
      text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4)).eval()
  cfg, params = hf.load_hf(_save(model, tmp_path / "g3mm"))
  tokens, valid, pos = _inputs()
  _assert_close(_rlx_logits(cfg, params, tokens, valid, pos), _hf_logits(model, tokens, valid, pos),
                valid)


def test_sharded_checkpoint(tmp_path):
  model = _hf_model("qwen2")
  path = _save(model, tmp_path / "sharded", max_shard_size="100KB")
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
  cfg, params = hf.load_hf(path)
  tokens, valid, pos = _inputs()
  _assert_close(_rlx_logits(cfg, params, tokens, valid, pos), _hf_logits(model, tokens, valid, pos),
                valid)


def test_bf16_checkpoint_and_dtypes(tmp_path, monkeypatch):
  """bf16 files (which safetensors' numpy reader cannot read) load exactly; the row-block path
  for big tensors gives the same arrays as the one-shot path."""
  model = _hf_model("llama_gqa4").to(torch.bfloat16)
  path = _save(model, tmp_path / "bf16")
  cfg, params = hf.load_hf(path, dtype="float32")
  want = model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T
  np.testing.assert_array_equal(np.asarray(params["layer_0"]["attn"]["q_proj"]), want)
  monkeypatch.setattr(hf, "_CHUNK_BYTES", 1000)  # stream every matrix in row blocks
  cfg16, params16 = hf.load_hf(path, dtype="bfloat16")
  assert cfg16.param_dtype == "bfloat16" and params16["embedding"].dtype == jnp.bfloat16
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params16)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float32))


@pytest.mark.parametrize("name", ["llama3_rope", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_export_round_trip(name, tmp_path):
  """import -> save_hf -> transformers from_pretrained gives the same logits, bit for bit."""
  model = _hf_model(name)
  cfg, params = hf.load_hf(_save(model, tmp_path / "in"))
  out = tmp_path / "out"
  hf.save_hf(cfg, params, str(out), dtype="float32", max_shard_bytes=60_000)
  assert os.path.exists(out / "model.safetensors.index.json")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(out), attn_implementation="eager").eval()
  assert type(reloaded) is type(model)
  tokens, valid, pos = _inputs()
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens, valid, pos)[valid],
                                _hf_logits(model, tokens, valid, pos)[valid])
  cfg2, _ = hf.load_hf(str(out))
  assert cfg2 == cfg


def test_export_bf16_and_source_files(tmp_path):
  model = _hf_model("qwen3")
  src = _save(model, tmp_path / "in")
  with open(os.path.join(src, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [7, 9]}, f)
  cfg, params = hf.load_hf(src)
  hf.save_hf(cfg, params, str(tmp_path / "out"), dtype="bfloat16", source_dir=src)
  assert os.path.exists(tmp_path / "out" / "generation_config.json")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
  assert reloaded.dtype == torch.bfloat16
  cfg_bf16, _ = hf.load_hf(str(tmp_path / "out"))
  assert cfg_bf16 == cfg


def test_export_rejects_inexpressible_config():
  cfg = hf.config_from_hf(CASES_AS_HF("llama_gqa4"))
  with pytest.raises(ValueError, match="Gemma2ForCausalLM cannot express .*norm_plus_one"):
    hf.config_to_hf(cfg, architecture="Gemma2ForCausalLM")
  with pytest.raises(ValueError, match="Unsupported architecture 'MistralForCausalLM'"):
    hf.config_to_hf(cfg, architecture="MistralForCausalLM")


def CASES_AS_HF(name):  # pylint: disable=invalid-name
  """The config.json dict transformers writes for a case."""
  cls, kw = CASES[name]
  return getattr(transformers, cls)(**{**COMMON, **kw}).to_dict()


# Init scales at which these random models do not just repeat one token.
@pytest.mark.parametrize("name,init", [("llama_gqa4", 0.1), ("gemma3", 0.05)])
def test_greedy_generation_matches_transformers(name, init, tmp_path):
  """rlx dense sampler (greedy) == transformers generate(do_sample=False), 32 new tokens."""
  model = _hf_model(name, initializer_range=init)
  cfg, params = hf.load_hf(_save(model, tmp_path / name))
  tokens, valid, _ = _inputs(seed=1)
  tokens = tokens[:, :12]  # prompt + 32 new tokens crosses gemma3's window of 6 many times
  valid = valid[:, :12]
  with torch.no_grad():
    want = model.generate(input_ids=torch.tensor(tokens),
                          attention_mask=torch.tensor(valid.astype(int)), do_sample=False,
                          max_new_tokens=32, min_new_tokens=32, eos_token_id=None,
                          pad_token_id=0)[:, tokens.shape[1]:].numpy()
  sp = SamplingParams(max_new_tokens=32, temperature=0.0, eos_id=-1)  # no stop token
  out = dense.generate(transformer.graphdef_for(cfg), params, jnp.asarray(tokens),
                       jnp.asarray(valid.sum(1), jnp.int32), jax.random.split(
                           jax.random.key(0), 2), params_cfg=sp)
  np.testing.assert_array_equal(np.asarray(out.tokens), want)
  assert min(len(set(row.tolist())) for row in want) > 3  # not a constant sequence


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
  return _save(_hf_model("llama_gqa4"), tmp_path_factory.mktemp("good") / "llama")


def _copy(src, dst):
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copytree(src, dst)
  return str(dst)


def test_missing_directory_and_files(tmp_path, good_dir):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf.load_hf(str(tmp_path / "nope"))
  d = _copy(good_dir, tmp_path / "noconfig")
  os.remove(os.path.join(d, "config.json"))
  with pytest.raises(FileNotFoundError, match="has no config.json"):
    hf.load_hf(d)
  d = _copy(good_dir, tmp_path / "noweights")
  os.remove(os.path.join(d, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
    hf.load_hf(d)
  with open(os.path.join(d, "pytorch_model.bin"), "wb") as f:
    f.write(b"not read")
  with pytest.raises(ValueError, match=r"pickle weights .*pytorch_model.bin.*safe_serialization"):
    hf.load_hf(d)


def test_unsupported_architecture(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "arch")
  with open(os.path.join(d, "config.json")) as f:
    config = json.load(f)
  config["architectures"] = ["MixtralForCausalLM"]
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=r"Unsupported architecture \['MixtralForCausalLM'\]; "
                     r"supported architectures are .*'Gemma3ForCausalLM'.*'LlamaForCausalLM'"):
    hf.load_hf(d)


def _rewrite(path, mutate):
  """Rewrites a safetensors file after mutate(dict name -> array)."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(path)
  mutate(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def test_wrong_shape_names_tensor(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "shape")
  name = "model.layers.1.mlp.up_proj.weight"
  _rewrite(os.path.join(d, "model.safetensors"),
           lambda t: t.__setitem__(name, np.zeros((95, 64), np.float32)))
  with pytest.raises(ValueError, match=rf"Tensor '{name}' .* shape \[95, 64\].* \[96, 64\]"):
    hf.load_hf(d)


def test_truncated_file(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "trunc")
  path = os.path.join(d, "model.safetensors")
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(size - 1000)
  with pytest.raises(ValueError, match="is truncated: its header describes"):
    hf.load_hf(d)
  with open(path, "r+b") as f:
    f.truncate(100)
  with pytest.raises(ValueError, match="truncated or not a safetensors file"):
    hf.load_hf(d)


def test_missing_and_unexpected_tensors(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "missing")
  _rewrite(os.path.join(d, "model.safetensors"),
           lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
  with pytest.raises(ValueError, match=r"does not match .*missing tensors "
                     r"\['model.layers.1.self_attn.k_proj.weight'\]"):
    hf.load_hf(d)
  d = _copy(good_dir, tmp_path / "extra")
  _rewrite(os.path.join(d, "model.safetensors"),
           lambda t: t.__setitem__("model.layers.2.mlp.up_proj.weight", np.zeros(3, np.float32)))
  with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.2.mlp.up_proj.weight'\]"):
    hf.load_hf(d)


def test_bad_rope_and_dtype(tmp_path):
  with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
    hf.config_from_hf({**CASES_AS_HF("llama_gqa4"),
                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
  with pytest.raises(ValueError, match="dtype='float8'"):
    hf.load_hf(str(tmp_path), dtype="float8")


def _one_line_error(exc_info, *must_contain):
  msg = str(exc_info.value)
  assert "\n" not in msg, msg
  for text in must_contain:
    assert text in msg, msg
  return msg


@pytest.mark.parametrize("change,pattern", [
    (lambda c: "{\n  \"vocab_size\": 128,\n  \"hidden_size\": }",
     r"config.json is not valid JSON \(line 3 column 18: Expecting value\)"),
    (lambda c: json.dumps([c]), r"config.json holds a JSON list, expected an object"),
    (lambda c: json.dumps({**c, "num_attention_heads": 0}),
     r"config.json \(LlamaForCausalLM\): num_attention_heads=0, expected a positive integer"),
    (lambda c: json.dumps({**c, "intermediate_size": -96}),
     r"intermediate_size=-96, expected a positive integer"),
    (lambda c: json.dumps({**c, "num_key_value_heads": 3}),
     r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}),
     r"config.json \(LlamaForCausalLM\) has no 'hidden_size'"),
    (lambda c: json.dumps({**c, "rms_norm_eps": "tiny"}),
     r"rms_norm_eps='tiny', expected a positive number"),
    # transformers 4's layout (top-level rope_theta, no rope_parameters)
    (lambda c: json.dumps({**{k: v for k, v in c.items() if k != "rope_parameters"},
                           "rope_scaling": None, "rope_theta": -10000.0}),
     r"config.json \(LlamaForCausalLM\): rope_theta=-10000.0, expected a positive number"),
    (lambda c: json.dumps({**c, "rope_scaling": None,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 0}}),
     r"config.json \(LlamaForCausalLM\): rope_theta=0, expected a positive number"),
], ids=["invalid_json", "list", "zero_heads", "negative_mlp", "heads_not_dividing",
        "missing_key", "eps_string", "negative_rope_theta", "zero_rope_theta_v5"])
def test_bad_config_json_names_file_and_key(tmp_path, good_dir, change, pattern):
  d = _copy(good_dir, tmp_path / "cfg")
  path = os.path.join(d, "config.json")
  with open(path) as f:
    config = json.load(f)
  with open(path, "w") as f:
    f.write(change(config))
  with pytest.raises(ValueError, match=pattern) as e:
    hf.load_hf(d)
  _one_line_error(e, path)


def test_model_config_rejects_non_positive_sizes():
  base = dict(vocab_size=8, num_layers=1, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4,
              mlp_dim=8)
  for field, value, pattern in [("max_position", 0, "positive int"),
                                ("num_layers", True, "positive int"),
                                ("norm_eps", 0.0, "positive number"),
                                ("rope_theta", -1.0, "positive number"),
                                ("final_logit_softcap", 0.0, "positive number or None")]:
    with pytest.raises(ValueError, match=rf"ModelConfig: {field}={value!r}, expected a {pattern}"):
      ModelConfig(**{**base, field: value})


# A valid two-tensor file: 'a' F32[2, 3] at [0, 24), 'b' F32[4] at [24, 40).
_A = np.arange(6, dtype=np.float32).reshape(2, 3)
_B = np.arange(10, 14, dtype=np.float32)
_HEADER = {"__metadata__": {"format": "pt"},
           "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}


def _write_safetensors(path, header, data=_A.tobytes() + _B.tobytes()):
  raw = header if isinstance(header, bytes) else json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    f.write(data)
  return str(path)


def _tensor(header, name, **entry):
  return {**header, name: {**header[name], **entry}}


def _read(path, info):
  with open(path, "rb") as f:
    return hf._read_rows(f, info, 0, info.shape[0])  # pylint: disable=protected-access


def test_safetensors_reader_valid_and_out_of_order(tmp_path):
  """Our reader agrees with the safetensors library; entries listed out of offset order are
  fine as long as, sorted by start, they tile the data section."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  path = _write_safetensors(tmp_path / "ok.safetensors", _HEADER)
  infos = hf._read_header(path)  # pylint: disable=protected-access
  np.testing.assert_array_equal(_read(path, infos["a"]), _A)
  np.testing.assert_array_equal(_read(path, infos["b"]), load_file(path)["b"])
  swapped = {"b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
             "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [16, 40]}}
  path = _write_safetensors(tmp_path / "swapped.safetensors", swapped,
                            _B.tobytes() + _A.tobytes())
  infos = hf._read_header(path)  # pylint: disable=protected-access
  np.testing.assert_array_equal(_read(path, infos["a"]), _A)
  np.testing.assert_array_equal(_read(path, infos["b"]), _B)
  np.testing.assert_array_equal(load_file(path)["a"], _A)  # the library accepts it too


_DATA = _A.tobytes() + _B.tobytes()
BAD_SAFETENSORS = {
    "negative_offset": (_tensor(_HEADER, "a", data_offsets=[-8, 16]), _DATA,
                        r"Tensor 'a' in .* has data_offsets \[-8, 16\], expected \[begin, end\] "
                        r"with 0 <= begin <= end"),
    "end_before_begin": (_tensor(_HEADER, "b", data_offsets=[40, 24]), _DATA,
                         r"Tensor 'b' .* data_offsets \[40, 24\], expected \[begin, end\]"),
    "overlap": (_tensor(_HEADER, "b", data_offsets=[16, 32]), _DATA,
                r"Tensor 'b' in .*: data_offsets \[16, 32\] overlap tensor 'a' at \[0, 24\]; "
                r"expected the tensors to tile"),
    "gap": (_tensor(_HEADER, "b", data_offsets=[32, 48]), _DATA + bytes(8),
            r"Tensor 'b' in .*: data_offsets \[32, 48\] leave a gap of 8 bytes after tensor 'a'"),
    "gap_before_first": (
        {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}}, bytes(32),
        r"Tensor 'a' .* leave a gap of 8 bytes after the header"),
    "out_of_bounds": (_tensor(_HEADER, "b", data_offsets=[1000, 1016]), _DATA,
                      r"is truncated: .*tensor 'b' has data_offsets \[1000, 1016\], past the "
                      r"40-byte data section"),
    "trailing_bytes": (_HEADER, _DATA + bytes(16),
                       r"has 16 bytes after its last tensor; expected the tensors to fill"),
    "wrong_byte_count": (_tensor(_HEADER, "a", shape=[2, 2]), _DATA,
                         r"Tensor 'a' in .*: data_offsets \[0, 24\] hold 24 bytes, but "
                         r"F32\[2, 2\] needs 16"),
    "negative_dim": (_tensor(_HEADER, "a", shape=[-2, -3]), _DATA,
                     r"Tensor 'a' .* has shape \[-2, -3\], expected a list of non-negative "
                     r"integers"),
    "unknown_dtype": (_tensor(_HEADER, "a", dtype="F42"), _DATA,
                      r"Tensor 'a' in .* has dtype 'F42'; safetensors dtypes are \[.*'BF16'"),
    "no_shape": ({**_HEADER, "a": {"dtype": "F32", "data_offsets": [0, 24]}}, _DATA,
                 r"Tensor 'a' in .* has no 'shape' in the safetensors header"),
    "entry_not_object": ({**_HEADER, "a": [0, 24]}, _DATA,
                         r"Tensor 'a' in .* is described by a JSON list, expected an object"),
    "header_is_list": ([_HEADER["a"]], _DATA,
                       r"has a corrupt safetensors header: it is a JSON list, expected an "
                       r"object"),
    "not_utf8": (b'{"a\xff": {}}', _DATA,
                 r"has a corrupt safetensors header: it is not UTF-8 \(byte 3"),
    "not_json": (b'{"a": {"dtype": }', _DATA,
                 r"has a corrupt safetensors header: not valid JSON \(line 1 column 17"),
    "duplicate_key": (b'{"a": {}, "a": {}}', _DATA,
                      r"corrupt safetensors header: key 'a' appears twice"),
}


@pytest.mark.parametrize("name", list(BAD_SAFETENSORS))
def test_bad_safetensors_header(tmp_path, name):
  header, data, pattern = BAD_SAFETENSORS[name]
  path = _write_safetensors(tmp_path / "bad.safetensors", header, data)
  with pytest.raises(ValueError, match=pattern) as e:
    hf._read_header(path)  # pylint: disable=protected-access
  _one_line_error(e, path)


def test_header_length_past_end_of_file(tmp_path):
  path = str(tmp_path / "long.safetensors")
  with open(path, "wb") as f:
    f.write((10**6).to_bytes(8, "little") + b"{}")
  with pytest.raises(ValueError, match=r"header length 1000000 does not fit in the file's 10 "
                     "bytes") as e:
    hf._read_header(path)  # pylint: disable=protected-access
  _one_line_error(e, path)


def test_bad_offsets_caught_before_any_tensor_is_read(tmp_path, good_dir, monkeypatch):
  """A negative offset once read the JSON header's bytes as weights; now load_hf stops at the
  header, before reading anything."""
  d = _copy(good_dir, tmp_path / "neg")
  path = os.path.join(d, "model.safetensors")
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
    data = f.read()
  name = "model.layers.1.mlp.up_proj.weight"
  begin, end = header[name]["data_offsets"]
  header[name]["data_offsets"] = [-n, end - begin - n]  # would start at the header's first byte
  _write_safetensors(path, header, data)
  read = []
  monkeypatch.setattr(hf, "_read_rows", lambda *a: read.append(a))
  with pytest.raises(ValueError, match=rf"Tensor '{name}' in .*model.safetensors has "
                     r"data_offsets \[-\d+, \d+\]") as e:
    hf.load_hf(d)
  _one_line_error(e, path)
  assert not read


def test_sharded_index_errors(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "index")
  index = os.path.join(d, "model.safetensors.index.json")
  with open(index, "w") as f:
    f.write("{\"weight_map\": [}")
  with pytest.raises(ValueError, match=r"index.json is not valid JSON \(line 1 column 17: "
                     r"Expecting value\)"):
    hf.load_hf(d)
  with open(index, "w") as f:
    json.dump({"weight_map": {"model.norm.weight": "../../etc/passwd"}}, f)
  with pytest.raises(ValueError, match=r"maps tensor 'model.norm.weight' to '../../etc/passwd', "
                     "expected a file name in"):
    hf.load_hf(d)


# ----------------------------------------------------------------------------- sharding, memory


def _run(code, env_extra=None, timeout=120):
  env = {**os.environ, **(env_extra or {})}
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_load_onto_mesh(tmp_path, good_dir):
  """With a mesh, params come back sharded by rlx.sharding's rules and equal the unsharded,
  through both the one-shot and the row-block paths."""
  cfg, ref = hf.load_hf(good_dir)
  np.save(tmp_path / "up.npy", np.asarray(ref["layer_0"]["mlp"]["up_proj"]))
  out = _run(f"""
      import jax, numpy as np
      jax.config.update("jax_num_cpu_devices", 4)
      from rlx import sharding
      from rlx.model import hf
      mesh = sharding.make_mesh(data=1, fsdp=4)
      cfg, p = hf.load_hf({good_dir!r}, mesh=mesh)
      up = p["layer_0"]["mlp"]["up_proj"]
      np.testing.assert_array_equal(np.asarray(up), np.load({str(tmp_path / 'up.npy')!r}))
      hf._CHUNK_BYTES = 4096  # every matrix through the donated row-block path, sharded
      _, p2 = hf.load_hf({good_dir!r}, mesh=mesh)
      for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      print(up.sharding.spec, p["embedding"].sharding.spec, len(up.addressable_shards))
  """)
  assert out.split() == ["P('fsdp',", "'tensor')"] * 2 + ["4"], out


def test_load_memory_small(tmp_path):
  """Loading a ~20 MB checkpoint raises peak RSS by at most 1.3x its size + 8 MiB.

  The allowance is the loader's fixed cost over an idle JAX process, measured at 3.3 MiB
  (+-0.2, five runs): parsing headers, the model's abstract evaluation, Python and malloc
  bookkeeping. It is small enough that a loader holding the whole checkpoint on the host
  next to the device arrays (~2x) fails. experiments/benchmarks/load_memory.py shows the same
  bound at 0.5B params, where the row-block path for big tensors is exercised.
  """
  script = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "benchmarks",
                        "load_memory.py")
  out = _run(f"""
      import runpy, sys
      sys.argv = ["load_memory", "--params=5e6", "--dir={tmp_path}", "--json"]
      runpy.run_path({script!r}, run_name="__main__")
  """, timeout=240)
  result = json.loads(out.strip().splitlines()[-1])
  assert 15e6 < result["checkpoint_bytes"] < 30e6
  assert result["rss_increase_bytes"] <= 1.3 * result["checkpoint_bytes"] + 8 * 2**20, result
