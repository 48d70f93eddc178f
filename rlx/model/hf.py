"""Hugging Face checkpoints in and out: config.json + safetensors (never pickle).

  cfg, params = load_hf("/ckpt/Qwen2.5-0.5B-Instruct", dtype="float32", mesh=mesh)
  save_hf(cfg, params, "/out/my-model", dtype="bfloat16", source_dir="/ckpt/Qwen2.5-0.5B-Instruct")

LoRA runs (rlx.model.lora): `save_hf(cfg, base, out, adapters=adapters, lora_cfg=lora_cfg)` writes
the merged model (W + alpha/r * A @ B); `save_peft_adapter(cfg, adapters, lora_cfg, out,
base_model_name_or_path=...)` writes a PEFT adapter directory that `peft.PeftModel` loads onto
the base.

Supported architectures: Llama (1-3.x, incl. llama3 rope scaling), Qwen2/2.5, Qwen3 (dense),
Gemma, Gemma 2, Gemma 3 text (`Gemma3ForCausalLM`, and the language model inside
`Gemma3ForConditionalGeneration`; the vision tower is skipped).

Loading reads one tensor at a time with a small safetensors reader of our own (the format is
an 8-byte header length, a JSON header and raw little-endian data): bf16 needs no torch, a
truncated file is caught from its header before anything is read, and host memory stays near
one tensor. Tensors above `_CHUNK_BYTES` are streamed in row blocks into a donated device
buffer, so even a 600 MB embedding never exists twice on the host. Writing streams the same
way (one tensor on the host at a time), with an index file when the checkpoint is sharded.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import re
import shutil
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding

from rlx import sharding as sharding_lib
from rlx.model import lora as lora_lib
from rlx.model import transformer
from rlx.model.config import DTYPES, ModelConfig

Params = dict[str, Any]

# architecture -> family; the family decides the config mapping and the tensor names.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
_EXPORT_ARCHITECTURE = {  # family -> (architecture, model_type) written by save_hf
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}

# Hugging Face config-class defaults (identical in transformers 4.5x and 5.x) for keys that
# real config.json files sometimes omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                  max_position_embeddings=2048, hidden_act="silu"),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                  max_position_embeddings=32768, hidden_act="silu"),
    "qwen3": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                  max_position_embeddings=32768, hidden_act="silu", head_dim=128),
    "gemma": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=True,
                  max_position_embeddings=8192, hidden_act="gelu_pytorch_tanh", head_dim=256),
    "gemma2": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=True,
                   max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh",
                   head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # Gemma3ForConditionalGeneration's text_config lists only what differs from these.
    "gemma3": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0, tie_word_embeddings=True,
                   max_position_embeddings=131_072, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                   attn_logit_softcapping=None, final_logit_softcapping=None),
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Files that describe the tokenizer / generation defaults, copied by save_hf(source_dir=...).
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "generation_config.json", "chat_template.jinja",
               "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json")

# Every dtype of the safetensors format, with its item size; rlx loads the float ones.
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
              "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_CHUNK_BYTES = 32 * 2**20  # tensors above this are streamed in row blocks
_MAX_HEADER_BYTES = 100 * 2**20


# ============================================================================= config mapping


def _family_of(hf: Mapping[str, Any], where: str = "config.json") -> tuple[str, str]:
  archs = hf.get("architectures") or []
  if not isinstance(archs, list):
    raise ValueError(f"{where}: architectures={archs!r}, expected a list of class names.")
  for arch in archs:
    if arch in ARCHITECTURES:
      return arch, ARCHITECTURES[arch]
  model_type = hf.get("model_type")
  if not archs and model_type in _MODEL_TYPES:
    family = _MODEL_TYPES[model_type]
    return _EXPORT_ARCHITECTURE[family][0], family
  got = archs or [f"model_type={model_type!r}"]
  raise ValueError(f"{where}: Unsupported architecture {got}; supported architectures are "
                   f"{sorted(ARCHITECTURES)}.")


def _positive(value: Any, key: str, where: str, kind: type = int) -> Any:
  """value if it is a positive int (kind=int) or number (kind=float), else one-line ValueError."""
  ok = (not isinstance(value, bool) and isinstance(value, (int,) if kind is int else (int, float))
        and value > 0 and (kind is int or math.isfinite(value)))
  if not ok:
    what = "a positive integer" if kind is int else "a positive number"
    raise ValueError(f"{where}: {key}={value!r}, expected {what}.")
  return kind(value)


def _rope(params: Mapping[str, Any] | None, theta_default: float, where: str) -> dict[str, Any]:
  """A Hugging Face rope dict (new `rope_parameters` or old `rope_scaling`) -> ModelConfig fields."""
  if params is not None and not isinstance(params, Mapping):
    raise ValueError(f"{where}: rope parameters {params!r}, expected an object.")
  params = dict(params or {})
  rope_type = params.get("rope_type", params.get("type", "default")) or "default"

  def get(key, kind=float):
    if key not in params:
      raise ValueError(f"{where}: rope type {rope_type!r} needs {key!r}.")
    return _positive(params[key], key, where, kind)

  out: dict[str, Any] = {"rope_theta": _positive(params.get("rope_theta", theta_default),
                                                 "rope_theta", where, float)}
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{where}: partial_rotary_factor={params['partial_rotary_factor']} is not "
                     "supported (rlx rotates the whole head).")
  if rope_type == "default":
    out["rope_scaling"] = "none"
  elif rope_type == "linear":
    out.update(rope_scaling="linear", rope_scaling_factor=get("factor"))
  elif rope_type == "llama3":
    out.update(rope_scaling="llama3", rope_scaling_factor=get("factor"),
               rope_low_freq_factor=get("low_freq_factor"),
               rope_high_freq_factor=get("high_freq_factor"),
               rope_original_max_position=get("original_max_position_embeddings", int))
  else:
    raise ValueError(f"{where}: rope type {rope_type!r} is not supported; supported rope types "
                     "are 'default', 'linear' and 'llama3'.")
  return out


def _layer_types(family: str, c: Mapping[str, Any], num_layers: int,
                 where: str) -> tuple[str, ...]:
  """Per-layer 'sliding' / 'global', following each family's Hugging Face rule."""
  if family in ("llama", "gemma"):
    return ()
  if family in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
    return ()
  if c.get("sliding_window") is None:
    return ()
  hf_types = c.get("layer_types")
  if hf_types is None:
    if family == "gemma2":  # even layers slide
      hf_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                  for i in range(num_layers)]
    elif family == "gemma3":
      pattern = _positive(c.get("sliding_window_pattern", 6), "sliding_window_pattern", where)
      hf_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                  for i in range(num_layers)]
    else:  # qwen: layers from max_window_layers on slide
      first = c.get("max_window_layers", num_layers)
      if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{where}: max_window_layers={first!r}, expected a non-negative "
                         "integer.")
      hf_types = ["sliding_attention" if i >= first else "full_attention"
                  for i in range(num_layers)]
  names = {"sliding_attention": "sliding", "full_attention": "global"}
  if (not isinstance(hf_types, list) or len(hf_types) != num_layers
      or any(t not in names for t in hf_types)):
    raise ValueError(f"{where}: layer_types={hf_types!r}, expected a list of {num_layers} "
                     "entries of 'sliding_attention' / 'full_attention'.")
  types = tuple(names[t] for t in hf_types)
  return types if "sliding" in types else ()


class _ConfigFile(dict):
  """config.json contents that remember their path, so that errors can name the file."""

  def __init__(self, path: str, data: Mapping[str, Any]):
    super().__init__(data)
    self.path = path


def config_from_hf(hf_config: Mapping[str, Any], *, dtype: str = "float32",
                   param_dtype: str | None = None, where: str | None = None) -> ModelConfig:
  """Maps a Hugging Face config.json dict (transformers 4.5x or 5.x) to a ModelConfig.

  where: the file named in errors (default: the path `read_config` read it from).
  """
  where = where or getattr(hf_config, "path", None) or "config.json"
  if not isinstance(hf_config, Mapping):
    raise ValueError(f"{where} holds a JSON {_json_type(hf_config)}, expected an object.")
  arch, family = _family_of(hf_config, where)
  c = dict(hf_config)
  if arch == "Gemma3ForConditionalGeneration" or (
      family == "gemma3" and "text_config" in c and "hidden_size" not in c):
    text = c.get("text_config") or {}
    if not isinstance(text, Mapping):
      raise ValueError(f"{where}: text_config holds a JSON {_json_type(text)}, expected an "
                       "object.")
    text = dict(text)
    text.setdefault("tie_word_embeddings", c.get("tie_word_embeddings", True))
    c = text
  c = {**_DEFAULTS[family], **{k: v for k, v in c.items() if v is not None or k in (
      "sliding_window", "attn_logit_softcapping", "final_logit_softcapping")}}
  here = f"{where} ({arch})"

  def need(key):
    if key not in c:
      raise ValueError(f"{here} has no {key!r}.")
    return c[key]

  def size(key):
    return _positive(need(key), key, here)

  def number(key):  # a positive float, or None where the key is unset / null / 0
    return _positive(c[key], key, here, float) if c.get(key) else None

  if c.get("use_bidirectional_attention"):
    raise ValueError(f"{here}: use_bidirectional_attention=True is not supported "
                     "(rlx models are causal).")
  if c.get("mlp_bias") or (family in ("llama", "qwen3", "gemma", "gemma2", "gemma3")
                           and c.get("attention_bias")):
    raise ValueError(f"{here}: attention_bias / mlp_bias are not supported "
                     "(rlx has q/k/v biases only, as in Qwen2).")
  act_key = "hidden_activation" if family in ("gemma2", "gemma3") else "hidden_act"
  act = c.get(act_key) or c.get("hidden_act")
  if family == "gemma" and act == "gelu":  # old Gemma configs; HF means the tanh approximation
    act = "gelu_pytorch_tanh"
  if not isinstance(act, str) or act not in _ACTIVATIONS:
    raise ValueError(f"{here}: {act_key}={act!r} is not supported; supported "
                     f"activations are {sorted(_ACTIVATIONS)}.")

  vocab_size = size("vocab_size")
  num_layers = size("num_hidden_layers")
  num_heads = size("num_attention_heads")
  d_model = size("hidden_size")
  mlp_dim = size("intermediate_size")
  max_position = size("max_position_embeddings")
  num_kv_heads = c.get("num_key_value_heads")
  num_kv_heads = num_heads if num_kv_heads is None else size("num_key_value_heads")
  if num_heads % num_kv_heads:
    raise ValueError(f"{here}: num_attention_heads={num_heads} is not a multiple of "
                     f"num_key_value_heads={num_kv_heads}.")
  if c.get("head_dim") in (None, 0):  # as transformers: head_dim or hidden_size // heads
    if d_model % num_heads:
      raise ValueError(f"{here}: hidden_size={d_model} is not a multiple of "
                       f"num_attention_heads={num_heads}, and there is no head_dim.")
    head_dim = d_model // num_heads
  else:
    head_dim = size("head_dim")
  norm_eps = _positive(c["rms_norm_eps"], "rms_norm_eps", here, float)
  layer_types = _layer_types(family, c, num_layers, here)

  # Rope: transformers 5 writes `rope_parameters` (nested per layer type for Gemma 3);
  # older files have top-level rope_theta / rope_scaling / rope_local_base_freq.
  rp = c.get("rope_parameters")
  if rp is not None and not isinstance(rp, Mapping):
    raise ValueError(f"{here}: rope_parameters holds a JSON {_json_type(rp)}, expected an "
                     "object.")
  rope_local_theta = None
  if family == "gemma3":
    rp = rp or {}
    full = rp.get("full_attention") if "full_attention" in rp else (
        rp or c.get("rope_scaling"))
    rope = _rope(full, c["rope_theta"], f"{here} full_attention rope")
    local = _rope(rp.get("sliding_attention") or {}, c["rope_local_base_freq"],
                  f"{here} sliding_attention rope")
    if local["rope_scaling"] != "none":
      raise ValueError(f"{here}: rope scaling on sliding layers is not supported.")
    rope_local_theta = local["rope_theta"]
  else:
    rope = _rope(rp if rp else c.get("rope_scaling"), c["rope_theta"], here)

  is_gemma = family.startswith("gemma")
  qpas = number("query_pre_attn_scalar") if family in ("gemma2", "gemma3") else None
  attn_softcap = number("attn_logit_softcapping")
  final_softcap = number("final_logit_softcapping")
  sliding_window = size("sliding_window") if layer_types else None
  try:
    return ModelConfig(
        vocab_size=vocab_size,
        num_layers=num_layers,
        d_model=d_model,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        mlp_dim=mlp_dim,
        activation=_ACTIVATIONS[act],
        norm_eps=norm_eps,
        norm_plus_one=is_gemma,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "gemma3"),
        post_attn_norm=family in ("gemma2", "gemma3"),
        post_mlp_norm=family in ("gemma2", "gemma3"),
        tie_embeddings=bool(c["tie_word_embeddings"]),
        embed_scale=is_gemma,
        query_pre_attn_scalar=qpas,
        attn_logit_softcap=attn_softcap,
        final_logit_softcap=final_softcap,
        sliding_window=sliding_window,
        layer_types=layer_types,
        rope_local_theta=rope_local_theta if layer_types else None,
        max_position=max_position,
        dtype=dtype,
        param_dtype=param_dtype or dtype,
        **rope,
    )
  except ValueError as e:  # what the checks above do not catch; say which file it came from
    raise ValueError(f"{here}: {e}") from e


def infer_family(cfg: ModelConfig) -> str:
  """The Hugging Face family whose switches match cfg (used when exporting)."""
  if cfg.norm_plus_one:
    if cfg.post_attn_norm or cfg.post_mlp_norm:
      return "gemma3" if cfg.qk_norm else "gemma2"
    return "gemma"
  if cfg.qkv_bias:
    return "qwen2"
  if cfg.qk_norm:
    return "qwen3"
  return "llama"


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  out: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling == "linear":
    out.update(rope_type="linear", factor=cfg.rope_scaling_factor)
  elif cfg.rope_scaling == "llama3":
    out.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
               low_freq_factor=cfg.rope_low_freq_factor,
               high_freq_factor=cfg.rope_high_freq_factor,
               original_max_position_embeddings=cfg.rope_original_max_position)
  return out


def config_to_hf(cfg: ModelConfig, architecture: str | None = None,
                 dtype: str | None = None) -> dict[str, Any]:
  """ModelConfig -> config.json dict that transformers 5 (and 4.5x) loads unchanged.

  Raises ValueError when the architecture cannot express cfg (checked by mapping back).
  """
  if architecture is None:
    family = infer_family(cfg)
    architecture = _EXPORT_ARCHITECTURE[family][0]
  elif architecture not in ARCHITECTURES:
    raise ValueError(f"Unsupported architecture {architecture!r}; supported architectures are "
                     f"{sorted(ARCHITECTURES)}.")
  family = ARCHITECTURES[architecture]
  architecture, model_type = _EXPORT_ARCHITECTURE[family]  # text-only export for Gemma 3
  dtype = dtype or cfg.param_dtype
  hf: dict[str, Any] = {
      "architectures": [architecture],
      "model_type": model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.norm_eps,
      "max_position_embeddings": cfg.max_position,
      "tie_word_embeddings": cfg.tie_embeddings,
      "dtype": dtype,
      "torch_dtype": dtype,  # transformers 4.x name
  }
  act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.activation]
  hf["hidden_activation" if family in ("gemma2", "gemma3") else "hidden_act"] = act
  if family in ("llama", "qwen3", "gemma", "gemma2", "gemma3"):
    hf["attention_bias"] = False
  if family == "llama":
    hf["mlp_bias"] = False
  hf_types = [("sliding_attention" if cfg.is_sliding(i) else "full_attention")
              for i in range(cfg.num_layers)]
  sliding = bool(cfg.layer_types) and "sliding" in cfg.layer_types
  if family in ("qwen2", "qwen3"):
    first = hf_types.index("sliding_attention") if sliding else cfg.num_layers
    hf.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window if sliding else None,
              max_window_layers=first, layer_types=hf_types)
  if family in ("gemma2", "gemma3"):
    qpas = cfg.query_pre_attn_scalar or cfg.head_dim
    hf.update(query_pre_attn_scalar=int(qpas) if float(qpas).is_integer() else qpas,  # HF: int
              attn_logit_softcapping=cfg.attn_logit_softcap,
              final_logit_softcapping=cfg.final_logit_softcap,
              sliding_window=cfg.sliding_window if sliding else None,
              layer_types=hf_types)
  rope = _rope_to_hf(cfg)
  if family == "gemma3":
    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    hf["rope_parameters"] = {"full_attention": rope,
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": local_theta}}
    hf["rope_theta"] = cfg.rope_theta  # transformers 4.x names
    hf["rope_local_base_freq"] = local_theta
    hf["rope_scaling"] = ({k: v for k, v in rope.items() if k != "rope_theta"}
                          if cfg.rope_scaling != "none" else None)
  else:
    hf["rope_parameters"] = rope
    hf["rope_theta"] = cfg.rope_theta
    hf["rope_scaling"] = ({k: v for k, v in rope.items() if k != "rope_theta"}
                          if cfg.rope_scaling != "none" else None)

  back = config_from_hf(hf, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  diff = _config_diff(_canonical(cfg), _canonical(back))
  if diff:
    raise ValueError(f"{architecture} cannot express this ModelConfig: fields {diff} would "
                     f"change on export; pass another architecture (supported: "
                     f"{sorted(_EXPORT_ARCHITECTURE[f][0] for f in _EXPORT_ARCHITECTURE)}).")
  return hf


def _canonical(cfg: ModelConfig) -> ModelConfig:
  """Drops settings that cannot affect the computation, so equal models compare equal."""
  default = ModelConfig(vocab_size=1, num_layers=1, d_model=1, num_heads=1, num_kv_heads=1,
                        head_dim=1, mlp_dim=1)
  kw: dict[str, Any] = {}
  if cfg.rope_scaling == "none":
    kw.update(rope_scaling_factor=1.0)
  if cfg.rope_scaling != "llama3":
    kw.update(rope_low_freq_factor=default.rope_low_freq_factor,
              rope_high_freq_factor=default.rope_high_freq_factor,
              rope_original_max_position=default.rope_original_max_position)
  sliding = bool(cfg.layer_types) and "sliding" in cfg.layer_types
  if not sliding:
    kw.update(layer_types=(), sliding_window=None, rope_local_theta=None)
  elif cfg.rope_local_theta == cfg.rope_theta and cfg.rope_scaling == "none":
    kw.update(rope_local_theta=None)
  if cfg.query_pre_attn_scalar == cfg.head_dim:
    kw.update(query_pre_attn_scalar=None)
  return dataclasses.replace(cfg, **kw)


def _config_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
  return [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


# ============================================================================= tensor names


def _param_paths(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
  """rlx param path ('layer_0/attn/q_proj') -> (shape, dtype) from the model itself."""
  _, abstract = transformer.abstract_params(cfg)
  return {sharding_lib.path_str(p): (tuple(x.shape), str(x.dtype))
          for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def hf_name(cfg: ModelConfig, path: str) -> tuple[str, bool]:
  """rlx param path -> (Hugging Face tensor name, whether the tensor is transposed)."""
  gemma_norms = cfg.post_attn_norm or cfg.post_mlp_norm
  if path == "embedding":
    return "model.embed_tokens.weight", False
  if path == "lm_head":
    return "lm_head.weight", True
  if path == "final_norm/scale":
    return "model.norm.weight", False
  layer, rest = path.split("/", 1)
  prefix = f"model.layers.{int(layer[len('layer_'):])}."
  table = {
      "input_norm/scale": ("input_layernorm.weight", False),
      "post_attn_norm/scale": ("post_attention_layernorm.weight", False),
      "pre_mlp_norm/scale": (("pre_feedforward_layernorm.weight" if gemma_norms
                              else "post_attention_layernorm.weight"), False),
      "post_mlp_norm/scale": ("post_feedforward_layernorm.weight", False),
      "attn/q_norm/scale": ("self_attn.q_norm.weight", False),
      "attn/k_norm/scale": ("self_attn.k_norm.weight", False),
  }
  if rest in table:
    name, transposed = table[rest]
    return prefix + name, transposed
  module, leaf = rest.split("/")
  hf_module = {"attn": "self_attn", "mlp": "mlp"}[module]
  if leaf.endswith("_bias"):
    return f"{prefix}{hf_module}.{leaf[:-len('_bias')]}_proj.bias", False
  return f"{prefix}{hf_module}.{leaf}.weight", True


def _normalize_name(name: str) -> str | None:
  """Checkpoint tensor name -> canonical causal-LM name; None for tensors rlx ignores."""
  for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head.")):
    if name.startswith(old):
      return new + name[len(old):]
  if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector.")):
    return None  # Gemma 3 multimodal: text only
  if name.endswith("rotary_emb.inv_freq"):
    return None  # a buffer some old checkpoints saved
  return name


# ============================================================================= safetensors io


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
  file: str
  dtype: str  # safetensors name: "BF16", "F32", ...
  shape: tuple[int, ...]
  offset: int  # absolute byte offset in the file
  nbytes: int

  @property
  def np_dtype(self) -> np.dtype:
    return _ST_DTYPES[self.dtype]


def _no_duplicate_keys(pairs):
  out = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f"key {key!r} appears twice")
    out[key] = value
  return out


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _read_header(path: str) -> dict[str, _TensorInfo]:
  """Parses and checks a safetensors header; reads no tensor data.

  Checks what the format requires: a JSON object of {dtype, shape, data_offsets} entries
  whose byte ranges, sorted by start, tile the data section exactly (no gap, no overlap,
  nothing past the end), each holding prod(shape) * itemsize bytes.
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise ValueError(f"Checkpoint file {path} is truncated ({size} bytes): no safetensors header.")
    n = int.from_bytes(raw, "little")
    if n > min(size - 8, _MAX_HEADER_BYTES):
      raise ValueError(f"Checkpoint file {path} is truncated or not a safetensors file: header "
                       f"length {n} does not fit in the file's {size} bytes.")
    raw = f.read(n)
  bad = f"Checkpoint file {path} has a corrupt safetensors header"
  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
  except UnicodeDecodeError as e:
    raise ValueError(f"{bad}: it is not UTF-8 (byte {e.start}: {e.reason}).") from e
  except json.JSONDecodeError as e:
    raise ValueError(f"{bad}: not valid JSON (line {e.lineno} column {e.colno}: "
                     f"{e.msg}).") from e
  except ValueError as e:  # a duplicate key
    raise ValueError(f"{bad}: {e}.") from e
  if not isinstance(header, dict):
    raise ValueError(f"{bad}: it is a JSON {_json_type(header)}, expected an object.")
  metadata = header.pop("__metadata__", None)
  if metadata is not None and not isinstance(metadata, dict):
    raise ValueError(f"{bad}: __metadata__ is a JSON {_json_type(metadata)}, expected an "
                     "object.")
  data_size = size - 8 - n
  spans = []  # (begin, end, name)
  for name, meta in header.items():
    where = f"Tensor {name!r} in {path}"
    if not isinstance(meta, dict):
      raise ValueError(f"{where} is described by a JSON {_json_type(meta)}, expected an object "
                       "with dtype, shape and data_offsets.")
    for key in ("dtype", "shape", "data_offsets"):
      if key not in meta:
        raise ValueError(f"{where} has no {key!r} in the safetensors header.")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
      raise ValueError(f"{where} has dtype {dtype!r}; safetensors dtypes are "
                       f"{sorted(_ST_ITEMSIZE)}.")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
      raise ValueError(f"{where} has shape {shape!r}, expected a list of non-negative "
                       "integers.")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
        or offsets[0] < 0 or offsets[1] < offsets[0]):
      raise ValueError(f"{where} has data_offsets {offsets!r}, expected [begin, end] with "
                       "0 <= begin <= end.")
    begin, end = offsets
    nbytes = math.prod(shape) * _ST_ITEMSIZE[dtype]
    if end - begin != nbytes:
      raise ValueError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but "
                       f"{dtype}{shape} needs {nbytes}.")
    spans.append((begin, end, name))
  spans.sort()
  last = max(spans, key=lambda s: s[1], default=(0, 0, None))
  if last[1] > data_size:
    raise ValueError(f"Checkpoint file {path} is truncated: its header describes "
                     f"{8 + n + last[1]} bytes of data, but the file has {size} (tensor "
                     f"{last[2]!r} has data_offsets [{last[0]}, {last[1]}], past the "
                     f"{data_size}-byte data section).")
  expected, prev = 0, None
  for begin, end, name in spans:
    if begin != expected:
      what = (f"overlap tensor {prev[2]!r} at [{prev[0]}, {prev[1]}]" if begin < expected else
              f"leave a gap of {begin - expected} bytes after "
              + (f"tensor {prev[2]!r}" if prev else "the header"))
      raise ValueError(f"Tensor {name!r} in {path}: data_offsets [{begin}, {end}] {what}; "
                       "expected the tensors to tile the data section with no gap or overlap.")
    expected, prev = end, (begin, end, name)
  if expected != data_size:
    raise ValueError(f"Checkpoint file {path} has {data_size - expected} bytes after its last "
                     "tensor; expected the tensors to fill the data section exactly.")
  return {name: _TensorInfo(path, header[name]["dtype"], tuple(header[name]["shape"]),
                            8 + n + begin, end - begin) for begin, end, name in spans}


def _read_rows(f, info: _TensorInfo, start: int, stop: int) -> np.ndarray:
  """Rows [start, stop) of the tensor's leading axis, as a fresh array in the file's dtype."""
  row_elems = math.prod(info.shape[1:])
  buf = np.empty((stop - start) * row_elems * info.np_dtype.itemsize, np.uint8)
  f.seek(info.offset + start * row_elems * info.np_dtype.itemsize)
  if f.readinto(buf) != buf.size:
    raise ValueError(f"Checkpoint file {info.file} is truncated.")
  return buf.view(info.np_dtype).reshape((stop - start,) + info.shape[1:])


def _find_checkpoint(path: str) -> dict[str, _TensorInfo]:
  """All tensors of a checkpoint directory: name -> where to read it."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist.")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path!r} is a file; load_hf expects a Hugging Face model directory "
                            "(config.json + *.safetensors).")
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has weight_map={weight_map!r}, expected an object of tensor "
                       "name -> file name.")
    tensors: dict[str, _TensorInfo] = {}
    headers: dict[str, dict[str, _TensorInfo]] = {}
    for name, file in weight_map.items():
      if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
        raise ValueError(f"{index} maps tensor {name!r} to {file!r}, expected a file name in "
                         f"{path}.")
      if file not in headers:
        fpath = os.path.join(path, file)
        if not os.path.exists(fpath):
          raise FileNotFoundError(f"Shard {file!r} listed in {index} does not exist.")
        headers[file] = _read_header(fpath)
      if name not in headers[file]:
        raise ValueError(f"Tensor {name!r} is listed in {index} under {file!r}, but that file "
                         "does not contain it.")
      tensors[name] = headers[file][name]
    return tensors
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if os.path.exists(single):
    return _read_header(single)
  if len(files) == 1:
    return _read_header(files[0])
  if files:
    raise ValueError(f"{path} holds {len(files)} safetensors files but no "
                     "model.safetensors.index.json saying which tensor lives where.")
  pickles = [os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin"))
             + glob.glob(os.path.join(path, "*.pt")) + glob.glob(os.path.join(path, "*.pth"))]
  if pickles:
    raise ValueError(
        f"{path} has only PyTorch pickle weights ({sorted(pickles)}); rlx reads safetensors only "
        "and never unpickles. Convert once with transformers: AutoModelForCausalLM."
        "from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True).")
  raise FileNotFoundError(f"{path} has no model.safetensors (or sharded *.safetensors with "
                          "model.safetensors.index.json).")


def _json_type(value: Any) -> str:
  return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
          float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _read_json_object(path: str) -> dict[str, Any]:
  """A JSON file that must hold an object; one-line ValueError naming the file otherwise."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}).") from e
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON (line {e.lineno} column {e.colno}: "
                     f"{e.msg}).") from e
  if not isinstance(data, dict):
    raise ValueError(f"{path} holds a JSON {_json_type(data)}, expected an object.")
  return data


def read_config(path: str) -> dict[str, Any]:
  """The config.json of a model directory (a dict that remembers its path, for errors)."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist.")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{path} has no config.json.")
  return _ConfigFile(cfg_path, _read_json_object(cfg_path))


# ============================================================================= loading


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _update_fn(sharding):
  # Donated: the block is written in place, so the tensor is never held twice.
  return jax.jit(lambda buf, block, start: jax.lax.dynamic_update_slice(buf, block, start),
                 donate_argnums=0, out_shardings=sharding)


def _load_tensor(f, info: _TensorInfo, transposed: bool, dtype: np.dtype,
                 sharding) -> jax.Array:
  shape = info.shape[::-1] if transposed else info.shape
  rows = info.shape[0]  # every rlx parameter is a vector or a matrix
  row_bytes = math.prod(info.shape[1:]) * dtype.itemsize
  if rows * row_bytes <= _CHUNK_BYTES or len(info.shape) != 2:
    host = _read_rows(f, info, 0, rows).astype(dtype, copy=False)
    out = jax.device_put(host.T if transposed else host, sharding)
    out.block_until_ready()  # so `host` can be freed now
    return out
  buf = _zeros_fn(shape, dtype, sharding)()
  step = max(1, _CHUNK_BYTES // row_bytes)
  update = _update_fn(sharding)
  for start in range(0, rows, step):
    block = _read_rows(f, info, start, min(rows, start + step)).astype(dtype, copy=False)
    buf = update(buf, block.T if transposed else block, (0, start) if transposed else (start, 0))
    buf.block_until_ready()
  return buf


def load_hf(path: str, *, dtype: str = "float32", param_dtype: str | None = None,
            mesh: jax.sharding.Mesh | None = None, rules=None) -> tuple[ModelConfig, Params]:
  """Reads a Hugging Face model directory into (ModelConfig, params).

  dtype is the activation dtype (ModelConfig.dtype); params are stored in param_dtype
  (default: dtype). With a mesh, every parameter is placed with the sharding that
  `rlx.sharding.param_shardings(rules)` gives it; otherwise on the first device.
  """
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype or dtype)):
    if value not in DTYPES:
      raise ValueError(f"load_hf: {name}={value!r}, expected one of {tuple(DTYPES)}.")
  cfg = config_from_hf(read_config(path), dtype=dtype, param_dtype=param_dtype)
  tensors = _find_checkpoint(path)
  by_name = {}
  for name, info in tensors.items():
    canon = _normalize_name(name)
    if canon is not None:
      by_name[canon] = info
  if cfg.tie_embeddings:
    by_name.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway

  expected = _param_paths(cfg)
  names = {p: hf_name(cfg, p) for p in expected}
  missing = sorted(n for n, _ in names.values() if n not in by_name)
  unexpected = sorted(set(by_name) - {n for n, _ in names.values()})
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"missing tensors {_short(missing)}")
    if unexpected:
      parts.append(f"unexpected tensors {_short(unexpected)}")
    raise ValueError(f"Checkpoint {path} does not match its config.json "
                     f"({_family_of(read_config(path))[0]}): " + "; ".join(parts) + ".")
  for p, (shape, _) in expected.items():
    name, transposed = names[p]
    want = shape[::-1] if transposed else shape
    got = by_name[name].shape
    if got != want:
      raise ValueError(f"Tensor {name!r} in {by_name[name].file} has shape {list(got)}, but "
                       f"config.json implies {list(want)}.")
    if by_name[name].dtype not in _ST_DTYPES:
      raise ValueError(f"Tensor {name!r} in {by_name[name].file} has dtype "
                       f"{by_name[name].dtype}; rlx loads weights of dtypes {sorted(_ST_DTYPES)}.")

  if mesh is not None:
    _, abstract = transformer.abstract_params(cfg)
    shardings = {sharding_lib.path_str(k): s for k, s in jax.tree_util.tree_flatten_with_path(
        sharding_lib.param_shardings(abstract, mesh, rules or sharding_lib.DEFAULT_RULES))[0]}
  else:
    single = SingleDeviceSharding(jax.local_devices()[0])
    shardings = {p: single for p in expected}

  np_dtype = np.dtype(cfg.weight_dtype)
  flat: dict[str, jax.Array] = {}
  handles: dict[str, Any] = {}
  try:
    for p in expected:
      name, transposed = names[p]
      info = by_name[name]
      if info.file not in handles:
        handles[info.file] = open(info.file, "rb")
      flat[p] = _load_tensor(handles[info.file], info, transposed, np_dtype, shardings[p])
  finally:
    for h in handles.values():
      h.close()
  return cfg, _unflatten(flat)


def _short(names: list[str], k: int = 6) -> str:
  more = f" and {len(names) - k} more" if len(names) > k else ""
  return str(names[:k]) + more


def _unflatten(flat: Mapping[str, Any]) -> Params:
  out: Params = {}
  for path, value in flat.items():
    node = out
    *parents, leaf = path.split("/")
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value
  return out


# ============================================================================= saving


def _flatten(params: Params, prefix: str = "") -> Iterator[tuple[str, Any]]:
  for key in sorted(params):
    value = params[key]
    path = f"{prefix}{key}"
    if isinstance(value, Mapping):
      yield from _flatten(value, path + "/")
    else:
      yield path, value


def _to_host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def save_hf(cfg: ModelConfig, params: Params, out_dir: str, *, architecture: str | None = None,
            dtype: str | None = None, max_shard_bytes: int = 5 * 10**9,
            source_dir: str | None = None, adapters: Params | None = None,
            lora_cfg: lora_lib.LoRAConfig | None = None) -> None:
  """Writes config.json + safetensors that `AutoModelForCausalLM.from_pretrained` loads.

  architecture: default inferred from cfg's switches (see `infer_family`). dtype: tensor
  dtype in the files (default cfg.param_dtype). Above max_shard_bytes the weights are split
  into model-0000i-of-0000n.safetensors plus model.safetensors.index.json. source_dir: a
  Hugging Face directory whose tokenizer / generation files and token ids are carried over.
  adapters + lora_cfg (a LoRA run; params is then the frozen base): the merged model is
  written, W + lora_cfg.scale * A @ B at each adapted weight, computed in f32 on the host one
  tensor at a time (so a bf16 base loses nothing beyond its own rounding) and then cast to
  dtype. In multi-process runs every process must call this; only process 0 writes.
  """
  dtype = dtype or cfg.param_dtype
  if dtype not in DTYPES:
    raise ValueError(f"save_hf: dtype={dtype!r}, expected one of {tuple(DTYPES)}.")
  if (adapters is None) != (lora_cfg is None):
    raise ValueError("save_hf: pass adapters and lora_cfg together (a LoRA run's merged "
                     "export), or neither.")
  merged = {} if adapters is None else _check_adapters(cfg, adapters, lora_cfg, "save_hf")
  hf_cfg = config_to_hf(cfg, architecture, dtype)
  np_dtype = np.dtype(DTYPES[dtype])
  expected = _param_paths(cfg)
  flat = dict(_flatten(params))
  if set(flat) != set(expected):
    raise ValueError(f"params do not match cfg: missing {_short(sorted(set(expected) - set(flat)))}"
                     f", unexpected {_short(sorted(set(flat) - set(expected)))}.")
  entries = []  # (hf name, rlx path, transposed, hf shape)
  for p, (shape, _) in expected.items():
    if tuple(flat[p].shape) != shape:
      raise ValueError(f"param {p!r} has shape {list(flat[p].shape)}, cfg implies {list(shape)}.")
    name, transposed = hf_name(cfg, p)
    entries.append((name, p, transposed, shape[::-1] if transposed else shape))
  entries.sort()

  writer = jax.process_index() == 0
  if writer:
    os.makedirs(out_dir, exist_ok=True)
    if source_dir is not None and os.path.abspath(source_dir) != os.path.abspath(out_dir):
      src_cfg = read_config(source_dir)
      for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in src_cfg:
          hf_cfg[key] = src_cfg[key]
      for name in _SIDE_FILES:
        if os.path.exists(os.path.join(source_dir, name)):
          shutil.copyfile(os.path.join(source_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2, sort_keys=True)
  paths = {name: (p, transposed) for name, p, transposed, _ in entries}

  def fetch(name):
    p, transposed = paths[name]
    host = _to_host(flat[p])  # every process takes part in the gather
    if p in merged:
      a, b = merged[p]
      delta = np.matmul(_to_host(a).astype(np.float32), _to_host(b).astype(np.float32))
      host = host.astype(np.float32) + np.float32(lora_cfg.scale) * delta
    return host.T if transposed else host

  write_safetensors(out_dir, [(e[0], e[3]) for e in entries], fetch, dtype=np_dtype,
                    max_shard_bytes=max_shard_bytes, write=writer)


# ============================================================================= LoRA / PEFT

_ADAPTABLE = lora_lib.PROJECTIONS + ("lm_head",)


def _check_adapters(cfg: ModelConfig, adapters: Params, lora_cfg: lora_lib.LoRAConfig,
                    where: str) -> dict[str, tuple[Any, Any]]:
  """rlx.model.lora adapters -> {param path: (A [in, r], B [r, out])}, checked against the
  model and lora_cfg; a mistake is one line naming the adapter."""
  if not isinstance(lora_cfg, lora_lib.LoRAConfig):
    raise ValueError(f"{where}: lora_cfg={type(lora_cfg).__name__}, expected an "
                     "rlx.model.lora.LoRAConfig.")
  if not isinstance(adapters, Mapping) or not adapters:
    raise ValueError(f"{where}: adapters={type(adapters).__name__} "
                     f"{'(empty)' if isinstance(adapters, Mapping) else ''}, expected a nested "
                     "dict like {'layer_0': {'attn': {'q_proj': {'a': A, 'b': B}}}}.")
  expected = _param_paths(cfg)
  pairs: dict[str, dict[str, Any]] = {}
  for leaf, value in _flatten(adapters):
    path, _, kind = leaf.rpartition("/")
    if kind not in ("a", "b") or not path:
      raise ValueError(f"{where}: adapter leaf {leaf!r}; expected paths ending in /a and /b, "
                       "e.g. 'layer_0/attn/q_proj/a'.")
    pairs.setdefault(path, {})[kind] = value
  if not pairs:
    raise ValueError(f"{where}: adapters hold no arrays; expected a nested dict like "
                     "{'layer_0': {'attn': {'q_proj': {'a': A, 'b': B}}}}.")
  r = lora_cfg.rank
  out = {}
  for path, ab in sorted(pairs.items()):
    if path not in expected or path.rsplit("/", 1)[-1] not in _ADAPTABLE:
      raise ValueError(
          f"{where}: adapters for {path!r}, which is not a projection of this model "
          f"({cfg.num_layers} layers, {'tied' if cfg.tie_embeddings else 'untied'} "
          f"embeddings; paths look like 'layer_0/attn/q_proj', 'layer_0/mlp/down_proj').")
    if set(ab) != {"a", "b"}:
      raise ValueError(f"{where}: adapter {path!r} has only {sorted(ab)}; expected a and b.")
    (d_in, d_out), _ = expected[path]
    a_shape, b_shape = tuple(np.shape(ab["a"])), tuple(np.shape(ab["b"]))
    if a_shape != (d_in, r) or b_shape != (r, d_out):
      raise ValueError(f"{where}: adapter {path!r} has a {list(a_shape)}, b {list(b_shape)}; "
                       f"rank {r} on a [{d_in}, {d_out}] weight implies a [{d_in}, {r}], "
                       f"b [{r}, {d_out}].")
    out[path] = (ab["a"], ab["b"])
  return out


def _peft_module(cfg: ModelConfig, path: str) -> str:
  """rlx param path -> the module name PEFT sees ('model.layers.0.self_attn.q_proj')."""
  name, _ = hf_name(cfg, path)
  return name[:-len(".weight")]


def peft_target_modules(cfg: ModelConfig, paths: list[str]) -> list[str] | str:
  r"""PEFT's `target_modules` for adapters on exactly these rlx param paths.

  When every layer's module of each adapted kind is adapted (the usual case), the plain list
  of module names (["q_proj", "v_proj"]), as PEFT users write it. Otherwise (some layers only,
  or different modules on different layers) a regex that PEFT full-matches against module
  names and that matches exactly the adapted modules, e.g.
  "model\.layers\.(?:0|1)\.(?:self_attn\.q_proj)|lm_head".
  """
  modules = {_peft_module(cfg, p) for p in paths}
  weights = {p: _peft_module(cfg, p) for p, (shape, _) in _param_paths(cfg).items()
             if p.rsplit("/", 1)[-1] in _ADAPTABLE and len(shape) == 2}
  kinds = sorted({m.rsplit(".", 1)[-1] for m in modules})
  if modules == {m for m in weights.values() if m.rsplit(".", 1)[-1] in kinds}:
    return kinds
  layers: dict[str, set[int]] = {}  # "self_attn.q_proj" -> the layers adapted there
  others = []  # lm_head
  for m in sorted(modules):
    if m.startswith("model.layers."):
      i, sub = m[len("model.layers."):].split(".", 1)
      layers.setdefault(sub, set()).add(int(i))
    else:
      others.append(re.escape(m))
  groups: dict[tuple[int, ...], list[str]] = {}  # layers -> the modules adapted on them
  for sub, ids in layers.items():
    groups.setdefault(tuple(sorted(ids)), []).append(sub)
  pieces = [rf"model\.layers\.(?:{'|'.join(map(str, ids))})\."
            rf"(?:{'|'.join(re.escape(s) for s in sorted(subs))})"
            for ids, subs in sorted(groups.items())]
  pattern = "|".join(pieces + others)
  assert {m for m in weights.values() if re.fullmatch(pattern, m)} == modules, pattern
  return pattern


def save_peft_adapter(cfg: ModelConfig, adapters: Params, lora_cfg: lora_lib.LoRAConfig,
                      out_dir: str, *, base_model_name_or_path: str = "",
                      dtype: str = "float32") -> None:
  """Writes a PEFT LoRA adapter directory: adapter_config.json + adapter_model.safetensors.

  `peft.PeftModel.from_pretrained(base, out_dir)` (base: the Hugging Face model the adapters
  were trained on, e.g. save_hf(cfg, base_params, ...)) then computes the adapted policy:
  PEFT's lora_A = A.T [r, in], lora_B = B.T [out, r], scaling lora_alpha / r = lora_cfg.scale.
  The adapted modules are exactly those in `adapters` (see `peft_target_modules`).
  base_model_name_or_path: recorded in adapter_config.json, where
  `AutoPeftModelForCausalLM.from_pretrained(out_dir)` looks for the base (a directory or a
  Hub id). dtype: of the adapter tensors. In multi-process runs every process must call this;
  only process 0 writes.
  """
  if dtype not in DTYPES:
    raise ValueError(f"save_peft_adapter: dtype={dtype!r}, expected one of {tuple(DTYPES)}.")
  checked = _check_adapters(cfg, adapters, lora_cfg, "save_peft_adapter")
  alpha = float(lora_cfg.alpha)
  config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path or None,
      "revision": None,
      "inference_mode": True,
      "r": lora_cfg.rank,
      "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
      "target_modules": peft_target_modules(cfg, list(checked)),
      "exclude_modules": None,
      "lora_dropout": 0.0,
      "bias": "none",
      "fan_in_fan_out": False,  # PEFT's weights are [out, in] as torch.nn.Linear's
      "use_rslora": False,  # scaling = lora_alpha / r, as rlx's
      "use_dora": False,
      "init_lora_weights": True,
      "layers_to_transform": None,
      "layers_pattern": None,
      "rank_pattern": {},
      "alpha_pattern": {},
      "modules_to_save": None,
  }
  r = lora_cfg.rank
  tensors, fetches = [], {}
  for path, (a, b) in checked.items():
    prefix = "base_model.model." + _peft_module(cfg, path)
    d_in, d_out = np.shape(a)[0], np.shape(b)[1]
    tensors += [(prefix + ".lora_A.weight", (r, d_in)), (prefix + ".lora_B.weight", (d_out, r))]
    fetches[prefix + ".lora_A.weight"] = a
    fetches[prefix + ".lora_B.weight"] = b
  tensors.sort()
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
  write_safetensors(out_dir, tensors, lambda name: _to_host(fetches[name]).T,
                    dtype=np.dtype(DTYPES[dtype]), max_shard_bytes=2**62, write=writer,
                    name="adapter_model")


def write_safetensors(out_dir: str, tensors: list[tuple[str, tuple[int, ...]]],
                      fetch: Callable[[str], np.ndarray], *, dtype: np.dtype,
                      max_shard_bytes: int = 5 * 10**9, write: bool = True,
                      name: str = "model") -> int:
  """Streams tensors into model.safetensors (or shards + index), one tensor on the host at a time.

  tensors: (name, shape) in file order; fetch(name) returns the array (any float dtype; cast
  to dtype here). Returns the bytes of tensor data written. With write=False only fetch is
  called (multi-process runs, where every process must join the gathers). name: the files'
  stem ("adapter_model" for a PEFT adapter); "model" replaces every *.safetensors in out_dir,
  another stem only its own files.
  """
  stem = name
  dtype = np.dtype(dtype)
  shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
  size = 0
  for name, shape in tensors:
    nbytes = math.prod(shape) * dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, tuple(shape)))
    size += nbytes
  if write:
    os.makedirs(out_dir, exist_ok=True)
    pattern = "*.safetensors" if stem == "model" else f"{glob.escape(stem)}*.safetensors"
    for stale in glob.glob(os.path.join(out_dir, pattern)) + glob.glob(
        os.path.join(out_dir, f"{glob.escape(stem)}.safetensors.index.json")):
      os.remove(stale)
  n = len(shards)
  weight_map = {}
  total = 0
  for i, shard in enumerate(shards):
    fname = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard:
      nbytes = math.prod(shape) * dtype.itemsize
      header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
      weight_map[name] = fname
    total += offset
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tmp = os.path.join(out_dir, fname + ".tmp")
    f = open(tmp, "wb") if write else None
    try:
      if f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
      for name, shape in shard:
        host = np.asarray(fetch(name))
        if tuple(host.shape) != shape:
          raise ValueError(f"Tensor {name!r} has shape {list(host.shape)}, expected {list(shape)}.")
        if f:
          data = np.ascontiguousarray(host.astype(dtype, copy=False)).reshape(-1)
          f.write(memoryview(data.view(np.uint8)))  # no bytes copy of the tensor
        del host
    finally:
      if f:
        f.close()
    if write:
      os.replace(tmp, os.path.join(out_dir, fname))
  if write and n > 1:
    with open(os.path.join(out_dir, f"{stem}.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                sort_keys=True)
  return total
