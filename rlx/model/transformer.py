"""Decoder-only transformer in flax NNX (Llama / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 switches).

The hot loops never call `nnx.jit`; they jit plain functions of `(graphdef, params)` where
`params` is the pure nested dict from `nnx.split` (see `init_params` / `apply`).

Attention goes through a KV context so that one model serves three call patterns:
  * `cache=None`: full causal self-attention over the given tokens (training, log-probs).
  * a dense cache (`rlx.sampler.dense.DenseKVCache`): prefill and single-step decode.
  * a paged cache (`rlx.sampler.paged`): same model, paged KV pool.
A context implements `layer_attend(layer, q, k, v, q_pos, spec) -> (out, context)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from rlx.model.config import ModelConfig
from rlx.model.lora import linear

Params = dict[str, Any]
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Static per-layer attention settings."""

  scale: float
  softcap: float | None
  window: int | None


class KVContext(Protocol):

  def layer_attend(self, layer: int, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, q_pos_BxT,
                   spec: AttentionSpec):
    ...


# ----------------------------------------------------------------------------- attention math


def attention_mask(q_pos_BxT, k_pos_BxS, window: int | None):
  """allowed[b, t, s]: key s is valid (pos >= 0), not in the future, inside the window."""
  q = q_pos_BxT[:, :, None]
  k = k_pos_BxS[:, None, :]
  allowed = (k >= 0) & (k <= q)
  if window is not None:
    allowed &= (q - k) < window
  return allowed


def dot_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, allowed_BxTxS, spec: AttentionSpec):
  """Masked softmax attention with grouped-query heads; softmax in f32.

  Fully masked rows (padding queries) give finite garbage that callers ignore.
  """
  b, t, h, d = q_BxTxHxD.shape
  kv = k_BxSxKxD.shape[2]
  q_BxTxKxGxD = q_BxTxHxD.reshape(b, t, kv, h // kv, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD,
                      preferred_element_type=jnp.float32) * spec.scale
  if spec.softcap is not None:
    logits = spec.softcap * jnp.tanh(logits / spec.softcap)
  logits = jnp.where(allowed_BxTxS[:, None, None], logits, _MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1)
  # Select, not multiply: garbage (even NaN) in masked value slots must not leak.
  v_safe = jnp.where((allowed_BxTxS.any(axis=1))[:, :, None, None], v_BxSxKxD, 0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_safe.dtype), v_safe,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d).astype(q_BxTxHxD.dtype)


# The no-cache path uses `keys_major_attention` from this many keys up, `dot_attention` below:
# at the default arithmetic task's 24 tokens the layout change does not pay (forward +
# backward 0.96-1.11x of autodiff, and the update 1.03x), from 48 keys it does (0.68-0.90x
# at 48-512 keys, heads 4-12, head_dim 32-64; 2 CPU cores).
KEYS_MAJOR_MIN_KEYS = 48


def uses_keys_major(num_keys: int) -> bool:
  """Whether the no-cache path attends with `keys_major_attention` at this many keys (the
  memory plan asks too: its backward keeps different residuals)."""
  return num_keys >= KEYS_MAJOR_MIN_KEYS


def keys_major_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, allowed_BxTxS,
                         spec: AttentionSpec):
  """`dot_attention` for the no-cache path (training, log-probs), with a hand-written VJP.

  Same math and dtypes as `dot_attention` (f32 logits and softmax, grouped-query heads); the
  difference is the layout and the backward pass. Every [keys, queries] tensor is kept
  keys-major (per KV head: S^T = K Q^T, O^T = V^T P^T), so that none of the backward's
  matmuls needs a transposed copy of P or dS (XLA:CPU transposes a matmul's left operand when
  it contracts its leading dimension), only of the [T, d]-sized Q, K, V and O; and the
  softmax backward takes rowsum(dP * P) as rowsum(dO * O) (as FlashAttention does), a pass
  over [T, d] instead of [T, S]. Measured at the 100M peer shape on CPU (4 rows x 135
  tokens, 12 heads / 4 KV heads, one layer's forward + backward, median of 40 interleaved):
  3.6 ms vs 5.4 ms for autodiff of `dot_attention`. Equal to `dot_attention` in value and gradient
  (tests/model/test_transformer.py) wherever a query sees at least one key. A query that sees
  none (no such row in training: left padding sees the first real token) gets the uniform
  average of V here, and, unlike under `dot_attention`'s select, a cotangent on it would reach
  q, k and v; the update gives those rows none (the loss masks them).

  Masked key slots get a -0.7 * f32-max bias instead of a select, and there is no select on
  V: here K and V are the layer's own projections of the given tokens, so they are finite
  (the caches' garbage slots go through `dot_attention`).
  """
  b, t, h, d = q_BxTxHxD.shape
  kv = k_BxSxKxD.shape[2]
  g = h // kv
  # [B, K, d, G*T]: queries along the minor axis, grouped by KV head.
  q_T = q_BxTxHxD.reshape(b, t, kv, g, d).transpose(0, 2, 4, 3, 1).reshape(b, kv, d, g * t)
  k_BxKxSxD = k_BxSxKxD.transpose(0, 2, 1, 3)
  v_BxKxSxD = v_BxSxKxD.transpose(0, 2, 1, 3)
  bias_T = jnp.where(allowed_BxTxS, 0.0, _MASK_VALUE).astype(jnp.float32).swapaxes(1, 2)
  o_T = _attention_core(q_T, k_BxKxSxD, v_BxKxSxD, bias_T[:, None, :, None, :],
                        spec.scale, spec.softcap)
  return o_T.reshape(b, kv, d, g, t).transpose(0, 4, 1, 3, 2).reshape(b, t, h, d).astype(
      q_BxTxHxD.dtype)


def _attention_probs(q_T, k, bias_T, scale, softcap):
  """P^T [B, K, S, G*T] (f32) and tanh(S / softcap) (None without a softcap)."""
  b, kv, s = k.shape[:3]
  gt = q_T.shape[-1]
  t = bias_T.shape[-1]
  logits = jnp.einsum("bksd,bkdq->bksq", k, q_T, preferred_element_type=jnp.float32) * scale
  th = None
  if softcap is not None:
    th = jnp.tanh(logits / softcap)
    logits = softcap * th
  logits = logits.reshape(b, kv, s, gt // t, t) + bias_T
  e = jnp.exp(logits - jnp.max(logits, axis=2, keepdims=True))
  p = (e / jnp.sum(e, axis=2, keepdims=True)).reshape(b, kv, s, gt)
  return p, th


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention_core(q_T, k, v, bias_T, scale, softcap):
  p, _ = _attention_probs(q_T, k, bias_T, scale, softcap)
  return jnp.einsum("bksd,bksq->bkdq", v, p.astype(v.dtype), preferred_element_type=jnp.float32)


def _attention_core_fwd(q_T, k, v, bias_T, scale, softcap):
  p, th = _attention_probs(q_T, k, bias_T, scale, softcap)
  o = jnp.einsum("bksd,bksq->bkdq", v, p.astype(v.dtype), preferred_element_type=jnp.float32)
  return o, (q_T, k, v, p, th, o)


def _attention_core_bwd(scale, softcap, res, do):
  q_T, k, v, p, th, o = res
  f32 = jnp.float32
  dv = jnp.einsum("bksq,bkdq->bksd", p.astype(do.dtype), do, preferred_element_type=f32)
  dp = jnp.einsum("bksd,bkdq->bksq", v.astype(do.dtype), do, preferred_element_type=f32)
  delta = jnp.sum(do * o, axis=2, keepdims=True)  # rowsum(dP * P) = rowsum(dO * O)
  ds = p * (dp - delta)
  if softcap is not None:
    ds = ds * (1.0 - th * th)
  ds = ds * scale
  dk = jnp.einsum("bksq,bkdq->bksd", ds.astype(q_T.dtype), q_T, preferred_element_type=f32)
  dq = jnp.einsum("bksd,bksq->bkdq", k, ds.astype(k.dtype), preferred_element_type=f32)
  return (dq.astype(q_T.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None)


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


# ----------------------------------------------------------------------------- rope


@functools.lru_cache(maxsize=None)
def rope_inv_freq(cfg: ModelConfig, layer: int) -> np.ndarray:
  """Inverse frequencies [head_dim // 2] for a layer (numpy: static, computed at trace)."""
  local = cfg.is_sliding(layer) and cfg.rope_local_theta is not None
  theta = cfg.rope_local_theta if local else cfg.rope_theta
  d = cfg.head_dim
  inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  if local or cfg.rope_scaling == "none":
    return inv
  if cfg.rope_scaling == "linear":
    return inv / cfg.rope_scaling_factor
  # llama3: low frequencies scaled by `factor`, high ones kept, smooth in between.
  factor = cfg.rope_scaling_factor
  old = cfg.rope_original_max_position
  low_wavelen = old / cfg.rope_low_freq_factor
  high_wavelen = old / cfg.rope_high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
  smooth = (old / wavelen - cfg.rope_low_freq_factor) / (
      cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled)


def apply_rope(x_BxTxHxD, pos_BxT, inv_freq):
  """Rotate-half RoPE (the Hugging Face / Llama layout), computed in f32."""
  angles = pos_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x = x_BxTxHxD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxD.dtype)


# ----------------------------------------------------------------------------- fused projections


@struct.dataclass
class FusedProjection:
  """Projections of one input side by side, as a decode step wants them: `w` [in, sum(sizes)]
  is their matrices concatenated along the output axis, so the step runs one matmul (one
  kernel, one pass over the input) where it ran len(sizes). It stands at the first
  projection's leaf (q_proj, gate_proj) and `FusedElsewhere` at the others' (see
  `fuse_projections`); the params tree and its paths stay those of the unfused model."""

  w: jax.Array
  sizes: tuple[int, ...] = struct.field(pytree_node=False)

  def __getitem__(self, index):  # nnx reads variables as `var[...]`
    if index is not Ellipsis:
      raise TypeError(f"FusedProjection supports only [...] indexing, got {index!r}")
    return self

  def apply(self, eq: str, x, dtype) -> list[jax.Array]:
    """The projections of x (`eq` as for `linear`), split back into one array each."""
    y = linear(eq, x, self.w, dtype)
    return jnp.split(y, np.cumsum(self.sizes)[:-1].tolist(), axis=-1)


@struct.dataclass
class FusedElsewhere:
  """Stands in for a projection whose columns are part of a `FusedProjection`."""

  def __getitem__(self, index):
    raise TypeError("this projection is fused into a FusedProjection at a sibling leaf "
                    "(rlx.model.transformer.fuse_projections); read it there.")


# Projections that read the same input, per module: the first leaf gets the fused matrix.
FUSED_GROUPS = (("attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def fuse_projections(params: Params) -> Params:
  """`params` with each layer's q/k/v and gate/up matrices concatenated into one
  `FusedProjection` (a copy of those matrices), for the samplers' decode loops: per layer
  per token, 2 matmuls instead of 5 (experiments/results/decode_kernels_cpu.md). The model
  computes the same products from either tree (equal within f32 rounding: one GEMM may sum
  in another order than three). The cost is that copy, held while the sampler runs: on CPU
  in f32 about 5/7 of the layers' matrices at the default MLP width; where the sampling copy
  casts f32 masters to bf16 anyway, XLA writes the cast straight into the fused matrix.

  A group is left as it is unless all its matrices are plain 2-D arrays of one dtype and
  input width: LoRA's unmerged `LoRAWeight`s (attach) keep their low-rank path, and a tree
  that is already fused passes through."""

  def fusable(ws):
    return (all(isinstance(w, (jax.Array, np.ndarray)) and np.ndim(w) == 2 for w in ws)
            and len({(jnp.dtype(w.dtype), w.shape[0]) for w in ws}) == 1)

  out = dict(params)
  for key, layer in params.items():
    if not (key.startswith("layer_") and isinstance(layer, dict)):
      continue
    layer = dict(layer)
    for module, names in FUSED_GROUPS:
      sub = layer.get(module)
      if not isinstance(sub, dict) or not all(n in sub for n in names):
        continue
      ws = [sub[n] for n in names]
      if not fusable(ws):
        continue
      sub = dict(sub)
      sub[names[0]] = FusedProjection(jnp.concatenate(ws, axis=1),
                                      tuple(int(w.shape[1]) for w in ws))
      for n in names[1:]:
        sub[n] = FusedElsewhere()
      layer[module] = sub
    out[key] = layer
  return out


# ----------------------------------------------------------------------------- modules


def _normal(rngs: nnx.Rngs, shape, std, dtype):
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * std)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, cfg: ModelConfig):
    self.eps = cfg.norm_eps
    self.plus_one = cfg.norm_plus_one
    init = jnp.zeros if cfg.norm_plus_one else jnp.ones
    self.scale = nnx.Param(init((dim,), cfg.weight_dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    w = self.scale[...].astype(jnp.float32)
    return (y * (1.0 + w if self.plus_one else w)).astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    self.cfg = cfg
    self.layer = layer
    d, hd = cfg.d_model, cfg.head_dim
    std = d ** -0.5
    wd = cfg.weight_dtype
    self.q_proj = _normal(rngs, (d, cfg.num_heads * hd), std, wd)
    self.k_proj = _normal(rngs, (d, cfg.num_kv_heads * hd), std, wd)
    self.v_proj = _normal(rngs, (d, cfg.num_kv_heads * hd), std, wd)
    self.o_proj = _normal(rngs, (cfg.num_heads * hd, d),
                          (cfg.num_heads * hd) ** -0.5 / math.sqrt(2 * cfg.num_layers), wd)
    if cfg.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((cfg.num_heads * hd,), wd))
      self.k_bias = nnx.Param(jnp.zeros((cfg.num_kv_heads * hd,), wd))
      self.v_bias = nnx.Param(jnp.zeros((cfg.num_kv_heads * hd,), wd))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg)
      self.k_norm = RMSNorm(hd, cfg)
    self.spec = AttentionSpec(scale=cfg.attn_scale, softcap=cfg.attn_logit_softcap,
                              window=cfg.window(layer))

  def _project(self, x, name, heads, y=None):
    """x's projection `name` as [B, T, heads, head_dim]; y: the product, when already taken."""
    cfg = self.cfg
    if y is None:
      y = linear("btd,de->bte", x, getattr(self, f"{name}_proj")[...], cfg.compute_dtype)
    if cfg.qkv_bias:
      y = y + getattr(self, f"{name}_bias")[...].astype(cfg.compute_dtype)
    return y.reshape(*x.shape[:2], heads, cfg.head_dim)

  def __call__(self, x_BxTxD, pos_BxT, valid_BxT, ctx: KVContext | None, layer=None):
    """layer: this layer's index as the KV context sees it (default the static one; a
    traced index when the layers run scanned, whose RoPE and window are then all alike)."""
    cfg = self.cfg
    layer = self.layer if layer is None else layer
    qkv = self.q_proj[...]
    fused = (qkv.apply("btd,de->bte", x_BxTxD, cfg.compute_dtype)
             if isinstance(qkv, FusedProjection) else (None, None, None))
    q = self._project(x_BxTxD, "q", cfg.num_heads, fused[0])
    k = self._project(x_BxTxD, "k", cfg.num_kv_heads, fused[1])
    v = self._project(x_BxTxD, "v", cfg.num_kv_heads, fused[2])
    if cfg.qk_norm:
      q = self.q_norm(q)
      k = self.k_norm(k)
    inv_freq = rope_inv_freq(cfg, self.layer)
    q = apply_rope(q, pos_BxT, inv_freq)
    k = apply_rope(k, pos_BxT, inv_freq)
    if ctx is None:
      k_pos = jnp.where(valid_BxT, pos_BxT, -1)
      allowed = attention_mask(pos_BxT, k_pos, self.spec.window)
      attend = keys_major_attention if uses_keys_major(k.shape[1]) else dot_attention
      out = attend(q, k, v, allowed, self.spec)
    else:
      out, ctx = ctx.layer_attend(layer, q, k, v, pos_BxT, self.spec)
    b, t = x_BxTxD.shape[:2]
    out = out.reshape(b, t, cfg.num_heads * cfg.head_dim)
    return linear("bte,ed->btd", out, self.o_proj[...], cfg.compute_dtype), ctx


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, f, wd = cfg.d_model, cfg.mlp_dim, cfg.weight_dtype
    self.gate_proj = _normal(rngs, (d, f), d ** -0.5, wd)
    self.up_proj = _normal(rngs, (d, f), d ** -0.5, wd)
    self.down_proj = _normal(rngs, (f, d), f ** -0.5 / math.sqrt(2 * cfg.num_layers), wd)

  def __call__(self, x):
    dt = self.cfg.compute_dtype
    gate_up = self.gate_proj[...]
    if isinstance(gate_up, FusedProjection):
      gate, up = gate_up.apply("btd,df->btf", x, dt)
    else:
      gate = linear("btd,df->btf", x, gate_up, dt)
      up = linear("btd,df->btf", x, self.up_proj[...], dt)
    if self.cfg.activation == "silu":
      act = jax.nn.silu(gate)
    else:
      act = jax.nn.gelu(gate, approximate=True)
    return linear("btf,fd->btd", act * up, self.down_proj[...], dt)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.d_model, cfg)
    self.attn = Attention(cfg, layer, rngs)
    if cfg.post_attn_norm:
      self.post_attn_norm = RMSNorm(cfg.d_model, cfg)
    self.pre_mlp_norm = RMSNorm(cfg.d_model, cfg)
    self.mlp = MLP(cfg, rngs)
    if cfg.post_mlp_norm:
      self.post_mlp_norm = RMSNorm(cfg.d_model, cfg)
    self.cfg = cfg

  def __call__(self, x, pos, valid, ctx, layer=None):
    h, ctx = self.attn(self.input_norm(x), pos, valid, ctx, layer)
    if self.cfg.post_attn_norm:
      h = self.post_attn_norm(h)
    x = x + h
    h = self.mlp(self.pre_mlp_norm(x))
    if self.cfg.post_mlp_norm:
      h = self.post_mlp_norm(h)
    return x + h, ctx


def _remat_block(block: Block, x, pos, valid):
  graphdef, state = nnx.split(block)

  @jax.checkpoint
  def run(state, x):
    out, _ = nnx.merge(graphdef, state)(x, pos, valid, None)
    return out
  return run(state, x)


def _scanned_blocks(blocks: list[Block], x, pos, valid, ctx, remat: bool):
  """The blocks as one lax.scan over their weights stacked on a leading layer axis: the
  program holds one layer's body whatever the depth, so compile time stays flat (the
  unrolled loop grows with it). The stacking is a copy of the layer weights made inside the
  jitted call (and, in a backward pass, the gradient is sliced back per layer), so the
  params tree, HF import/export, LoRA and checkpoints stay those of the unrolled model.
  remat: the body runs under jax.checkpoint (training, ctx=None)."""
  graphdef, _ = nnx.split(blocks[0])
  states = [nnx.split(b)[1] for b in blocks]
  if len({jax.tree.structure(st) for st in states}) > 1:
    # Layers that hold different trees (LoRA adapting some layers only, so only those keep
    # an unmerged LoRAWeight or miss a fused projection) cannot share one body: unrolled.
    for block in blocks:
      x, ctx = (_remat_block(block, x, pos, valid), ctx) if remat else block(x, pos, valid, ctx)
    return x, ctx
  stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *states)

  def body(carry, xs):
    x, ctx = carry
    state, layer = xs
    x, ctx = nnx.merge(graphdef, state)(x, pos, valid, ctx, layer)
    return (x, ctx), None

  if remat:
    body = jax.checkpoint(body)
  (x, ctx), _ = jax.lax.scan(body, (x, ctx), (stacked, jnp.arange(len(blocks))))
  return x, ctx


def scans_layers(cfg: ModelConfig, ctx: "KVContext | None") -> bool:
  """Whether Transformer.hidden runs its layers scanned: asked for (cfg.scan_layers), more
  than one layer, all alike (ModelConfig.layers_alike), and a KV context (if any) that takes
  a traced layer index (`scannable = True`: the dense cache and the paged sampler's
  contexts, whose pool keeps every layer's pages on one page axis)."""
  return (cfg.scan_layers and cfg.num_layers > 1 and cfg.layers_alike
          and (ctx is None or getattr(ctx, "scannable", False)))


class Transformer(nnx.Module):
  """Decoder-only LM. `__call__(tokens, positions, valid, ctx) -> (logits f32, ctx)`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.d_model ** -0.5,
                             cfg.weight_dtype)
    for i in range(cfg.num_layers):
      setattr(self, f"layer_{i}", Block(cfg, i, rngs))
    self.final_norm = RMSNorm(cfg.d_model, cfg)
    if not cfg.tie_embeddings:
      self.lm_head = _normal(rngs, (cfg.d_model, cfg.vocab_size), cfg.d_model ** -0.5,
                             cfg.weight_dtype)

  def layers(self):
    return [getattr(self, f"layer_{i}") for i in range(self.cfg.num_layers)]

  def embed(self, tokens_BxT):
    cfg = self.cfg
    x = jnp.take(self.embedding[...], tokens_BxT, axis=0).astype(cfg.compute_dtype)
    if cfg.embed_scale:
      # Gemma multiplies by sqrt(d) rounded to the activation dtype.
      x = x * jnp.asarray(math.sqrt(cfg.d_model), cfg.compute_dtype)
    return x

  def hidden(self, tokens_BxT, pos_BxT, valid_BxT=None, ctx: KVContext | None = None, *,
             remat: bool = False):
    """Final-norm hidden states [B, T, D]. remat (training, ctx=None): each layer's
    activations are recomputed in the backward pass instead of kept (jax.checkpoint), so the
    backward holds one layer's activations at a time, for ~1/3 more compute. The layers run
    as one scan where `scans_layers` says so, else unrolled."""
    if valid_BxT is None:
      valid_BxT = jnp.ones(tokens_BxT.shape, bool)
    x = self.embed(tokens_BxT)
    if scans_layers(self.cfg, ctx):
      x, ctx = _scanned_blocks(self.layers(), x, pos_BxT, valid_BxT, ctx,
                               remat=remat and ctx is None)
      return self.final_norm(x), ctx
    for block in self.layers():
      if remat and ctx is None:
        x = _remat_block(block, x, pos_BxT, valid_BxT)
      else:
        x, ctx = block(x, pos_BxT, valid_BxT, ctx)
    return self.final_norm(x), ctx

  def logits(self, h_BxTxD):
    cfg = self.cfg
    if cfg.tie_embeddings:
      w = self.embedding[...].astype(cfg.compute_dtype)
      logits = jnp.einsum("btd,vd->btv", h_BxTxD, w, preferred_element_type=jnp.float32)
    else:
      logits = linear("btd,dv->btv", h_BxTxD, self.lm_head[...], cfg.compute_dtype,
                      preferred_element_type=jnp.float32)
    if cfg.final_logit_softcap is not None:
      logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits

  def __call__(self, tokens_BxT, pos_BxT, valid_BxT=None, ctx: KVContext | None = None):
    h, ctx = self.hidden(tokens_BxT, pos_BxT, valid_BxT, ctx)
    return self.logits(h), ctx


# ----------------------------------------------------------------------------- functional API


def init_params(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, Params]:
  """Returns (graphdef, params) with params a pure nested dict of arrays."""
  model = Transformer(cfg, nnx.Rngs(params=seed))
  graphdef, state = nnx.split(model, nnx.Param)
  return graphdef, nnx.to_pure_dict(state)


def abstract_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, Params]:
  """Shapes and dtypes only (no allocation): for sharding plans and checkpoint restore."""
  return nnx.eval_shape(lambda: init_params(cfg, 0))  # type: ignore[return-value]


def graphdef_for(cfg: ModelConfig) -> nnx.GraphDef:
  model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0)))
  graphdef, _ = nnx.split(model, nnx.Param)
  return graphdef


def bind(graphdef: nnx.GraphDef, params: Params) -> Transformer:
  return nnx.merge(graphdef, params)


def apply(graphdef, params, tokens_BxT, pos_BxT, valid_BxT=None, ctx=None):
  return bind(graphdef, params)(tokens_BxT, pos_BxT, valid_BxT, ctx)


def token_logprobs(graphdef, params, tokens_BxT, pos_BxT, valid_BxT, temperature: float = 1.0,
                   *, first: int = 0, chunk: int = 0, remat: bool = False):
  """log pi(tokens[:, t+1] | tokens[:, :t+1]) for first <= t < T-1, shape [B, T-1-first], f32.

  `first` skips the vocabulary projection where no log-prob is wanted (the prompt).

  The policy is softmax(logits / temperature), matching what the sampler draws from. Each
  log-prob is the picked logit minus the log-sum-exp over the vocabulary, so no [B, T, V]
  log-softmax is kept. chunk > 0: the vocabulary projection runs over `chunk` positions at
  a time under jax.checkpoint, so at most [B, chunk, V] logits are live, in the forward and
  in the backward (which recomputes them). remat: per-layer rematerialisation (see
  Transformer.hidden).
  """
  model = bind(graphdef, params)
  h_BxTxD, _ = model.hidden(tokens_BxT, pos_BxT, valid_BxT, remat=remat)
  h_BxTxD = h_BxTxD[:, first:-1]
  targets_BxT = tokens_BxT[:, first + 1:]
  logits_of = model.logits

  def logp_of(h, tgt):
    # f32 whatever the compute dtype (the vocabulary projection accumulates in f32): a bf16
    # log-sum-exp over the vocabulary would lose the log-probs' small differences.
    logits = logits_of(h).astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)

  b, t = targets_BxT.shape
  if not chunk or t <= chunk:
    return logp_of(h_BxTxD, targets_BxT)
  n = -(-t // chunk)
  pad = n * chunk - t
  h_NxBxCxD = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0))).reshape(
      b, n, chunk, -1).swapaxes(0, 1)
  tgt_NxBxC = jnp.pad(targets_BxT, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
  logp_NxBxC = jax.lax.map(lambda a: jax.checkpoint(logp_of)(*a), (h_NxBxCxD, tgt_NxBxC))
  return logp_NxBxC.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
