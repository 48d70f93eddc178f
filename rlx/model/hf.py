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

The code lives in three files: this one (load_hf, save_hf and the LoRA / PEFT export),
`rlx.model.hf_config` (config.json <-> ModelConfig and the per-family tensor names) and
`rlx.model.safetensors_io` (the file format); the names of the other two that callers use
are importable from here as before.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from rlx import sharding as sharding_lib
from rlx.model import lora as lora_lib
from rlx.model import transformer
from rlx.model.config import DTYPES, ModelConfig
# pylint: disable=unused-import  (re-exported: rlx.model.hf is where callers find them)
from rlx.model.hf_config import (ARCHITECTURES, _family_of, _normalize_name, _param_paths,
                                 config_from_hf, config_to_hf, hf_name, infer_family,
                                 read_config)
from rlx.model.safetensors_io import (_ST_DTYPES, _TensorInfo, _find_checkpoint, _read_header,
                                      _read_rows, write_safetensors)
# pylint: enable=unused-import

Params = dict[str, Any]
# Files that describe the tokenizer / generation defaults, copied by save_hf(source_dir=...).
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "generation_config.json", "chat_template.jinja",
               "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json")
_CHUNK_BYTES = 32 * 2**20  # tensors above this are streamed in row blocks


# ====================================================================== loading


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


# ======================================================================= saving


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


# ================================================================== LoRA / PEFT


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
