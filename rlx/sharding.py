"""Mesh construction and partition rules (regex on parameter paths -> PartitionSpec).

Mesh axes: `data` (replicas of the parameters, batch split), `fsdp` (parameters and batch
split), `tensor` (reserved for tensor parallelism; size 1 by default). Rollouts and training
batches are split over ("data", "fsdp") jointly, so an FSDP group never repeats work.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# First matching rule wins; a spec entry naming an axis whose size does not divide the
# dimension falls back to None (replicated) for that dimension.
DEFAULT_RULES: tuple[tuple[str, tuple], ...] = (
    (r"embedding$", ("fsdp", "tensor")),
    (r"lm_head$", ("fsdp", "tensor")),
    (r"(q|k|v)_proj$", ("fsdp", "tensor")),
    (r"o_proj$", ("tensor", "fsdp")),
    (r"(gate|up)_proj$", ("fsdp", "tensor")),
    (r"down_proj$", ("tensor", "fsdp")),
    (r".*", ()),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh over all (or the given) devices; -1 in one axis takes the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh sizes {dict(zip(AXES, sizes))}: at most one axis may be -1.")
  known = math.prod(s for s in sizes if s != -1)
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh sizes {dict(zip(AXES, sizes))}: expected positive sizes or -1.")
  if -1 in sizes:
    if n % known:
      raise ValueError(f"mesh sizes {dict(zip(AXES, sizes))} do not divide the {n} devices.")
    sizes[sizes.index(-1)] = n // known
  if math.prod(sizes) != n:
    raise ValueError(f"mesh sizes {dict(zip(AXES, sizes))} use {math.prod(sizes)} devices, "
                     f"but {n} are available; use -1 for one axis to take the rest.")
  # Auto axis types: the JAX 0.10 default (Explicit) breaks embedding gathers.
  return jax.make_mesh(tuple(sizes), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices)


def path_str(path) -> str:
  parts = []
  for k in path:
    if hasattr(k, "key"):
      parts.append(str(k.key))
    elif hasattr(k, "name"):
      parts.append(str(k.name))
    elif hasattr(k, "idx"):
      parts.append(str(k.idx))
    else:
      parts.append(str(k))
  return "/".join(parts)


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh,
             rules=DEFAULT_RULES) -> P:
  for pattern, spec in rules:
    if re.search(pattern, path):
      spec = tuple(spec)[:len(shape)]
      fitted = []
      for dim, axis in zip(shape, spec):
        if axis is None or dim % mesh.shape[axis] != 0:
          fitted.append(None)
        else:
          fitted.append(axis)
      return P(*fitted)
  return P()


def param_shardings(abstract_params: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, spec_for(path_str(path), x.shape, mesh, rules)),
      abstract_params)


def shardings_like_params(tree: Any, params_sharding: Any, mesh: Mesh) -> Any:
  """Shardings for a tree holding param-shaped subtrees (e.g. optimizer state).

  A leaf whose path ends with a parameter's path (and has its shape) gets that parameter's
  sharding; everything else (step counters, scalars) is replicated.
  """
  by_path = {}
  for path, s in jax.tree_util.tree_flatten_with_path(params_sharding)[0]:
    by_path[path_str(path)] = s
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf):
    p = path_str(path)
    for param_path, sharding in by_path.items():
      if (p == param_path or p.endswith("/" + param_path)) and len(
          sharding.spec) <= len(getattr(leaf, "shape", ())):
        return sharding
    return replicated

  return jax.tree_util.tree_map_with_path(pick, tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_size_of(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def constrain_batch(tree: Any, mesh: Mesh) -> Any:
  """Splits every array's leading (batch) dimension over the data-parallel axes (scalars are
  replicated)."""
  return jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(
          x, batch_sharding(mesh, x.ndim) if x.ndim else replicated(mesh)), tree)


def put(tree: Any, shardings: Any) -> Any:
  """Host numpy (or device) arrays -> global arrays with the given sharding(s).

  Every process passes the same full host array (as each loads the same data); this works in
  single- and multi-process runs alike, unlike a plain device_put of a global sharding.
  """
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(put, tree, shardings)
  sharding = shardings

  def one(x):
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
  return jax.tree.map(one, tree)
