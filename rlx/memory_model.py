"""The byte formulas rlx.memory's plan adds up, derived from the model and sampler code.

Activations (`layer_activation_bytes`, `saved_activation_bytes`): what the backward of
rlx.model.transformer keeps per token and layer, checked against XLA:CPU's memory analysis.
Remat (`rl.remat`): the backward keeps each layer's input and rebuilds one layer at a time.
XLA:CPU's scheduler realises almost none of that saving (measured: -6% of the update's
temporaries where the model predicts -50%), so on CPU the plan keeps the no-remat upper
bound; on TPU / GPU (or `remat_realised=True`) it counts layer inputs + one layer.

The helpers (`param_splits`, `like_params_bytes`, ...) size abstract trees per device under
the sharding rules.

Paged sampler (rollout and eval, `paged_sampler_lines`): the page pool, the params
all-gathered into its shard_map under FSDP, and the transients of rlx.sampler.paged (one
prefill chunk's layer, admission's page copy, one decode layer's attention -- the "reference"
kernel gathers every slot's pages -- or the decode logits, whichever is largest). In f32 the
plan is within 3% of XLA:CPU's compiled rollout and evaluation; in bf16 XLA:CPU keeps f32
copies of the bf16 pool and of the weights (it upcasts bf16 scatters and matmuls), a CPU
artefact the plan does not model. Dense sampler: `dense_sampler_lines`.

The `*_lines` functions report through `add(name, bytes, formula, phase, hint, estimate=)`,
rlx.memory's line collector.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from rlx import sharding as shd
from rlx.errors import ConfigError
from rlx.model import transformer
from rlx.model.config import ModelConfig
from rlx.sampler import paged


def human(n: float) -> str:
  """Bytes as KiB / MiB / GiB."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"


# ----------------------------------------------------------------------------- helpers


def nbytes(x) -> int:
  return int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def check_mesh(mesh_shape: Mapping[str, int]) -> dict[str, int]:
  bad = sorted(set(mesh_shape) - set(shd.AXES))
  if bad:
    raise ConfigError(f"mesh_shape has unknown axes {bad}; expected a subset of "
                              f"{shd.AXES}.")
  sizes = {a: mesh_shape.get(a, 1) for a in shd.AXES}
  for a, s in sizes.items():
    if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1:
      raise ConfigError(f"mesh_shape[{a!r}]={s!r}; expected a positive int (resolve "
                                "-1 to the device count before planning).")
  return {a: int(s) for a, s in sizes.items()}


def param_splits(abstract_params, mesh: AbstractMesh, rules) -> dict[str, tuple[Any, int]]:
  """path -> (abstract leaf, number of devices its array is split over)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    p = shd.path_str(path)
    spec = shd.spec_for(p, leaf.shape, mesh, rules)
    split = 1
    for entry in spec:
      for axis in (entry if isinstance(entry, tuple) else (entry,)):
        if axis is not None:
          split *= mesh.shape[axis]
    out[p] = (leaf, split)
  return out


def like_params_bytes(tree, splits: dict[str, tuple[Any, int]]) -> int:
  """Per-device bytes of a tree of param-shaped leaves (matched as
  `rlx.sharding.shardings_like_params` does: path suffix); other leaves are replicated."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    p = shd.path_str(path)
    split = 1
    for param_path, (param, s) in splits.items():
      if (p == param_path or p.endswith("/" + param_path)) and leaf.shape == param.shape:
        split = s
        break
    total += nbytes(leaf) // split
  return total


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def out_dim(tree, path: str) -> int:
  """The output dimension of the [in, out] weight at `path` ("layer_0/attn/q_proj")."""
  for k in path.split("/"):
    tree = tree[k]
  return int(tree.shape[-1])


def layer_activation_bytes(cfg: ModelConfig, seq: int,
                            lora_extra: int = 0) -> tuple[int, str]:
  """Bytes per token per layer that the backward pass keeps (rlx.model.transformer, no remat).

  c = compute dtype bytes. The residuals JAX saves per token and layer:
    4 x d x c     residual input, input_norm output (q/k/v weight grads), residual after
                  attention, pre_mlp_norm output (gate/up weight grads)
    2 x d x 4     RMSNorm works in f32: one f32 copy of each norm's input
    (Hq + 2Hkv) D c  q, k after rope (score grads) and v (PV grad); rope itself is linear
    Hq D c        attention output (o_proj weight grad)
    5 x F x c     gate, sigmoid(gate) (silu's jvp), silu(gate), up, silu(gate) * up
    Hq S (8 + c)  f32 scores and softmax probabilities, and the probabilities cast to c for
                  the PV matmul (no extra copy when c = 4), under autodiff of `dot_attention`
                  (below transformer.KEYS_MAJOR_MIN_KEYS keys); where
                  `transformer.uses_keys_major`, the hand-written VJP of
                  `keys_major_attention` keeps instead
    Hq S 4 + Hq D 4   the f32 probabilities (plus f32 tanh(S / softcap) with a logit softcap)
                  and the f32 attention output for rowsum(dO * O); its q, k, v residuals are
                  transposed copies that stand in for the ones counted above (the update's
                  XLA:CPU memory analysis vs this plan, layers 2-4, heads 2-4, 528-1040
                  tokens, softcap on/off: within 2% in f32, 5% under in bf16)
  Checked against XLA:CPU `memory_analysis()` of jax.grad of completion_logprobs over
  vocab / layers / mlp_dim / heads sweeps (with _LOGITS_GRAD_COPIES and one layer's
  backward scores): within 1% in f32, 5-15% under in bf16 (XLA:CPU upcasts bf16 math).

  lora_extra: bytes per token per layer that LoRA adds. A frozen W needs no dW, but dA needs
  the same input x, so the list above stands; each adapted projection adds x A ([r], c) and,
  since XLA fuses the y = xW + s (xA)B add into its consumers instead of materialising y, xW
  and s (xA)B are kept apart: one more [out] (c). XLA:CPU, f32, adapters on all 7
  projections (d=128, F=512, r=8): the LoRA update's temporaries are +7.6% over the
  full-parameter one's, and the plan with this term is within 2% of XLA (without it, 10%
  under); in bf16 XLA:CPU measured the LoRA backward 4% below the full-parameter one.
  """
  c = jnp.dtype(cfg.compute_dtype).itemsize
  d, f, hq, hkv, hd = cfg.d_model, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if transformer.uses_keys_major(seq):  # keys_major_attention's residuals
    probs = 4 + (4 if cfg.attn_logit_softcap else 0)
    out_f32, out_note = hq * hd * 4, " + HqD*4B"
  else:  # autodiff of dot_attention
    probs = 8 + (c if c != 4 else 0)
    out_f32, out_note = 0, ""
  per = ((4 * d + (hq + 2 * hkv) * hd + hq * hd + 5 * f) * c + 8 * d + hq * seq * probs
         + out_f32 + lora_extra)
  extra = f" + {lora_extra}B LoRA (xA, xW|s(xA)B split)" if lora_extra else ""
  formula = (f"[(4d+(Hq+2Hkv)D+HqD+5F)*{c}B + 8d + Hq*S*{probs}B{out_note}{extra}] = "
             f"{per / 1024:.1f} KiB/token/layer")
  return per, formula


def saved_activation_bytes(cfg: ModelConfig, seq: int, rows: int, *, lora_extra: int,
                           head_extra: int, remat: bool, remat_realised: bool) -> tuple[int, str]:
  """(bytes the backward keeps for `rows` sequences of `seq` tokens, its formula).

  lora_extra: LoRA's bytes per token per layer (see `layer_activation_bytes`); head_extra:
  per token, an adapted lm_head's x A. remat: config.rl.remat; remat_realised: whether the
  backend realises it (XLA:CPU was measured to realise almost none of it).
  """
  c = jnp.dtype(cfg.compute_dtype).itemsize
  L, d, hq = cfg.num_layers, cfg.d_model, cfg.num_heads
  per_tok, layer_formula = layer_activation_bytes(cfg, seq, lora_extra)
  tokens = rows * seq
  # Above the layers: the final norm's output (c) and f32 input, the embedding output, and
  # one layer's backward score temporaries (f32): two [Hq, S] per token under autodiff of
  # dot_attention, one (dP; P itself is a saved residual) under keys_major_attention.
  score_tmp = 4 if transformer.uses_keys_major(seq) else 8
  top = 2 * d * c + d * 4 + hq * seq * score_tmp + head_extra
  if remat_realised and remat:
    # Layer inputs [tokens, d] kept; the backward rebuilds one layer at a time.
    return (tokens * (L * d * c + per_tok + top),
            f"{rows} rows x S={seq} x (remat: L={L} layer inputs x d x {c}B "
            f"+ one layer {layer_formula})")
  # No remat, or XLA:CPU (measured to realise almost none of rl.remat's saving).
  formula = f"{rows} rows x S={seq} x L={L} x {layer_formula}"
  if remat:
    formula += " (rl.remat not realised on this backend)"
  return tokens * (L * per_tok + top), formula


def paged_sampler_lines(add, cfg: ModelConfig, label: str, rows: int, group: int, pw: int,
                        sp, pc: paged.PagedConfig, phase: str, c: int, hint: str,
                        gathered: tuple[int, str, str] | None) -> None:
  """KV page pool, all-gathered params and temporaries of rlx.sampler.paged for `rows`
  sequences on one shard, in groups of `group` sharing a prompt (1: no sharing).
  gathered: (bytes, dtype, hint) of the full params when shard_map all-gathers them."""
  L, hkv, hq, hd, V = (cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim,
                       cfg.vocab_size)
  d, f, t_new = cfg.d_model, cfg.mlp_dim, sp.max_new_tokens
  lay = paged._Layout.make(rows, group, pw, sp, pc)  # pylint: disable=protected-access
  add(f"{label} KV pool (paged)",
      2 * L * hkv * lay.num_pages * lay.page_size * hd * c,
      f"2 x L={L} x Hkv={hkv} x {lay.num_pages} pages x {lay.page_size} x D={hd} x {c}B "
      f"per shard ({rows} seqs, group {group}, {lay.slots} slots)", phase, hint)
  if gathered is not None:
    full, dtype, gather_hint = gathered
    add(f"{label} params (all-gathered)", full,
        f"paged shard_map reads params replicated: full {human(full)} ({dtype})", phase,
        gather_hint)
  # Transient, never live together (XLA:CPU buffer assignment, f32): one prefill chunk's
  # layer (its attention, or its MLP's gate / up / product beside the residual); admission's
  # partial-prompt-page copy, which reads one page per slot from every layer's K and V pool
  # (all 2L reads live at once, even with group 1 where nothing is copied); one decode layer's
  # attention over the slots (the "reference" kernel gathers each slot's pages: K and,
  # promoted to f32, V, [S, M pages x page size, Hkv, D], plus f32 scores); or the decode
  # logits. Persistent: the outputs (tokens, log-probs) and each group's last hidden state.
  chunk, slots = lay.prefill_chunk, lay.slots
  ctx = lay.pages_per_seq * lay.page_size
  prefill = chunk * pw * max(hq * pw * 8 + 4 * d * c, (d + 3 * f) * c)
  admit = 2 * L * hkv * slots * lay.page_size * hd * c
  gathers = pc.attention_impl == "reference" or (
      pc.attention_impl == "pallas" and jax.default_backend() == "cpu")
  attn = slots * hq * ctx * 4 + (slots * hkv * ctx * hd * (c + 4) if gathers else 0)
  logits = slots * V * 4 * 3
  persistent = rows * t_new * 8 + lay.num_groups * d * c
  attn_formula = (f"{slots} slots x ctx={ctx} x (Hkv*D*({c}+4)B gathered K,V + Hq*4B)"
                  if gathers else f"{slots} slots x ctx={ctx} x Hq*4B")
  add(f"{label} temporaries (paged)", max(prefill, admit, attn, logits) + persistent,
      f"max(prefill {chunk} prompts x P={pw} x max(Hq*P*8B + 4d*{c}B, (d+3F)*{c}B), admit "
      f"page copy 2L x {slots} slots x Hkv*{lay.page_size}*D*{c}B, decode attention "
      f"{attn_formula} ({pc.attention_impl}), {slots} slots x V x 4B x3) + outputs",
      phase, hint, estimate=True)


def dense_sampler_lines(add, cfg: ModelConfig, label: str, rows: int, pw: int, t_new: int,
                        phase: str, c: int, hint: str) -> None:
  """KV cache and temporaries of rlx.sampler.dense for `rows` sequences on one device."""
  seq = pw + t_new
  L, hkv, hq, hd, V = (cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim,
                       cfg.vocab_size)
  d, f = cfg.d_model, cfg.mlp_dim
  add(f"{label} KV cache (dense)", 2 * L * rows * seq * hkv * hd * c + rows * seq * 4,
      f"2 x L={L} x {rows} rows x S={seq} x Hkv={hkv} x D={hd} x {c}B + key_pos", phase, hint)
  # Prefill returns logits for every prompt position; one layer's activations live.
  tmp = (rows * pw * V * 4 + rows * hq * pw * pw * 8 + rows * pw * (4 * d + 3 * f) * c
         + rows * V * 4 * 3 + rows * t_new * 8)
  add(f"{label} temporaries (dense)", tmp,
      f"prefill: logits {rows} x P={pw} x V={V} x 4B, one layer (Hq*P^2*8B + "
      f"P*(4d+3F)*{c}B)/row; decode logits x3",
      phase, hint, estimate=True)
