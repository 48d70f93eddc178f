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
are estimates from the model code (see `rlx.memory_model.layer_activation_bytes`) times a
safety margin (`config.memory.activation_margin`, default 1.2). XLA's own temporaries (fusion and
collective buffers, weight casts hoisted out of loops) are not modelled.

LoRA (`config.lora.rank > 0`, rlx.model.lora): the state holds the frozen base (split like
params, in `lora.base_dtype`), the adapters (f32, replicated) as the trainable params and Adam
moments for the adapters only; there is no full-size gradient, no full-size optimizer state
and no reference copy for the KL term (the base with adapters off is the reference: one more
no-grad forward, as before). The backward keeps what the full-parameter one keeps (each
adapted projection's input x is needed for dA as it was for dW) plus, per adapted projection,
x A [tokens, r] and xW and s (xA)B apart ([tokens, out]; see
`rlx.memory_model.layer_activation_bytes`): with remat that is one layer's worth, a few
percent. With `lora.merge_for_sampling` the rollout (and eval) decodes with W + scale * A @ B
merged once per rollout: one more copy of the adapted weights, in the base dtype, live while
sampling.

Compute dtype below the params' (f32 masters under bf16 compute: config.model.dtype="auto" on
a GPU or TPU): the rollout and eval decode with a copy of the weight matrices cast to it once
per call (rlx.step_state.sampling_copy), split like the matrices: one line per phase. The KV
cache is in the compute dtype. Both samplers then concatenate each layer's q/k/v and gate/up
matrices once per call (one matmul each per decoded token): one more copy of those, per phase.

Remat (`rl.remat`) and the samplers' KV caches and temporaries: rlx.memory_model holds the
byte formulas the plan adds up, derived from the model and sampler code.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections as mlc
from jax.sharding import AbstractMesh

from rlx import configs
from rlx import memory_model
from rlx import sharding as shd
from rlx import train
from rlx.memory_model import (cdiv, check_mesh, human, like_params_bytes, nbytes, out_dim,
                              param_splits)
from rlx.model import lora as lora_lib
from rlx.model import transformer
from rlx.model.config import ModelConfig
from rlx.rl import replay as replay_lib
from rlx.rl import selection

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
_HINT_MINIBATCH = ("config.update_shape.micro_rows (gradient accumulation, same step) or more "
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


@dataclasses.dataclass
class _Lines:
  """The plan's lines in the order they are added; estimated ones carry the safety margin."""
  margin: float
  items: list[MemoryItem] = dataclasses.field(default_factory=list)

  def add(self, name, nbytes, formula, phase, hint="", estimate=False):
    if estimate:
      nbytes = int(nbytes * self.margin)
      formula = f"{formula} x{self.margin:g} margin"
    self.items.append(MemoryItem(name, int(nbytes), formula, phase, hint))


@dataclasses.dataclass(frozen=True)
class _Run:
  """What every phase of the plan reads: the resolved spec, the model and the run's shapes."""
  spec: configs.RunSpec
  cfg: ModelConfig
  mesh: AbstractMesh
  rules: Any
  nb: int  # devices the batch is split over
  pw: int  # prompt width
  t_new: int  # completion tokens
  n_prompts: int  # RL prompt pool
  n_groups: int  # selector buckets

  @property
  def seq(self) -> int:
    return self.pw + self.t_new

  @property
  def c(self) -> int:  # compute dtype bytes
    return jnp.dtype(self.cfg.compute_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class _Weights:
  """What the state phase found about the weights that the later phases need."""
  splits: dict[str, tuple[Any, int]]  # the params: path -> (abstract leaf, devices split over)
  params_full: int
  params_dev: int
  sample_full: int  # bytes of the weights the sampler reads (the frozen base under LoRA)
  sample_dtype: str
  # The sampler's copy of the matrices cast to the compute dtype (rlx.step_state.
  # sampling_copy: f32 masters under bf16 compute), per device, and the per-device bytes of
  # the leaves it is cast from; 0: the sampler reads the weights as stored.
  copy_dev: int = 0
  copy_from_dev: int = 0
  # LoRA only (config.lora.rank > 0):
  base_splits: dict[str, tuple[Any, int]] | None = None
  base_dtype: Any = None
  targets: tuple[str, ...] = ()
  adapter_bytes: int = 0
  lora_act: int = 0  # extra saved activations per token, summed over the layers
  head_act: int = 0  # the same for an adapted lm_head


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
  return plan_with_weights(config, model_cfg, mesh_shape, num_prompts=num_prompts,
                           prompt_width=prompt_width, num_groups=num_groups, rules=rules,
                           remat_realised=remat_realised)[0]


def plan_with_weights(config, model_cfg: ModelConfig, mesh_shape: Mapping[str, int], *,
                      num_prompts=None, prompt_width=None, num_groups=None,
                      rules=shd.DEFAULT_RULES, remat_realised=None) -> tuple[MemoryPlan, _Weights]:
  """`plan`, and what it found about the weights (rlx.memory_overlap reads the sampling
  copy)."""
  spec = configs.resolve(config)
  sizes = check_mesh(mesh_shape)
  margin = spec.memory.activation_margin
  if margin < 1.0:
    raise configs.ConfigError(f"config.memory.activation_margin={margin}; expected >= 1.0.")
  capacity, source = device_memory_bytes(spec.memory.device_bytes)
  run = _run_shapes(spec, model_cfg, sizes, rules, num_prompts, prompt_width, num_groups)
  lines = _Lines(margin)
  weights = _sampling_copy(run, _weight_lines(run, lines))
  _pool_lines(run, lines)
  _sampler_lines(run, weights, lines)
  _merged_lines(run, weights, lines)
  _probe_lines(run, lines)
  mb_rows = _logp_lines(run, lines)
  _grad_lines(run, weights, mb_rows, lines, remat_realised)
  _scan_lines(run, weights, lines)
  return MemoryPlan(items=tuple(lines.items), capacity_bytes=int(capacity),
                    capacity_source=source, mesh_shape=dict(sizes), activation_margin=margin,
                    notes=_notes(spec.lora, weights, margin)), weights


def _run_shapes(spec: configs.RunSpec, cfg: ModelConfig, sizes: dict[str, int], rules,
                num_prompts: int | None, prompt_width: int | None,
                num_groups: int | None) -> _Run:
  if num_prompts is None:
    task = spec.task
    num_prompts = (task.num_train_per_level * max(len(task.ops), 1)
                   * len(task.rl_levels or task.levels))
  return _Run(
      spec=spec, cfg=cfg, mesh=AbstractMesh(tuple(sizes.values()), tuple(sizes)), rules=rules,
      nb=sizes["data"] * sizes["fsdp"],
      pw=int(prompt_width if prompt_width is not None else spec.sampler.max_prompt_len),
      t_new=int(spec.sampler.max_new_tokens), n_prompts=int(num_prompts),
      n_groups=int(num_groups) if num_groups else max(len(spec.task.levels), 1))


# ---- state: exact, from abstract shapes and the sharding rules.


def _weight_lines(run: _Run, lines: _Lines) -> _Weights:
  """Params (or LoRA's frozen base and adapters), optimizer state, reference params."""
  cfg, spec = run.cfg, run.spec
  _, abstract = transformer.abstract_params(cfg)
  splits = param_splits(abstract, run.mesh, run.rules)
  params_full = sum(nbytes(x) for x, _ in splits.values())
  params_dev = sum(nbytes(x) // sp_ for x, sp_ in splits.values())
  n_split = sum(1 for _, sp_ in splits.values() if sp_ > 1)
  split_note = (f"{n_split}/{len(splits)} leaves split by spec_for" if n_split else
                "replicated")
  o = spec.optim
  tx = train.make_optimizer(o.lr, spec.total_steps, warmup_steps=o.warmup_steps,
                            schedule=o.schedule, weight_decay=o.weight_decay,
                            grad_clip=o.grad_clip, b1=o.b1, b2=o.b2)
  w = jnp.dtype(cfg.weight_dtype).itemsize
  weights = _Weights(splits, params_full, params_dev, params_full, cfg.param_dtype)
  if spec.lora is not None:
    return _lora_weight_lines(run, abstract, tx, weights, split_note, lines)
  lines.add("params", params_dev,
            f"{cfg.num_params() / 1e6:.1f}M x {w}B ({cfg.param_dtype}), {split_note}", "state",
            f"{_HINT_FSDP}; {_HINT_BF16}; {_HINT_LORA}")
  opt_abstract = jax.eval_shape(tx.init, abstract)
  opt_dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(opt_abstract) if x.ndim})
  lines.add("optimizer (adamw mu, nu)", like_params_bytes(opt_abstract, splits),
            f"2 x params-shaped ({'/'.join(opt_dtypes)}), split like params, + count", "state",
            f"{_HINT_LORA}; {_HINT_FSDP}; {_HINT_BF16}")
  if spec.rl.loss.kl_coef > 0:
    lines.add("reference params (kl_coef > 0)", params_dev, "= params", "state",
              "config.rl.kl_coef=0 (no reference model)")
  return weights


def _lora_weight_lines(run: _Run, abstract, tx, weights: _Weights, split_note: str,
                       lines: _Lines) -> _Weights:
  """LoRA's frozen base, adapters and their optimizer state. With kl_coef > 0 there are no
  reference params: the base with adapters off is the reference."""
  cfg, lc, c = run.cfg, run.spec.lora, run.c
  bdt = jnp.dtype(lc.base_dtype or cfg.weight_dtype)
  base_abs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, bdt) if jnp.issubdtype(x.dtype, jnp.floating)
      else x, abstract)
  base_splits = param_splits(base_abs, run.mesh, run.rules)
  base_dev = sum(nbytes(x) // sp_ for x, sp_ in base_splits.values())
  targets = lora_targets(abstract, lc)
  adapters = jax.eval_shape(lambda p: lora_lib.init_adapters(p, lc), abstract)
  ad_bytes = sum(nbytes(x) for x in jax.tree.leaves(adapters))  # replicated
  ad_n = sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))
  lines.add(f"frozen base ({bdt.name}, LoRA)", base_dev,
            f"{cfg.num_params() / 1e6:.1f}M x {bdt.itemsize}B ({bdt.name}), {split_note}",
            "state", f"{_HINT_FSDP}; {_HINT_LORA_BF16}")
  lines.add(f"params: LoRA adapters (r={lc.rank})", ad_bytes,
            f"{ad_n / 1e6:.2f}M = r x (in + out) over {len(targets)} matrices x 4B (f32), "
            "replicated", "state", _HINT_LORA_RANK)
  opt_abstract = jax.eval_shape(tx.init, adapters)
  opt_dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(opt_abstract) if x.ndim})
  lines.add("optimizer (adamw mu, nu)",
            sum(nbytes(x) for x in jax.tree.leaves(opt_abstract)),
            f"2 x adapter-shaped ({'/'.join(opt_dtypes)}), replicated, + count; none for the "
            "base", "state", _HINT_LORA_RANK)
  # Per adapted projection and token the backward keeps x A [r] and, as XLA fuses the
  # y = xW + s (xA)B add into its consumers, xW and s (xA)B apart: one more [out] (c).
  return dataclasses.replace(
      weights, sample_full=sum(nbytes(x) for x, _ in base_splits.values()),
      sample_dtype=bdt.name, base_splits=base_splits, base_dtype=bdt, targets=tuple(targets),
      adapter_bytes=ad_bytes,
      lora_act=sum((lc.rank + out_dim(abstract, t)) * c for t in targets
                   if t.startswith("layer_")),
      head_act=lc.rank * c if "lm_head" in targets else 0)


def _sampling_copy(run: _Run, weights: _Weights) -> _Weights:
  """The weights the sampler reads: rlx.step_state.sampling_copy casts each float matrix
  wider than the compute dtype (the params, or LoRA's base) to it once per rollout and eval,
  split as the matrix it is cast from."""
  c = run.c
  cast = [(x, s) for x, s in (weights.base_splits or weights.splits).values()
          if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)
          and jnp.dtype(x.dtype).itemsize > c]
  if not cast:
    return weights
  copy_full = sum(math.prod(x.shape) * c for x, _ in cast)
  return dataclasses.replace(
      weights, sample_full=weights.sample_full - sum(nbytes(x) for x, _ in cast) + copy_full,
      sample_dtype=jnp.dtype(run.cfg.compute_dtype).name,
      copy_dev=sum(math.prod(x.shape) * c // s for x, s in cast),
      copy_from_dev=sum(nbytes(x) // s for x, s in cast))


def _pool_lines(run: _Run, lines: _Lines) -> None:
  """The selector, the prompt pool and the replay ring."""
  spec, n_prompts, n_groups, pw, t_new = (run.spec, run.n_prompts, run.n_groups, run.pw,
                                          run.t_new)
  sel_bytes = sum(nbytes(x) for x in jax.tree.leaves(jax.eval_shape(
      lambda: selection.SelectorState.init(max(n_prompts, 1), None, n_groups,
                                           spread=spec.selection.bucket_score == "spread"))))
  lines.add("selector", sel_bytes if n_prompts else 0,
            f"{n_prompts} prompts x (5 x 4B + 1B) + {n_groups} buckets x 4B, replicated",
            "state")
  lines.add("prompt pool", n_prompts * (pw + t_new + 3) * 4,
            f"{n_prompts} x (P={pw} + A={t_new} + 3) x 4B, replicated", "state")
  rep = spec.replay
  if rep is not None:
    ring = jax.eval_shape(lambda: replay_lib.ReplayState.init(rep.capacity, pw, t_new))
    ring_dev = sum(cdiv(nbytes(x), run.nb) if x.ndim else nbytes(x)
                   for x in jax.tree.leaves(ring))
    lines.add("replay ring", ring_dev,
              f"capacity {rep.capacity} x ((P={pw} + 2T) x 4B + 37B) / {run.nb} batch devices",
              "state", _HINT_REPLAY)


# ---- rollout and eval: the run's sampler.


def _sampler_lines(run: _Run, weights: _Weights, lines: _Lines) -> None:
  """The step's sampler (rollout) and rlx.evaluate.Evaluator's (eval): it decodes
  `sampler.eval_batch_size` prompts at a time with the run's sampler (greedy); paged: every
  prompt once (group_size=1), per shard."""
  s, cfg, nb, pw, c = run.spec.sampler, run.cfg, run.nb, run.pw, run.c
  sp = s.sampling(eos_id=0, pad_id=0)
  g = int(run.spec.rl.group_size)
  local = cdiv(run.spec.selection.groups_sampled_factor * int(run.spec.rl.prompts_per_step)
                * g, nb)
  eval_local = cdiv(int(s.eval_batch_size), nb)
  # The paged sampler runs per batch shard under shard_map and reads the params replicated
  # (P()): FSDP-split params are all-gathered once per call, in the dtype sampled with.
  gathered = None
  if nb > 1 and weights.params_dev < weights.params_full:
    gathered = (weights.sample_full, weights.sample_dtype,
                _HINT_BF16 if run.spec.lora is None else _HINT_LORA_BF16)
  for phase in ("rollout", "eval") if weights.copy_dev else ():
    lines.add(f"sampling weights ({weights.sample_dtype} copy, {phase})", weights.copy_dev,
              f"matrices of {human(weights.copy_from_dev)} cast to {weights.sample_dtype} "
              f"({c}B) once per call, split as stored", phase,
              _HINT_FSDP)
  _fused_lines(run, weights, lines, gathered)
  if s.impl == "paged":
    paged_lines = memory_model.paged_sampler_lines
    paged_lines(lines.add, cfg, "sampler", local, math.gcd(g, local), pw, sp, s.paged,
                "rollout", c, _HINT_POOL, gathered)
    paged_lines(lines.add, cfg, "eval sampler", eval_local, 1, pw, sp, s.paged, "eval", c,
                _HINT_EVAL, gathered)
  else:
    dense_lines = memory_model.dense_sampler_lines
    dense_lines(lines.add, cfg, "sampler", local, pw, run.t_new, "rollout", c, _HINT_PROMPTS)
    dense_lines(lines.add, cfg, "eval sampler", eval_local, pw, run.t_new, "eval", c,
                _HINT_EVAL)


def _fused_lines(run: _Run, weights: _Weights, lines: _Lines, gathered) -> None:
  """The samplers' fused projections (rlx.model.transformer.fuse_projections): each layer's
  q/k/v and gate/up matrices concatenated once per rollout and eval, in the dtype sampled
  with; whole per device under the paged sampler (it reads the params replicated), split as
  stored under the dense one. A group with an unmerged LoRA target is not fused. Where the
  paged sampler all-gathers FSDP-split params, the gather writes those matrices into the
  concatenation (XLA's compiled evaluation is within 10% of the plan without a separate
  copy: tests/test_memory.py), so no line is added; a cast copy (bf16 sampling) is counted
  as well, which may over-state the rollout by the fused matrices."""
  paged = run.spec.sampler.impl == "paged"
  if gathered and paged:
    return
  lc = run.spec.lora
  unmerged = set(weights.targets) if lc is not None and not lc.merge_for_sampling else set()
  splits = weights.base_splits or weights.splits
  itemsize = jnp.dtype(weights.sample_dtype).itemsize
  total, count = 0, 0
  for key, (x, sp_) in splits.items():
    layer, _, rest = key.partition("/")
    for module, names in transformer.FUSED_GROUPS:
      paths = [f"{layer}/{module}/{n}" for n in names]
      if rest != f"{module}/{names[0]}" or any(p in unmerged for p in paths):
        continue
      if not all(p in splits and splits[p][0].ndim == 2 for p in paths):
        continue
      for p in paths:
        leaf, split = splits[p]
        total += math.prod(leaf.shape) * itemsize // (1 if paged else split)
      count += 1
  if not total:
    return
  for phase in ("rollout", "eval"):
    lines.add(f"fused q/k/v, gate/up ({phase})", total,
              f"{count} concatenated groups x {itemsize}B ({weights.sample_dtype}), once per "
              f"call{', whole per device (paged)' if paged else ', split as stored'}", phase,
              _HINT_FSDP)


def _scan_lines(run: _Run, weights: _Weights, lines: _Lines) -> None:
  """model.scan_layers (rlx.model.transformer.scans_layers): every scanned forward stacks the
  layers' weights into one copy inside the jitted call, split as stored. The log-prob pass
  holds one; the gradient pass holds the stack for the backward and the stacked gradient
  before it is sliced back per layer; XLA's compiled update measured 2.4-3.2x the layer
  weights above the unrolled one (tests/test_memory.py), planned as 3x (under LoRA: the
  frozen base stacked twice, the adapters' gradients are small). Either sampler stacks its
  (fused) matrices once per call."""
  if not transformer.scans_layers(run.cfg, None):
    return
  splits = weights.base_splits or weights.splits
  layer = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // split
              for key, (x, split) in splits.items() if key.startswith("layer_"))
  what = f"layer weights stacked for the scan ({run.cfg.num_layers} layers, split as stored)"
  lines.add("scanned layers' stacked weights (logp)", layer, what, "logp", _HINT_FSDP)
  copies = 2 if run.spec.lora is not None else 3
  lines.add("scanned layers' stacked weights + gradient", copies * layer,
            f"{copies} x {what}", "grad", _HINT_FSDP)
  for phase in ("rollout", "eval"):
    lines.add(f"scanned layers' stacked weights ({phase})", layer, what, phase, _HINT_FSDP)


def _merged_lines(run: _Run, weights: _Weights, lines: _Lines) -> None:
  """LoRA merged for sampling: W + scale * A @ B for every adapted matrix, in the base dtype
  and split like the base, built once per rollout (and per eval); the product is formed in
  f32 one matrix at a time."""
  lc = run.spec.lora
  if lc is None or not lc.merge_for_sampling:
    return
  base_splits, targets = weights.base_splits, weights.targets
  # The wider of base and compute dtype.
  mdt = jnp.dtype(lc.merge_dtype) if lc.merge_dtype else weights.base_dtype
  merged = sum(math.prod(base_splits[t][0].shape) * mdt.itemsize // base_splits[t][1]
               for t in targets)
  big_t = max(targets, key=lambda t: nbytes(base_splits[t][0]) // base_splits[t][1])
  big_leaf, big_s = base_splits[big_t]
  delta = math.prod(big_leaf.shape) * 4 // big_s
  for phase in ("rollout", "eval"):
    lines.add(f"merged adapted weights ({phase})", merged + delta,
              f"{len(targets)} matrices x {mdt.itemsize}B ({mdt.name}) split like the base + "
              f"f32 A@B of {big_t} {tuple(big_leaf.shape)}", phase, _HINT_MERGE)


# ---- update (rlx.train.update): log-probs only at the T completion positions, chunk by
# chunk; pi_old from the first minibatch's gradient pass (a forward pass runs only for the
# other minibatches, and for the KL reference), one minibatch live at a time.


def _logprob_chunk(run: _Run) -> tuple[int, str]:
  """(completion positions whose f32 logits are live at once, how to say it)."""
  chunk = run.spec.rl.logprob_chunk
  c_lp = min(chunk, run.t_new) if chunk else run.t_new
  return c_lp, (f"chunk {c_lp} of T={run.t_new}" if c_lp < run.t_new else f"T={run.t_new}")


def _logp_lines(run: _Run, lines: _Lines) -> int:
  """The training batch and the no-grad forward passes; returns the rows of the minibatch
  (or accumulation micro-batch) whose activations are live on one device."""
  rl, nb, pw, t_new = run.spec.rl, run.nb, run.pw, run.t_new
  rep, loss = run.spec.replay, rl.loss
  train_rows = int(rl.prompts_per_step) * int(rl.group_size) + (rep.num_samples if rep else 0)
  rows_dev = cdiv(train_rows, nb)
  mb_rows = cdiv(train_rows, int(rl.num_minibatches) * nb)
  logp_copies = 3 if loss.kl_coef > 0 else 2  # behaviour, old (and ref) log-probs
  per_row = pw * 4 + t_new * (4 + 4 * logp_copies + 1) + 12 * 4
  lines.add("training batch (+ minibatch copy)", 2 * rows_dev * per_row,
            f"2 x {rows_dev} rows x (P*4 + T*{4 + 4 * logp_copies + 1} + 48)B", "update")
  micro = rl.update_micro_rows
  if int(rl.num_minibatches) == 1 and 0 < micro < train_rows:
    # Gradient accumulation (`train.update_shape`): one micro-batch's activations live at a
    # time, the fewest equal parts of <= micro rows that split over the batch devices.
    mb_rows = cdiv(train_rows // train.micro_parts(train_rows, micro, nb, rl.update_parts), nb)
  forward_passes = []
  if not rl.fuse_pi_old or int(rl.num_minibatches) > 1:
    forward_passes.append("pi_old")
  if loss.kl_coef > 0:
    forward_passes.append("reference")
  if forward_passes:
    lines.add(f"{' + '.join(forward_passes)} forward (one minibatch, no grad)",
              *_nograd_forward(run, mb_rows), "logp", _HINT_MINIBATCH, estimate=True)
  return mb_rows


def _nograd_forward(run: _Run, rows: int) -> tuple[int, str]:
  """(bytes, formula) of a no-grad forward over `rows` sequences (log-probs kept in f32)."""
  cfg, seq, c = run.cfg, run.seq, run.c
  d, hq, hkv, hd, V = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
  c_lp, chunk_note = _logprob_chunk(run)
  one_layer = (rows * seq * (4 * d + (hq + 2 * hkv) * hd + 3 * cfg.mlp_dim) * c
               + rows * hq * seq * seq * 8)
  return (max(rows * c_lp * V * 4 * _LOGITS_FWD_COPIES, one_layer) + rows * seq * d * c,
          f"max({rows} rows x {chunk_note} x V={V} x 4B x{_LOGITS_FWD_COPIES}, one layer) "
          "+ hidden")


def _probe_lines(run: _Run, lines: _Lines) -> None:
  """selection.mode oracle / probe (and the shadow probe): one teacher-forced no-grad forward
  over every candidate at once (rlx.train.true_pass_rate), before the rollout samples."""
  sel, rl = run.spec.selection, run.spec.rl
  rows = {"probe": int(rl.prompts_per_step) * sel.groups_sampled_factor * sel.probe_factor,
          "oracle": sel.oracle_candidates or run.n_prompts}.get(sel.mode, sel.shadow_probe)
  rows = min(rows, run.n_prompts)
  nbytes, formula = _nograd_forward(run, rows)
  if rows:
    lines.add(f"pass-rate probe forward ({rows} candidates, no grad)", nbytes,
              formula + "; before sampling, counted with it", "rollout",
              "a smaller selection.probe_factor or config.rl.logprob_chunk", estimate=True)


def _grad_lines(run: _Run, weights: _Weights, mb_rows: int, lines: _Lines,
                remat_realised: bool | None) -> None:
  """One minibatch's backward: gradients, saved activations, f32 logits, FSDP gathers."""
  rl, cfg, seq, c, lc = run.spec.rl, run.cfg, run.seq, run.c, run.spec.lora
  if lc is None:
    lines.add("gradients", weights.params_dev,
              "= params (param dtype, reduce-scattered like params)", "grad",
              f"{_HINT_FSDP}; {_HINT_BF16}; {_HINT_LORA}")
  else:
    lines.add("gradients (adapters)", weights.adapter_bytes,
              "= adapters (f32, replicated); the frozen base gets none", "grad",
              _HINT_LORA_RANK)
  if remat_realised is None:
    remat_realised = bool(rl.remat) and jax.default_backend() != "cpu"
  saved, saved_formula = memory_model.saved_activation_bytes(
      cfg, seq, mb_rows, lora_extra=weights.lora_act // cfg.num_layers,
      head_extra=weights.head_act, remat=bool(rl.remat), remat_realised=remat_realised)
  hint = (_HINT_MINIBATCH if remat_realised and rl.remat else
          f"{_HINT_REMAT}; {_HINT_MINIBATCH}")
  lines.add("saved activations (backward)", saved + mb_rows * seq * seq,
            saved_formula + " + one layer's score grads", "grad", hint, estimate=True)
  c_lp, chunk_note = _logprob_chunk(run)
  V, head_act = cfg.vocab_size, weights.head_act
  copies = _LOGITS_GRAD_COPIES + (1 if head_act else 0)  # adapted lm_head: xW, s(xA)B apart
  lines.add(f"f32 logits x{copies} (minibatch)", mb_rows * c_lp * V * 4 * copies,
            f"{mb_rows} rows x {chunk_note} x V={V} x 4B x{copies} (logits, "
            f"logsumexp / its grad{', adapted lm_head' if head_act else ''})", "grad",
            f"config.rl.logprob_chunk (e.g. 128); {_HINT_MINIBATCH}", estimate=True)
  big_name, (big, big_split) = max(weights.splits.items(), key=lambda kv: nbytes(kv[1][0]))
  if big_split > 1:
    n = int(math.prod(big.shape))
    if lc is None:
      w = jnp.dtype(cfg.weight_dtype).itemsize
      lines.add("FSDP gather + grad partial (largest weight)", n * (c + w),
                f"{big_name} {tuple(big.shape)} gathered ({c}B) + unreduced grad ({w}B)",
                "grad", _HINT_BF16)
    else:
      lines.add("FSDP gather (largest weight)", n * c,
                f"{big_name} {tuple(big.shape)} gathered ({c}B); frozen: no weight gradient",
                "grad", _HINT_FSDP)


def _notes(lc: lora_lib.LoRAConfig | None, weights: _Weights, margin: float) -> tuple[str, ...]:
  lora = ((f"LoRA r={lc.rank}, alpha={lc.alpha:g}: frozen base in {weights.base_dtype.name}, "
           "adapters + their Adam moments f32; no full-size gradient / optimizer state; no "
           "reference copy (the base with adapters off is the KL reference).",) if lc else ())
  return ((
      "Exact: params, optimizer, reference params, replay ring, selector, pool (shapes + "
      "sharding rules). KV: the samplers' own layouts.",) + lora + (
      f"Estimated (x{margin:g} margin, config.memory.activation_margin): sampler "
      "temporaries, pi_old forward, saved activations, logits.",
      "Not modelled: XLA temporaries (fusion / collective buffers, weight casts hoisted out "
      "of loops, FSDP all-gathers kept for the backward), compiled-code and runtime memory."))


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
