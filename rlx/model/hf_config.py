"""Hugging Face config.json <-> rlx ModelConfig, and the per-family tensor names.

`config_from_hf` maps a config.json (transformers 4.5x or 5.x) of a supported family to a
ModelConfig, checking every field it reads (one-line ValueErrors naming the file);
`config_to_hf` maps back and refuses what the architecture cannot express. `hf_name` gives
each rlx parameter's tensor name in a Hugging Face checkpoint. The public entry points are
re-exported by `rlx.model.hf`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import jax

from rlx import sharding as sharding_lib
from rlx.model import transformer
from rlx.model.config import ModelConfig

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


# ================================================================== config.json


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
  c = _text_config(hf_config, arch, family, where)
  here = f"{where} ({arch})"
  act = _activation(c, family, here)
  shapes = _shapes(c, here)
  norm_eps = _positive(c["rms_norm_eps"], "rms_norm_eps", here, float)
  layer_types = _layer_types(family, c, shapes["num_layers"], here)
  rope, rope_local_theta = _rope_fields(c, family, here)
  is_gemma = family.startswith("gemma")
  qpas = _number(c, "query_pre_attn_scalar", here) if family in ("gemma2", "gemma3") else None
  attn_softcap = _number(c, "attn_logit_softcapping", here)
  final_softcap = _number(c, "final_logit_softcapping", here)
  sliding_window = _size(c, "sliding_window", here) if layer_types else None
  try:
    return ModelConfig(
        **shapes,
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
        dtype=dtype,
        param_dtype=param_dtype or dtype,
        **rope,
    )
  except ValueError as e:  # what the checks above do not catch; say which file it came from
    raise ValueError(f"{here}: {e}") from e


def _text_config(hf_config: Mapping[str, Any], arch: str, family: str,
                 where: str) -> dict[str, Any]:
  """The language model's keys (a Gemma 3 multimodal file nests them in text_config), over
  the family's defaults for the keys its files may leave out or set to null."""
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
  return {**_DEFAULTS[family], **{k: v for k, v in c.items() if v is not None or k in (
      "sliding_window", "attn_logit_softcapping", "final_logit_softcapping")}}


def _size(c: Mapping[str, Any], key: str, here: str) -> int:
  """c[key], which must be there and be a positive integer."""
  if key not in c:
    raise ValueError(f"{here} has no {key!r}.")
  return _positive(c[key], key, here)


def _number(c: Mapping[str, Any], key: str, here: str) -> float | None:
  """A positive float, or None where the key is unset / null / 0."""
  return _positive(c[key], key, here, float) if c.get(key) else None


def _activation(c: Mapping[str, Any], family: str, here: str) -> str:
  """The MLP's activation (a key of _ACTIVATIONS), after refusing what rlx does not model."""
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
  return act


def _shapes(c: Mapping[str, Any], here: str) -> dict[str, int]:
  """The ModelConfig sizes: vocabulary, layers, widths, heads, positions."""
  vocab_size = _size(c, "vocab_size", here)
  num_layers = _size(c, "num_hidden_layers", here)
  num_heads = _size(c, "num_attention_heads", here)
  d_model = _size(c, "hidden_size", here)
  mlp_dim = _size(c, "intermediate_size", here)
  max_position = _size(c, "max_position_embeddings", here)
  num_kv_heads = c.get("num_key_value_heads")
  num_kv_heads = num_heads if num_kv_heads is None else _size(c, "num_key_value_heads", here)
  if num_heads % num_kv_heads:
    raise ValueError(f"{here}: num_attention_heads={num_heads} is not a multiple of "
                     f"num_key_value_heads={num_kv_heads}.")
  if c.get("head_dim") in (None, 0):  # as transformers: head_dim or hidden_size // heads
    if d_model % num_heads:
      raise ValueError(f"{here}: hidden_size={d_model} is not a multiple of "
                       f"num_attention_heads={num_heads}, and there is no head_dim.")
    head_dim = d_model // num_heads
  else:
    head_dim = _size(c, "head_dim", here)
  return dict(vocab_size=vocab_size, num_layers=num_layers, d_model=d_model,
              num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
              mlp_dim=mlp_dim, max_position=max_position)


def _rope_fields(c: Mapping[str, Any], family: str,
                 here: str) -> tuple[dict[str, Any], float | None]:
  """(the ModelConfig rope fields, Gemma 3's sliding-layer rope theta or None).

  transformers 5 writes `rope_parameters` (nested per layer type for Gemma 3); older files
  have top-level rope_theta / rope_scaling / rope_local_base_freq.
  """
  rp = c.get("rope_parameters")
  if rp is not None and not isinstance(rp, Mapping):
    raise ValueError(f"{here}: rope_parameters holds a JSON {_json_type(rp)}, expected an "
                     "object.")
  if family != "gemma3":
    return _rope(rp if rp else c.get("rope_scaling"), c["rope_theta"], here), None
  rp = rp or {}
  full = rp.get("full_attention") if "full_attention" in rp else (
      rp or c.get("rope_scaling"))
  rope = _rope(full, c["rope_theta"], f"{here} full_attention rope")
  local = _rope(rp.get("sliding_attention") or {}, c["rope_local_base_freq"],
                f"{here} sliding_attention rope")
  if local["rope_scaling"] != "none":
    raise ValueError(f"{here}: rope scaling on sliding layers is not supported.")
  return rope, local["rope_theta"]


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

  back = dataclasses.replace(config_from_hf(hf, dtype=cfg.dtype, param_dtype=cfg.param_dtype),
                             scan_layers=cfg.scan_layers)  # execution, not in an HF config
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


# =============================================================== tensor names


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
