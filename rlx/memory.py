"""Per-device memory plan of a run, from its config and mesh shape, before compiling anything.

    p = plan(config, model_cfg, {"data": 2, "fsdp": 8})   # any mesh size, no devices needed
    print(format_plan(p))                                  # table, peak, capacity, FITS
    check_fits(p)                                          # ConfigError when it cannot fit

What is resident depends on the phase of a step, so every line belongs to one:

  state      always resident: params, optimizer moments, reference params (kl_coef > 0),
             selector, prompt pool, replay ring.
  rollout    the sampler of one training step (KV cache / page pool, its temporaries).
  eval       rlx.evaluate.Evaluator: the run's sampler (sampler.impl), greedy, over
               `sampler.eval_batch_size` prompts; paged: group_size=1 (every prompt
               once), its own page pool per batch shard, params all-gathered under FSDP.
  update     both halves of the update: the training batch and its old / ref log-probs;
  logp         a no-grad forward over one minibatch (pi_old for minibatches after the
               first, whose pi_old comes from its own gradient pass; the KL reference);
  grad         one minibatch's forward + backward: saved activations, f32 logits (all T
               completion positions, or `rl.logprob_chunk` of them at a time), grads.

The peak is `state + max(rollout, eval, logp + update, grad + update)`. Parameters,
optimizer state and the replay ring are exact (their shapes and the sharding rules, as
`rlx.train.init_state` places them); KV caches follow the samplers' own layouts; activations
are estimates from the model code (see `_layer_activation_bytes`) times a safety margin
(`config.memory.activation_margin`, default 1.2). XLA's own temporaries (fusion and
collective buffers, weight casts hoisted out of loops) are not modelled.

LoRA (`config.lora.rank > 0`, rlx.model.lora): the state holds the frozen base (split like
params, in `lora.base_dtype`), the adapters (f32, replicated) as the trainable params and Adam
moments for the adapters only; there is no full-size gradient, no full-size optimizer state
and no reference copy for the KL term (the base with adapters off is the reference: one more
no-grad forward, as before). The backward keeps what the full-parameter one keeps (each
adapted projection's input x is needed for dA as it was for dW) plus, per adapted projection,
x A [tokens, r] and xW and s (xA)B apart ([tokens, out]; see `_layer_activation_bytes`): with
remat that is one layer's worth, a few percent. With `lora.merge_for_sampling` the rollout
(and eval) decodes with W + scale * A @ B merged once per rollout: one more copy of the
adapted weights, in the base dtype, live while sampling.

Remat (`rl.remat`): the backward keeps each layer's input and rebuilds one layer at a time.
XLA:CPU's scheduler realises almost none of that saving (measured: -6% of the update's
temporaries where the model predicts -50%), so on CPU the plan keeps the no-remat upper
bound; on TPU / GPU (or `remat_realised=True`) it counts layer inputs + one layer.

Paged sampler (rollout and eval): the page pool, the params all-gathered into its shard_map
under FSDP, and the transients of `_paged_sampler` (one prefill chunk's layer, admission's
page copy, one decode layer's attention -- the "reference" kernel gathers every slot's pages
-- or the decode logits, whichever is largest). In f32 the plan is within 3% of XLA:CPU's
compiled rollout and evaluation; in bf16 XLA:CPU keeps f32 copies of the bf16 pool and of
the weights (it upcasts bf16 scatters and matmuls), a CPU artefact the plan does not model.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from jax.sharding import AbstractMesh

from rlx import configs
from rlx import sharding as shd
from rlx import train
from rlx.model import lora as lora_lib
from rlx.model import transformer
from rlx.model.config import ModelConfig
from rlx.rl import replay as replay_lib
from rlx.rl import selection
from rlx.sampler import paged

# f32 [tokens, V] buffers: in the backward, logits, log-softmax, softmax (for its grad) and
# the logits' gradient; in the pi_old forward, logits and log-softmax (measured, XLA:CPU).
_LOGITS_GRAD_COPIES = 2  # XLA:CPU, picked - logsumexp form: measured 2.0 (full) / 2.1 (chunked)
_LOGITS_FWD_COPIES = 2
PHASES = ("rollout", "eval", "logp", "grad")  # never live at the same time
_LIVE_IN = {"state": PHASES, "rollout": ("rollout",), "eval": ("eval",),
            "update": ("logp", "grad"), "logp": ("logp",), "grad": ("grad",)}
DEFAULT_ACTIVATION_MARGIN = 1.2

_HINT_FSDP = "more FSDP (config.mesh.fsdp)"
_HINT_BF16 = "bf16 master weights (config.model.param_dtype='bfloat16')"
_HINT_PROMPTS = "fewer config.rl.prompts_per_step (or a smaller rl.group_size)"
_HINT_MINIBATCH = ("config.rl.update_micro_rows (gradient accumulation, same step) or more "
                   "config.rl.num_minibatches")
_HINT_POOL = ("a smaller KV pool (config.sampler.num_pages / max_slots) or a shorter "
              "sampler.max_new_tokens")
_HINT_REPLAY = "a smaller config.replay.capacity"
_HINT_EVAL = "a smaller config.sampler.eval_batch_size"
_HINT_LORA = ("LoRA (config.lora.rank > 0): a frozen base, optimizer state and gradients for "
              "the adapters only")
_HINT_LORA_BF16 = "a bf16 frozen base (config.lora.base_dtype='bfloat16')"
_HINT_LORA_RANK = "a smaller config.lora.rank or fewer config.lora.targets"
_HINT_MERGE = ("config.lora.merge_for_sampling=False (the sampler takes the unmerged low-rank "
               "path: no merged copy)")
_HINT_REMAT = "config.rl.remat=True (on TPU/GPU)"
_ALL_HINTS = (_HINT_FSDP, _HINT_PROMPTS, _HINT_MINIBATCH, _HINT_BF16, _HINT_POOL)


@dataclasses.dataclass(frozen=True)
class MemoryItem:
  name: str
  bytes: int  # per device (estimated lines include the safety margin)
  formula: str  # how it was computed
  phase: str  # a key of _LIVE_IN
  hint: str = ""  # what shrinks it


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  items: tuple[MemoryItem, ...]
  capacity_bytes: int
  capacity_source: str
  mesh_shape: dict[str, int]
  activation_margin: float
  notes: tuple[str, ...] = ()

  def phase_bytes(self) -> dict[str, int]:
    """Bytes live during each phase (state included)."""
    return {ph: sum(it.bytes for it in self.items if ph in _LIVE_IN[it.phase])
            for ph in PHASES}

  @property
  def peak_phase(self) -> str:
    totals = self.phase_bytes()
    return max(PHASES, key=lambda ph: totals[ph])

  @property
  def total_bytes(self) -> int:
    """The peak over phases: what one device must hold."""
    return self.phase_bytes()[self.peak_phase]

  @property
  def headroom_bytes(self) -> int:
    return self.capacity_bytes - self.total_bytes

  @property
  def fits(self) -> bool:
    return self.total_bytes <= self.capacity_bytes

  def item(self, name: str) -> MemoryItem:
    for it in self.items:
      if it.name == name:
        return it
    raise KeyError(f"no memory item {name!r}; items are {[it.name for it in self.items]}")


# ----------------------------------------------------------------------------- capacity


def device_memory_bytes(override: int = 0) -> tuple[int, str]:
  """(bytes one device may use, where that number came from).

  override (config.memory.device_bytes) > 0 wins; else the accelerator's `bytes_limit`; else
  (CPU) the host's RAM divided by the local device count.
  """
  if override < 0:
    raise configs.ConfigError(f"config.memory.device_bytes={override}; expected 0 (auto) or "
                              "a positive byte count.")
  if override:
    return override, "config.memory.device_bytes"
  dev = jax.devices()[0]
  try:
    stats = dev.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  (some backends do not implement it)
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{dev.platform} bytes_limit"
  host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  n = jax.local_device_count()
  return host // n, f"host RAM / {n} local {dev.platform} device(s)"


# ----------------------------------------------------------------------------- helpers


def _nbytes(x) -> int:
  return int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _check_mesh(mesh_shape: Mapping[str, int]) -> dict[str, int]:
  bad = sorted(set(mesh_shape) - set(shd.AXES))
  if bad:
    raise configs.ConfigError(f"mesh_shape has unknown axes {bad}; expected a subset of "
                              f"{shd.AXES}.")
  sizes = {a: mesh_shape.get(a, 1) for a in shd.AXES}
  for a, s in sizes.items():
    if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1:
      raise configs.ConfigError(f"mesh_shape[{a!r}]={s!r}; expected a positive int (resolve "
                                "-1 to the device count before planning).")
  return {a: int(s) for a, s in sizes.items()}


def _param_splits(abstract_params, mesh: AbstractMesh, rules) -> dict[str, tuple[Any, int]]:
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


def _like_params_bytes(tree, splits: dict[str, tuple[Any, int]]) -> int:
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
    total += _nbytes(leaf) // split
  return total


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _layer_activation_bytes(cfg: ModelConfig, seq: int,
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


def _out_dim(tree, path: str) -> int:
  """The output dimension of the [in, out] weight at `path` ("layer_0/attn/q_proj")."""
  for k in path.split("/"):
    tree = tree[k]
  return int(tree.shape[-1])


def human(n: float) -> str:
  """Bytes as KiB / MiB / GiB."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"


# ----------------------------------------------------------------------------- plan


def lora_targets(abstract_params, lc: lora_lib.LoRAConfig) -> list[str]:
  """The paths config.lora adapts in a model of these (abstract) params; a ConfigError if
  its targets match nothing usable or its rank exceeds a matrix's smaller side."""
  try:
    targets = lora_lib.target_paths(abstract_params, lc)
  except ValueError as e:
    raise configs.ConfigError(f"config.lora.targets: {e}") from None
  try:
    lora_lib.check_rank(abstract_params, lc, targets)
  except ValueError as e:
    raise configs.ConfigError(f"config.lora.{e}") from None
  return targets


def plan(config: configs.RunSpec | mlc.ConfigDict, model_cfg: ModelConfig,
         mesh_shape: Mapping[str, int], *,
         num_prompts: int | None = None, prompt_width: int | None = None,
         num_groups: int | None = None,
         rules=shd.DEFAULT_RULES, remat_realised: bool | None = None) -> MemoryPlan:
  """Per-device bytes of a run of `config` with `model_cfg` on a mesh of `mesh_shape`.

  mesh_shape: e.g. {"data": 2, "fsdp": 8} (missing axes are 1); it need not match the
    devices present. num_prompts: size of the RL prompt pool (None: estimated from
    config.task as num_train_per_level x ops x rl_levels). prompt_width: the pool's prompt
    width (None: config.sampler.max_prompt_len). remat_realised: whether `rl.remat` shrinks
    the backward's saved activations to layer inputs + one layer (None: rl.remat on a
    non-CPU backend; XLA:CPU was measured to realise almost none of it).
  """
  spec = configs.resolve(config)
  sizes = _check_mesh(mesh_shape)
  mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
  nb = sizes["data"] * sizes["fsdp"]  # devices the batch is split over
  margin = spec.memory.activation_margin
  if margin < 1.0:
    raise configs.ConfigError(f"config.memory.activation_margin={margin}; expected >= 1.0.")
  capacity, source = device_memory_bytes(spec.memory.device_bytes)

  rl, s = spec.rl, spec.sampler
  loss = rl.loss
  sel = spec.selection
  rep = spec.replay
  sp = s.sampling(eos_id=0, pad_id=0)
  pw = int(prompt_width if prompt_width is not None else s.max_prompt_len)
  t_new = int(s.max_new_tokens)
  seq = pw + t_new
  g = int(rl.group_size)
  if num_prompts is None:
    task = spec.task
    num_prompts = (task.num_train_per_level * max(len(task.ops), 1)
                   * len(task.rl_levels or task.levels))
  n_prompts = int(num_prompts)

  cfg = model_cfg
  c = jnp.dtype(cfg.compute_dtype).itemsize
  w = jnp.dtype(cfg.weight_dtype).itemsize
  L, hkv, hq, hd, d, V = (cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim,
                          cfg.d_model, cfg.vocab_size)
  items: list[MemoryItem] = []

  def add(name, nbytes, formula, phase, hint="", estimate=False):
    if estimate:
      nbytes = int(nbytes * margin)
      formula = f"{formula} x{margin:g} margin"
    items.append(MemoryItem(name, int(nbytes), formula, phase, hint))

  # ---- state: exact, from abstract shapes and the sharding rules.
  _, abstract = transformer.abstract_params(cfg)
  splits = _param_splits(abstract, mesh, rules)
  params_full = sum(_nbytes(x) for x, _ in splits.values())
  params_dev = sum(_nbytes(x) // sp_ for x, sp_ in splits.values())
  n_split = sum(1 for _, sp_ in splits.values() if sp_ > 1)
  split_note = (f"{n_split}/{len(splits)} leaves split by spec_for" if n_split else
                "replicated")
  o = spec.optim
  tx = train.make_optimizer(o.lr, spec.total_steps, warmup_steps=o.warmup_steps,
                            schedule=o.schedule, weight_decay=o.weight_decay,
                            grad_clip=o.grad_clip, b1=o.b1, b2=o.b2)
  lc = spec.lora
  # LoRA: the adapters' extra saved activations per token, summed over the layers.
  lora_act = head_act = 0
  if lc is None:
    add("params", params_dev,
        f"{cfg.num_params() / 1e6:.1f}M x {w}B ({cfg.param_dtype}), {split_note}", "state",
        f"{_HINT_FSDP}; {_HINT_BF16}; {_HINT_LORA}")
    opt_abstract = jax.eval_shape(tx.init, abstract)
    opt_dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(opt_abstract) if x.ndim})
    add("optimizer (adamw mu, nu)", _like_params_bytes(opt_abstract, splits),
        f"2 x params-shaped ({'/'.join(opt_dtypes)}), split like params, + count", "state",
        f"{_HINT_LORA}; {_HINT_FSDP}; {_HINT_BF16}")
    if loss.kl_coef > 0:
      add("reference params (kl_coef > 0)", params_dev, "= params", "state",
          "config.rl.kl_coef=0 (no reference model)")
    sample_full, sample_dtype = params_full, cfg.param_dtype
  else:
    bdt = jnp.dtype(lc.base_dtype or cfg.weight_dtype)
    base_abs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, bdt) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, abstract)
    base_splits = _param_splits(base_abs, mesh, rules)
    base_dev = sum(_nbytes(x) // sp_ for x, sp_ in base_splits.values())
    sample_full, sample_dtype = sum(_nbytes(x) for x, _ in base_splits.values()), bdt.name
    targets = lora_targets(abstract, lc)
    adapters = jax.eval_shape(lambda p: lora_lib.init_adapters(p, lc), abstract)
    ad_bytes = sum(_nbytes(x) for x in jax.tree.leaves(adapters))  # replicated
    ad_n = sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))
    add(f"frozen base ({bdt.name}, LoRA)", base_dev,
        f"{cfg.num_params() / 1e6:.1f}M x {bdt.itemsize}B ({bdt.name}), {split_note}",
        "state", f"{_HINT_FSDP}; {_HINT_LORA_BF16}")
    add(f"params: LoRA adapters (r={lc.rank})", ad_bytes,
        f"{ad_n / 1e6:.2f}M = r x (in + out) over {len(targets)} matrices x 4B (f32), "
        "replicated", "state", _HINT_LORA_RANK)
    opt_abstract = jax.eval_shape(tx.init, adapters)
    opt_dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(opt_abstract) if x.ndim})
    add("optimizer (adamw mu, nu)", sum(_nbytes(x) for x in jax.tree.leaves(opt_abstract)),
        f"2 x adapter-shaped ({'/'.join(opt_dtypes)}), replicated, + count; none for the base",
        "state", _HINT_LORA_RANK)
    # (kl_coef > 0: no reference params; the base with adapters off is the reference.)
    # Per adapted projection and token the backward keeps x A [r] and, as XLA fuses the
    # y = xW + s (xA)B add into its consumers, xW and s (xA)B apart: one more [out] (c).
    lora_act = sum((lc.rank + _out_dim(abstract, t)) * c for t in targets
                   if t.startswith("layer_"))
    head_act = lc.rank * c if "lm_head" in targets else 0
  n_groups = int(num_groups) if num_groups else max(len(spec.task.levels), 1)
  sel_bytes = sum(_nbytes(x) for x in jax.tree.leaves(jax.eval_shape(
      lambda: selection.SelectorState.init(max(n_prompts, 1), None, n_groups,
                                           spread=spec.selection.bucket_score == "spread"))))
  add("selector", sel_bytes if n_prompts else 0,
      f"{n_prompts} prompts x (5 x 4B + 1B) + {n_groups} buckets x 4B, replicated", "state")
  add("prompt pool", n_prompts * (pw + t_new + 3) * 4,
      f"{n_prompts} x (P={pw} + A={t_new} + 3) x 4B, replicated", "state")
  if rep is not None:
    ring = jax.eval_shape(lambda: replay_lib.ReplayState.init(rep.capacity, pw, t_new))
    ring_dev = sum(_cdiv(_nbytes(x), nb) if x.ndim else _nbytes(x)
                   for x in jax.tree.leaves(ring))
    add("replay ring", ring_dev,
        f"capacity {rep.capacity} x ((P={pw} + 2T) x 4B + 37B) / {nb} batch devices", "state",
        _HINT_REPLAY)

  # ---- rollout: the step's sampler.
  rows = sel.groups_sampled_factor * int(rl.prompts_per_step) * g
  local = _cdiv(rows, nb)
  # The paged sampler runs per batch shard under shard_map and reads the params replicated
  # (P()): FSDP-split params are all-gathered once per call, in the dtype sampled with.
  gathered = None
  if nb > 1 and params_dev < params_full:
    gathered = (sample_full, sample_dtype, _HINT_BF16 if lc is None else _HINT_LORA_BF16)
  if s.impl == "paged":
    _paged_sampler(add, cfg, "sampler", local, math.gcd(g, local), pw, sp, s.paged,
                   "rollout", c, _HINT_POOL, gathered)
  else:
    _dense_sampler(add, cfg, "sampler", local, pw, t_new, "rollout", c, _HINT_PROMPTS)

  # ---- eval: rlx.evaluate.Evaluator decodes `sampler.eval_batch_size` prompts at a time
  # with the run's sampler (greedy); paged: every prompt once (group_size=1), per shard.
  eval_local = _cdiv(int(s.eval_batch_size), nb)
  if s.impl == "paged":
    _paged_sampler(add, cfg, "eval sampler", eval_local, 1, pw, sp, s.paged, "eval", c,
                   _HINT_EVAL, gathered)
  else:
    _dense_sampler(add, cfg, "eval sampler", eval_local, pw, t_new, "eval", c, _HINT_EVAL)

  # ---- LoRA, merged for sampling: W + scale * A @ B for every adapted matrix, in the base
  # dtype and split like the base, built once per rollout (and per eval); the product is
  # formed in f32 one matrix at a time.
  if lc is not None and lc.merge_for_sampling:
    mdt = jnp.dtype(lc.merge_dtype) if lc.merge_dtype else bdt  # the wider of base, compute
    merged = sum(math.prod(base_splits[t][0].shape) * mdt.itemsize // base_splits[t][1]
                 for t in targets)
    big_t = max(targets, key=lambda t: _nbytes(base_splits[t][0]) // base_splits[t][1])
    big_leaf, big_s = base_splits[big_t]
    delta = math.prod(big_leaf.shape) * 4 // big_s
    for phase in ("rollout", "eval"):
      add(f"merged adapted weights ({phase})", merged + delta,
          f"{len(targets)} matrices x {mdt.itemsize}B ({mdt.name}) split like the base + f32 A@B of "
          f"{big_t} {tuple(big_leaf.shape)}", phase, _HINT_MERGE)

  # ---- update (rlx.train.update): log-probs only at the T completion positions, chunk by
  # chunk; pi_old from the first minibatch's gradient pass (a forward pass runs only for the
  # other minibatches, and for the KL reference), one minibatch live at a time.
  rl_spec = spec.rl
  train_rows = int(rl.prompts_per_step) * g + (rep.num_samples if rep else 0)
  rows_dev = _cdiv(train_rows, nb)
  mb_rows = _cdiv(train_rows, int(rl.num_minibatches) * nb)
  c_lp = min(rl_spec.logprob_chunk, t_new) if rl_spec.logprob_chunk else t_new
  chunk_note = (f"chunk {c_lp} of T={t_new}" if c_lp < t_new else f"T={t_new}")
  logp_copies = 3 if loss.kl_coef > 0 else 2  # behaviour, old (and ref) log-probs
  per_row = pw * 4 + t_new * (4 + 4 * logp_copies + 1) + 12 * 4
  add("training batch (+ minibatch copy)", 2 * rows_dev * per_row,
      f"2 x {rows_dev} rows x (P*4 + T*{4 + 4 * logp_copies + 1} + 48)B", "update")
  micro = rl_spec.update_micro_rows
  if int(rl.num_minibatches) == 1 and 0 < micro < train_rows:
    # Gradient accumulation (`train.update_shape`): one micro-batch's activations live at a
    # time, the fewest equal parts of <= micro rows that split over the batch devices.
    mb_rows = _cdiv(train_rows // train.micro_parts(
        train_rows, micro, nb, rl_spec.update_parts), nb)
  forward_passes = []
  if not rl_spec.fuse_pi_old or int(rl.num_minibatches) > 1:
    forward_passes.append("pi_old")
  if loss.kl_coef > 0:
    forward_passes.append("reference")
  one_layer = (mb_rows * seq * (4 * d + (hq + 2 * hkv) * hd + 3 * cfg.mlp_dim) * c
               + mb_rows * hq * seq * seq * 8)
  if forward_passes:
    add(f"{' + '.join(forward_passes)} forward (one minibatch, no grad)",
        max(mb_rows * c_lp * V * 4 * _LOGITS_FWD_COPIES, one_layer) + mb_rows * seq * d * c,
        f"max({mb_rows} rows x {chunk_note} x V={V} x 4B x{_LOGITS_FWD_COPIES}, one layer) "
        "+ hidden", "logp", _HINT_MINIBATCH, estimate=True)
  if lc is None:
    add("gradients", params_dev, "= params (param dtype, reduce-scattered like params)",
        "grad", f"{_HINT_FSDP}; {_HINT_BF16}; {_HINT_LORA}")
  else:
    add("gradients (adapters)", ad_bytes,
        "= adapters (f32, replicated); the frozen base gets none", "grad", _HINT_LORA_RANK)
  per_tok, layer_formula = _layer_activation_bytes(cfg, seq, lora_act // L if lc else 0)
  tokens_mb = mb_rows * seq
  if remat_realised is None:
    remat_realised = bool(rl_spec.remat) and jax.default_backend() != "cpu"
  # Above the layers: the final norm's output (c) and f32 input, the embedding output, and
  # one layer's backward score temporaries (f32): two [Hq, S] per token under autodiff of
  # dot_attention, one (dP; P itself is a saved residual) under keys_major_attention.
  score_tmp = 4 if transformer.uses_keys_major(seq) else 8
  top = 2 * d * c + d * 4 + hq * seq * score_tmp + head_act
  if remat_realised and rl_spec.remat:
    # Layer inputs [tokens, d] kept; the backward rebuilds one layer at a time.
    saved = tokens_mb * (L * d * c + per_tok + top)
    saved_formula = (f"{mb_rows} rows x S={seq} x (remat: L={L} layer inputs x d x {c}B "
                     f"+ one layer {layer_formula})")
    hint = _HINT_MINIBATCH
  else:
    # No remat, or XLA:CPU (measured to realise almost none of rl.remat's saving).
    saved = tokens_mb * (L * per_tok + top)
    saved_formula = f"{mb_rows} rows x S={seq} x L={L} x {layer_formula}"
    if rl_spec.remat:
      saved_formula += " (rl.remat not realised on this backend)"
    hint = f"{_HINT_REMAT}; {_HINT_MINIBATCH}"
  add("saved activations (backward)", saved + mb_rows * seq * seq,
      saved_formula + " + one layer's score grads", "grad", hint, estimate=True)
  copies = _LOGITS_GRAD_COPIES + (1 if head_act else 0)  # adapted lm_head: xW, s(xA)B apart
  add(f"f32 logits x{copies} (minibatch)",
      mb_rows * c_lp * V * 4 * copies,
      f"{mb_rows} rows x {chunk_note} x V={V} x 4B x{copies} (logits, "
      f"logsumexp / its grad{', adapted lm_head' if head_act else ''})", "grad",
      f"config.rl.logprob_chunk (e.g. 128); {_HINT_MINIBATCH}", estimate=True)
  big_name, (big, big_split) = max(splits.items(), key=lambda kv: _nbytes(kv[1][0]))
  if big_split > 1:
    n = int(math.prod(big.shape))
    if lc is None:
      add("FSDP gather + grad partial (largest weight)", n * (c + w),
          f"{big_name} {tuple(big.shape)} gathered ({c}B) + unreduced grad ({w}B)", "grad",
          _HINT_BF16)
    else:
      add("FSDP gather (largest weight)", n * c,
          f"{big_name} {tuple(big.shape)} gathered ({c}B); frozen: no weight gradient",
          "grad", _HINT_FSDP)

  notes = (
      "Exact: params, optimizer, reference params, replay ring, selector, pool (shapes + "
      "sharding rules). KV: the samplers' own layouts.",
  ) + ((
      f"LoRA r={lc.rank}, alpha={lc.alpha:g}: frozen base in {bdt.name}, adapters + their "
      "Adam moments f32; no full-size gradient / optimizer state; no reference copy (the "
      "base with adapters off is the KL reference).",) if lc else ()) + (
      f"Estimated (x{margin:g} margin, config.memory.activation_margin): sampler "
      "temporaries, pi_old forward, saved activations, logits.",
      "Not modelled: XLA temporaries (fusion / collective buffers, weight casts hoisted out "
      "of loops, FSDP all-gathers kept for the backward), compiled-code and runtime memory.",
  )
  return MemoryPlan(items=tuple(items), capacity_bytes=int(capacity), capacity_source=source,
                    mesh_shape=dict(sizes), activation_margin=margin, notes=notes)


def plan_overlap(config: configs.RunSpec | mlc.ConfigDict, model_cfg: ModelConfig,
                 gen_shape: Mapping[str, int], learn_shape: Mapping[str, int],
                 **kw) -> tuple[MemoryPlan, MemoryPlan]:
  """(generator plan, learner plan) of an overlap-mode run (rlx.pipeline), per device of each
  sub-mesh.

  generator  its copy of the policy (the params, or LoRA's merged weights, split on its
             sub-mesh by the same rules), the selector snapshot, the prompt pool, the
             rollout's and evaluation's sampler, and the batch it just generated;
  learner    the training state (`plan` on the learner's sub-mesh without the sampler
             phases and the prompt pool) plus the max_staleness batches in flight, which
             live on the learner from their dispatch until they are trained on.
  """
  spec = configs.resolve(config)
  k = spec.pipeline.max_staleness
  gen_full = plan(spec, model_cfg, gen_shape, **kw)
  learn_full = plan(spec, model_cfg, learn_shape, **kw)
  pw = int(kw.get("prompt_width") or spec.sampler.max_prompt_len)
  t_new = int(spec.sampler.max_new_tokens)
  rows = (spec.selection.groups_sampled_factor * spec.rl.prompts_per_step *
          spec.rl.group_size)
  # InFlight: prompts, completions, behaviour log-probs and 8 per-row scalars (4B each).
  per_row = (pw + 2 * t_new + 8) * 4
  gen_nb = _check_mesh(gen_shape)
  learn_nb = _check_mesh(learn_shape)
  gen_rows = _cdiv(rows, gen_nb["data"] * gen_nb["fsdp"])
  learn_rows = _cdiv(rows, learn_nb["data"] * learn_nb["fsdp"])
  inflight = lambda r: f"{r} rows x (P={pw} + 2T={2 * t_new} + 8) x 4B"

  sampling = ("rollout", "eval")
  merged = [it for it in gen_full.items if it.name.startswith("merged adapted weights")]
  gen_items = []
  for it in gen_full.items:
    if it.name in ("params", "selector", "prompt pool") or (
        it.phase in sampling and it not in merged):
      gen_items.append(it)
    elif it.name.startswith("frozen base"):  # LoRA: the generator holds the merged policy
      extra = merged[0].bytes if merged else 0
      gen_items.append(dataclasses.replace(
          it, name="policy copy (LoRA merged)", bytes=it.bytes + extra,
          formula=f"{it.formula} + merged adapted weights"))
  gen_items = [dataclasses.replace(it, name="policy copy (params)") if it.name == "params"
               else it for it in gen_items]
  gen_items.append(MemoryItem("generated batch (before its transfer)",
                              gen_rows * per_row, inflight(gen_rows), "rollout"))
  learn_items = [it for it in learn_full.items
                 if it.phase not in sampling and it.name != "prompt pool"]
  learn_items.append(MemoryItem(f"batches in flight (max_staleness={k})",
                                k * learn_rows * per_row, f"{k} x {inflight(learn_rows)}",
                                "state", "a smaller config.pipeline.max_staleness"))
  note = ("Overlap mode (config.pipeline): the generator and learner sub-meshes hold different "
          "things; each is planned on its own devices.",)
  return (dataclasses.replace(gen_full, items=tuple(gen_items), notes=note + gen_full.notes),
          dataclasses.replace(learn_full, items=tuple(learn_items),
                              notes=note + learn_full.notes))


def _paged_sampler(add, cfg: ModelConfig, label: str, rows: int, group: int, pw: int,
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


def _dense_sampler(add, cfg: ModelConfig, label: str, rows: int, pw: int, t_new: int,
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


# ----------------------------------------------------------------------------- report


def format_plan(p: MemoryPlan) -> str:
  """A table of the plan's lines, per-phase totals, capacity, headroom and the verdict."""
  mesh = " x ".join(f"{a}={n}" for a, n in p.mesh_shape.items())
  name_w = max(len(it.name) for it in p.items)
  lines = [f"memory plan per device, mesh {mesh} ({math.prod(p.mesh_shape.values())} devices)",
           f"  {'item':<{name_w}}  {'phase':<7}  {'bytes':>11}  how"]
  for it in p.items:
    lines.append(f"  {it.name:<{name_w}}  {it.phase:<7}  {human(it.bytes):>11}  {it.formula}")
  totals = p.phase_bytes()
  lines.append("  live per phase: " + ", ".join(
      f"{ph} {human(totals[ph])}" for ph in PHASES))
  verdict = "FITS" if p.fits else "DOES NOT FIT"
  lines.append(f"  peak {human(p.total_bytes)} ({p.peak_phase}) / capacity "
               f"{human(p.capacity_bytes)} ({p.capacity_source}): headroom "
               f"{human(p.headroom_bytes)} -> {verdict}")
  lines += [f"  note: {n}" for n in p.notes]
  return "\n".join(lines)


def check_fits(p: MemoryPlan) -> None:
  """Raises ConfigError naming the peak, the capacity, the 3 largest lines and what to change."""
  if p.fits:
    return
  live = [it for it in p.items if p.peak_phase in _LIVE_IN[it.phase]]
  top = sorted(live, key=lambda it: it.bytes, reverse=True)[:3]
  hints: list[str] = []
  for h in [part for it in top for part in it.hint.split("; ") if part] + list(_ALL_HINTS):
    if h not in hints:
      hints.append(h)
  mesh = ", ".join(f"{a}={n}" for a, n in p.mesh_shape.items())
  raise configs.ConfigError(
      f"the run needs {human(p.total_bytes)} per device at its peak ({p.peak_phase} phase) "
      f"but a device has {human(p.capacity_bytes)} ({p.capacity_source}) on mesh {{{mesh}}}; "
      f"largest: " + ", ".join(f"{it.name} {human(it.bytes)}" for it in top)
      + "; try " + ", ".join(hints) + ".")
