"""Model configuration: one frozen dataclass covering the Llama, Qwen2/3 and Gemma families."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from rlx.errors import ConfigError

ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("none", "linear", "llama3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Backends (jax.default_backend()) where config.model.dtype="auto" computes in bfloat16.
BF16_PLATFORMS = ("gpu", "tpu", "cuda", "rocm")


def resolve_dtype(value, platform: str, key: str = "model.dtype") -> str:
  """config.model.dtype as the model computes: "auto" is bfloat16 on a GPU or TPU (half the
  bytes per weight and KV entry read while decoding, native bf16 matmuls) and float32 on
  every other backend (XLA:CPU runs bf16 matmuls several times slower than f32); an explicit
  dtype name is kept. Master params stay in config.model.param_dtype either way.

  platform: jax.default_backend() of the run ("cpu", "gpu", "tpu").
  """
  if value == "auto":
    return "bfloat16" if str(platform).lower() in BF16_PLATFORMS else "float32"
  if not isinstance(value, str) or value not in DTYPES:
    raise ConfigError(f"config.{key}={value!r}; expected 'auto' (bfloat16 on GPU/TPU, float32 "
                      f"on CPU) or one of {tuple(DTYPES)}.")
  return value


def model_dtype(config, platform: str | None = None) -> str:
  """config.model.dtype resolved for `platform` (default: this process's JAX backend)."""
  return resolve_dtype(config.model.dtype, platform or jax.default_backend())


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only transformer.

  The switches express the families rlx supports:
    Llama 3: silu, rope_scaling="llama3", untied embeddings.
    Qwen2/2.5: qkv_bias=True, often tie_embeddings=True.
    Qwen3: qk_norm=True.
    Gemma 2/3: norm_plus_one, embed_scale, gelu_tanh, post_attn_norm/post_mlp_norm,
      soft-capping (Gemma 2), qk_norm (Gemma 3), sliding-window layers.
  """

  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  activation: str = "silu"
  norm_eps: float = 1e-6
  norm_plus_one: bool = False  # Gemma: y = x * (1 + w).
  rope_theta: float = 10_000.0
  rope_scaling: str = "none"
  rope_scaling_factor: float = 1.0
  # Llama 3 "llama3" rope scaling parameters.
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  qkv_bias: bool = False
  qk_norm: bool = False
  post_attn_norm: bool = False  # Gemma 2/3 norm after attention, before the residual add.
  post_mlp_norm: bool = False
  tie_embeddings: bool = True
  embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(d_model).
  query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim).
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  sliding_window: int | None = None
  # Layer i is a sliding-window layer iff layer_types[i] == "sliding"; () means all global.
  layer_types: tuple[str, ...] = ()
  rope_local_theta: float | None = None  # Gemma 3: rope base of sliding layers.
  max_position: int = 4096
  dtype: str = "float32"  # activation / matmul dtype
  param_dtype: str = "float32"
  # Execution, not architecture (the params tree is the same either way): run the layers as
  # one lax.scan over their stacked weights, so a program holds one layer, not num_layers
  # copies (compile time flat in depth); see Transformer.hidden for where it applies.
  scan_layers: bool = False

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"ModelConfig: {msg}")

    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim", "max_position", "rope_original_max_position"):
      value = getattr(self, name)
      need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
           f"{name}={value!r}, expected a positive int")
    optional = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                "rope_local_theta", "sliding_window")
    for name in ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
                 "rope_high_freq_factor") + optional:
      value = getattr(self, name)
      if value is None and name in optional:
        continue
      need(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
           and math.isfinite(value), f"{name}={value!r}, expected a positive number"
           + (" or None" if name in optional else ""))
    need(self.num_heads % self.num_kv_heads == 0,
         f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    need(self.activation in ACTIVATIONS,
         f"activation={self.activation!r}, expected one of {ACTIVATIONS}")
    need(self.rope_scaling in ROPE_SCALINGS,
         f"rope_scaling={self.rope_scaling!r}, expected one of {ROPE_SCALINGS}")
    need(self.dtype in DTYPES, f"dtype={self.dtype!r}, expected one of {tuple(DTYPES)}")
    need(self.param_dtype in DTYPES,
         f"param_dtype={self.param_dtype!r}, expected one of {tuple(DTYPES)}")
    if self.layer_types:
      need(len(self.layer_types) == self.num_layers,
           f"layer_types has {len(self.layer_types)} entries, expected num_layers="
           f"{self.num_layers}")
      bad = sorted(set(self.layer_types) - {"sliding", "global"})
      need(not bad, f"layer_types contains {bad}, expected 'sliding' or 'global'")
      if "sliding" in self.layer_types:
        need(self.sliding_window is not None and self.sliding_window > 0,
             "sliding layers need a positive sliding_window")

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]

  @property
  def attn_scale(self) -> float:
    base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
    return float(base) ** -0.5

  def is_sliding(self, layer: int) -> bool:
    return bool(self.layer_types) and self.layer_types[layer] == "sliding"

  @property
  def layers_alike(self) -> bool:
    """Every layer computes the same function of its own weights (one attention window and
    one RoPE base for all), so the layers can run as one scanned body."""
    return len(set(self.layer_types)) <= 1

  def window(self, layer: int) -> int | None:
    return self.sliding_window if self.is_sliding(layer) else None

  def num_params(self) -> int:
    d, f, hq, hkv, hd = self.d_model, self.mlp_dim, self.num_heads, self.num_kv_heads, self.head_dim
    attn = d * hd * (hq + 2 * hkv) + hq * hd * d
    if self.qkv_bias:
      attn += hd * (hq + 2 * hkv)
    if self.qk_norm:
      attn += 2 * hd
    norms = d * (2 + int(self.post_attn_norm) + int(self.post_mlp_norm))
    layer = attn + 3 * d * f + norms
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + emb + d

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"Unknown model config keys {unknown}; valid keys are {sorted(fields)}")
    kwargs = dict(d)
    if "layer_types" in kwargs and kwargs["layer_types"] is not None:
      kwargs["layer_types"] = tuple(kwargs["layer_types"])
    return cls(**kwargs)
