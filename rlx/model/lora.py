"""Low-rank adapters (LoRA, Hu et al. 2021) on the transformer's projection matrices.

A targeted weight W [in, out] gets A [in, r] and B [r, out]; the adapted layer computes

    y = x W + (alpha / r) (x A) B

with B = 0 at initialisation, so the adapted policy starts equal to the base. RL needs little
capacity per update: policy-gradient RL with LoRA, even rank 1, matches full fine-tuning in
controlled runs ("LoRA Without Regret", Thinking Machines, 2025), so a LoRA run keeps one frozen
base and trains only the adapters (their optimizer state is all the Adam moments there are).

Representation. Adapters are a nested dict mirroring the parameter tree, holding only the
targeted leaves, each `{"a": A, "b": B}` (f32). Two ways to run the adapted model:

  * `attach(base, adapters)`: the targeted leaves become `LoRAWeight(w, a, b, scale)` and the
    model's projections take the unmerged low-rank path (rlx.model.transformer.linear). No
    merged copy of any weight exists, and the backward computes no [in, out] weight gradient:
    this is what the update runs.
  * `merge(base, adapters)`: W + scale * A @ B materialised, once per rollout, for the
    sampler: decoding then costs exactly what the full-parameter model costs per token (no
    two extra skinny matmuls per projection per token), for one copy of the targeted weights
    in the compute dtype while the rollout runs.

With adapters off (`base` alone) the model is the frozen reference policy, so a KL term needs
no second copy of the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rlx import config_checks as chk
from rlx.errors import ConfigError
from rlx.model.config import model_dtype

Params = dict[str, Any]

# Every matrix the model multiplies activations by, as in Hugging Face / PEFT module names.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = (r"(q|k|v|o|gate|up|down)_proj$",)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """rank: r; alpha: the update is scaled by alpha / r; targets: regexes over parameter paths
  ("layer_0/attn/q_proj"); only projection matrices (and an untied lm_head) can be adapted.
  base_dtype: dtype the frozen base is stored in ("" = the model's param dtype)."""

  rank: int
  alpha: float
  targets: tuple[str, ...] = DEFAULT_TARGETS
  base_dtype: str = ""
  merge_for_sampling: bool = True
  # dtype of the merged weights the sampler decodes with ("" = W's): the wider of the base's
  # and the compute dtype, so a bf16 base under f32 compute keeps the whole f32 update
  # instead of rounding small adapter deltas away (the update's unmerged path keeps them).
  merge_dtype: str = ""

  def __post_init__(self):
    if not (isinstance(self.rank, int) and self.rank >= 1):
      raise ValueError(f"LoRAConfig.rank={self.rank!r}; expected an int >= 1.")
    if not (isinstance(self.alpha, (int, float)) and self.alpha > 0 and math.isfinite(
        self.alpha)):
      raise ValueError(f"LoRAConfig.alpha={self.alpha!r}; expected a positive number.")
    if not self.targets:
      raise ValueError("LoRAConfig.targets is empty; expected at least one regex over "
                       "parameter paths, e.g. r'(q|v)_proj$'.")
    for t in self.targets:
      try:
        re.compile(t)
      except re.error as e:
        raise ValueError(f"LoRAConfig.targets: {t!r} is not a regex ({e}).") from None

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank

  @classmethod
  def from_config(cls, config) -> LoRAConfig | None:
    """config.lora, checked (one ConfigError); None when rank is 0: full-parameter training."""
    if "lora" not in config:
      return None
    lc = config.lora
    rank = chk.integer(config, "lora.rank", 0)
    if rank == 0:
      return None
    chk.number(config, "lora.alpha", 0, lo_open=True)
    chk.need(float(lc.dropout) == 0.0,
             f"config.lora.dropout={lc.dropout!r}: rlx's adapters have no dropout (RL updates "
             f"see each rollout a few times at most); expected 0.")
    chk.need(lc.base_dtype in ("", "float32", "bfloat16"),
             f"config.lora.base_dtype={lc.base_dtype!r}; expected '' (the model's param "
             f"dtype), 'float32' or 'bfloat16'.")
    chk.need(isinstance(lc.targets, str) and lc.targets.strip() != "",
             f"config.lora.targets={lc.targets!r}; expected a regex over parameter paths such "
             f"as '(q|v)_proj$' (paths look like 'layer_0/attn/q_proj').")
    try:
      try:  # the wider of the base's and the compute dtype (see merge_dtype)
        merge = str(jnp.promote_types(jnp.dtype(lc.base_dtype or config.model.param_dtype),
                                      jnp.dtype(model_dtype(config))))
      except (TypeError, ConfigError):  # a bad model dtype: the model's own check names it
        merge = ""
      return cls(rank=rank, alpha=float(lc.alpha), targets=(lc.targets,),
                 base_dtype=lc.base_dtype, merge_for_sampling=bool(lc.merge_for_sampling),
                 merge_dtype=merge)
    except ValueError as e:
      raise ConfigError(f"config.lora: {e}") from None


@struct.dataclass
class LoRAWeight:
  """A frozen weight with its adapter, as the model's projection sees it (see `linear`)."""

  w: jax.Array  # [in, out] frozen base
  a: jax.Array  # [in, r]
  b: jax.Array  # [r, out]
  scale: float = struct.field(pytree_node=False, default=1.0)

  def __getitem__(self, index):  # nnx reads variables as `var[...]`
    if index is not Ellipsis:
      raise TypeError(f"LoRAWeight supports only [...] indexing, got {index!r}")
    return self

  @property
  def shape(self):
    return self.w.shape

  @property
  def dtype(self):
    return self.w.dtype

  def dense(self, dtype=None) -> jax.Array:
    """W + scale * A @ B in `dtype` (default W's; the product and the sum in f32)."""
    delta = jnp.dot(self.a.astype(jnp.float32), self.b.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
    return (self.w.astype(jnp.float32) + self.scale * delta).astype(dtype or self.w.dtype)


def _weight_grad_lhs(x2):
  """x^T for the weight gradient x^T @ g. On CPU, materialised: XLA:CPU otherwise folds the
  transpose into a dot contracting both operands' leading (token) dimension, which it runs
  through a slower GEMM path after a transposing copy of g fused with the activation's
  backward (profiled at 100M: ~40 ms per MLP per micro-batch for an 8.8 MB copy, and the
  weight-gradient GEMMs off the fast library path). Elsewhere XLA folds it into the GEMM."""
  xt = jnp.transpose(x2)
  return jax.lax.optimization_barrier(xt) if jax.default_backend() == "cpu" else xt


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x2, w, out_dtype=None):
  """x2 [N, in] @ w [in, out] -> [N, out] (dtype out_dtype, default x2's), with a backward
  that forms its two GEMMs as plain row-major products: dx = g @ w^T and dw = x2^T @ g. The
  values are autodiff's of the same product (tests/model/test_transformer.py compares them)."""
  return jax.lax.dot_general(x2, w, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)


def _dense_fwd(x2, w, out_dtype):
  return dense(x2, w, out_dtype), (x2, w)


def _dense_bwd(out_dtype, res, g):
  del out_dtype
  x2, w = res
  dx = jax.lax.dot_general(g, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  dw = jax.lax.dot_general(_weight_grad_lhs(x2), g, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
  return dx.astype(x2.dtype), dw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def _is_projection(eq: str) -> bool:
  """eq is "<lead>i,io-><lead>o": x's last axis contracted with w's first, w's second last."""
  ins, out = eq.split("->")
  xs, ws = ins.split(",")
  return (len(ws) == 2 and len(xs) >= 2 and xs[-1] == ws[0] and out == xs[:-1] + ws[1]
          and len(set(xs + ws[1])) == len(xs) + 1)


def linear(eq: str, x, w, dtype, preferred_element_type=None):
  """einsum(eq, x, w) for a projection weight w [in, out], `eq` a projection
  "<lead>i,io-><lead>o" (like "btd,de->bte"): `dense` (its backward as two plain GEMMs) for a
  plain weight, the unmerged low-rank path when w is a LoRAWeight."""
  if not _is_projection(eq) or "r" in eq:
    raise ValueError(f"linear: equation {eq!r}; expected a projection '<lead>i,io-><lead>o' "
                     f"(like 'btd,de->bte', without the letter r, the adapters' rank axis).")
  if not isinstance(w, LoRAWeight):
    y = dense(x.reshape(-1, x.shape[-1]), w.astype(dtype), preferred_element_type)
    return y.reshape(*x.shape[:-1], w.shape[-1])
  ins, out = eq.split("->")
  xs, (i, o) = ins.split(",")
  y = jnp.einsum(eq, x, w.w.astype(dtype), preferred_element_type=preferred_element_type)
  xr = xs.replace(i, "r")
  xa = jnp.einsum(f"{xs},{i}r->{xr}", x, w.a.astype(dtype))
  delta = jnp.einsum(f"{xr},r{o}->{out}", xa, w.b.astype(dtype),
                     preferred_element_type=preferred_element_type)
  return y + (w.scale * delta).astype(y.dtype)


# ----------------------------------------------------------------------------- trees


def _walk(tree, prefix=""):
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else str(k)
    if isinstance(v, dict):
      yield from _walk(v, path)
    else:
      yield path, v


def target_paths(params: Params, cfg: LoRAConfig) -> list[str]:
  """Parameter paths the adapters attach to; one ValueError if a target matches nothing or
  matches a weight that is not a projection matrix."""
  paths = []
  matched = {t: 0 for t in cfg.targets}
  for path, leaf in _walk(params):
    hits = [t for t in cfg.targets if re.search(t, path)]
    if not hits:
      continue
    for t in hits:
      matched[t] += 1
    name = path.rsplit("/", 1)[-1]
    if name not in PROJECTIONS + ("lm_head",) or len(np.shape(leaf)) != 2:
      raise ValueError(
          f"LoRA target {hits[0]!r} matches {path!r} (shape {tuple(np.shape(leaf))}), which is "
          f"not a projection matrix; adapters go on {PROJECTIONS + ('lm_head',)}.")
    paths.append(path)
  missing = [t for t, n in matched.items() if n == 0]
  if missing:
    raise ValueError(f"LoRA targets {missing} match no parameter; paths look like "
                     f"'layer_0/attn/q_proj', 'layer_0/mlp/down_proj'.")
  return paths


def check_rank(params: Params, cfg: LoRAConfig, paths: list[str]) -> None:
  """One ValueError if the rank exceeds the smaller side of an adapted matrix (`paths`, from
  target_paths): A @ B of an [in, out] matrix has rank <= min(in, out), so a larger rank
  adds only parameters, memory and compile time (rank 100000 was 7.4 GB of adapters)."""
  shapes = {p: tuple(np.shape(_get(params, p))) for p in paths}
  smallest = min(paths, key=lambda p: (min(shapes[p]), p))
  limit = min(shapes[smallest])
  if cfg.rank > limit:
    raise ValueError(
        f"rank={cfg.rank} exceeds the smaller side of the adapted matrix {smallest!r} "
        f"(shape {shapes[smallest]}); the update A @ B of an [in, out] matrix has rank <= "
        f"min(in, out), so expected rank <= {limit}.")


def _get(tree, path):
  for k in path.split("/"):
    tree = tree[k]
  return tree


def _set(tree, path, value):
  *parents, leaf = path.split("/")
  for k in parents:
    tree = tree.setdefault(k, {})
  tree[leaf] = value


def init_adapters(params: Params, cfg: LoRAConfig, seed: int = 0) -> Params:
  """A [in, r] ~ N(0, 1/in) (so x A has unit scale), B = 0: the adapted model equals the base."""
  adapters: Params = {}
  key = jax.random.key(seed)
  for n, path in enumerate(target_paths(params, cfg)):
    d_in, d_out = np.shape(_get(params, path))
    a = jax.random.normal(jax.random.fold_in(key, n), (d_in, cfg.rank), jnp.float32)
    _set(adapters, path, {"a": a * d_in ** -0.5,
                          "b": jnp.zeros((cfg.rank, d_out), jnp.float32)})
  return adapters


def adapter_paths(adapters: Params) -> list[str]:
  return sorted({p.rsplit("/", 1)[0] for p, _ in _walk(adapters)})


def attach(base: Params, adapters: Params, cfg: LoRAConfig) -> Params:
  """The base tree with each adapted leaf replaced by a LoRAWeight (unmerged path)."""
  out = jax.tree.map(lambda x: x, base)  # copy the dict structure, not the arrays
  for path in adapter_paths(adapters):
    ad = _get(adapters, path)
    _set(out, path, LoRAWeight(_get(base, path), ad["a"], ad["b"], cfg.scale))
  return out


def merge(base: Params, adapters: Params, cfg: LoRAConfig) -> Params:
  """The base tree with W + scale * A @ B at each adapted leaf (dense, in cfg.merge_dtype,
  default W's dtype)."""
  out = jax.tree.map(lambda x: x, base)
  for path in adapter_paths(adapters):
    ad = _get(adapters, path)
    _set(out, path, LoRAWeight(_get(base, path), ad["a"], ad["b"], cfg.scale).dense(
        cfg.merge_dtype or None))
  return out


def cast_base(base: Params, cfg: LoRAConfig) -> Params:
  if not cfg.base_dtype:
    return base
  dt = jnp.dtype(cfg.base_dtype)
  return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      base)


def num_params(adapters: Params) -> int:
  return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(adapters)))
