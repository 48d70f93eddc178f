r"""Kernels per decode iteration, counted in the compiled HLO of the samplers' decode loops.

  python experiments/benchmarks/decode_kernels.py                      # the reasoning model
  python experiments/benchmarks/decode_kernels.py --num_layers=12 --d_model=768 \
      --num_heads=12 --num_kv_heads=4 --head_dim=64 --mlp_dim=2048   # a 100M-shaped model

Builds the model of a config (default experiments/reasoning.py; --num_layers etc. override
its architecture), lowers and compiles the rollout's sampling as the trainer runs it (the
params through `step_state.sampling_copy`, then the dense and the paged sampler), finds the
decode `while` loops in the optimized HLO and counts what one iteration launches:

  launches  every instruction of the loop body that does work (all but parameter,
            get-tuple-element, tuple, constant, bitcast), nested loops counted
            trip-count times (the CPU's threefry hash is a 5-trip loop per draw), a
            conditional as one plus its cheapest branch (paged: an iteration that admits
            nobody), the loop condition included;
  fusion, custom-call, copy, dynamic-update-slice: those opcodes among the launches;
  dot       dots / convolutions outside any fusion; matmuls = those plus fusions and
            custom-calls that contain or are a matmul (a GPU's GEMM kernels);
  per layer the marginal cost of a layer: count(L layers) - count(L-1 layers);
  nested loops, launches in them: the loops inside the body and what their trips launch.

On a GPU a fusion is one kernel launch. On CPU XLA runs a fusion as one compiled loop nest
and each other instruction as its own thunk, so the counts are the proxy for kernels; the
output says which backend it counted on.

The loops are found as the outermost `while`s of the entry computation whose body contains
a matmul (the sampling's threefry loops contain none). The dense sampler has one; the
paged sampler one per decode width (all slots, then S/2, S/4, ...: `slot_buckets`).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

import rlx
from rlx import configs
from rlx import step_state
from rlx.model import init_params
from rlx.sampler import dense, paged

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/reasoning.py", "Config file.")
_VOCAB = flags.DEFINE_integer("vocab_size", 0, "Vocabulary (0: config.tokenizer.vocab_size).")
_ARCH = {k: flags.DEFINE_integer(k, 0, f"Override config.model.{k} (0: the config's).")
         for k in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                   "mlp_dim")}
_SAMPLERS = flags.DEFINE_list("samplers", ["dense", "paged"], "Samplers to count.")
_PER_LAYER = flags.DEFINE_bool("per_layer", True, "Also compile at L-1 layers (marginal "
                               "cost of a layer).")
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "Also write the compiled HLO texts here.")

# Instructions that name or regroup buffers without running anything.
TRIVIAL = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast"})
MATMULS = frozenset({"dot", "convolution"})
COLUMNS = ("launches", "fusion", "custom-call", "dot", "matmuls", "copy",
           "dynamic-update-slice")


# ----------------------------------------------------------------------------- HLO parsing


@dataclasses.dataclass(frozen=True)
class Instr:
  name: str
  opcode: str
  attrs: str  # everything after the opcode: operands, attributes, metadata


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")


def _skip_shape(s: str, i: int) -> int:
  """Index just past the result shape that starts at s[i] (a tuple shape nests parens)."""
  if s[i] != "(":
    while i < len(s) and s[i] != " ":
      i += 1
    return i
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j + 1
  raise ValueError(f"unbalanced tuple shape in HLO line: {s[:200]!r}")


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
  """(computation name -> its instructions in order, the entry computation's name)."""
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m and line.rstrip().endswith("{"):
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    i = _skip_shape(line, m.end())
    op = _OPCODE.match(line, i)
    if op:
      comps[current].append(Instr(m.group(1), op.group(1), line[op.end():]))
  if not entry:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


def _attr(instr: Instr, key: str) -> list[str]:
  """Computation names of attribute `key` (key=%a or key={%a, %b})."""
  m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", instr.attrs)
  if not m:
    return []
  return [n.strip().lstrip("%") for n in m.group(1).strip("{}").split(",") if n.strip()]


def branches(instr: Instr) -> list[str]:
  return (_attr(instr, "branch_computations")
          or _attr(instr, "true_computation") + _attr(instr, "false_computation"))


def trip_count(instr: Instr) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
  return int(m.group(1)) if m else None


def _called(instr: Instr) -> list[str]:
  """Every computation an instruction calls (fusions, loops, branches, reducers, ...)."""
  keys = ("calls", "body", "condition", "to_apply", "called_computations")
  return [c for k in keys for c in _attr(instr, k)] + branches(instr)


def is_matmul(comps, instr: Instr) -> bool:
  """A dot / convolution, a fusion around one, or a GEMM custom-call (cuBLAS, oneDNN)."""
  if instr.opcode in MATMULS:
    return True
  if instr.opcode == "custom-call":
    m = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
    if m and re.search(r"gemm|matmul|dot", m.group(1), re.I):
      return True
  if instr.opcode == "fusion":
    return any(is_matmul(comps, i) for c in _attr(instr, "calls") for i in comps.get(c, []))
  return False


def contains_matmul(comps, name: str, _seen=None) -> bool:
  seen = set() if _seen is None else _seen
  if name in seen:
    return False
  seen.add(name)
  return any(is_matmul(comps, i) or any(contains_matmul(comps, c, seen) for c in _called(i))
             for i in comps.get(name, []))


def count_launches(comps, name: str) -> collections.Counter:
  """What one run of computation `name` launches, by column (see COLUMNS) and opcode.

  Nested loops count trip-count times (unknown trip count: once, and 'unknown_trip' is
  set), a conditional as one launch plus its cheapest branch, a call as its callee.
  """
  out: collections.Counter = collections.Counter()
  for instr in comps[name]:
    op = instr.opcode
    if op in TRIVIAL:
      continue
    if op == "while":
      trips = trip_count(instr)
      if trips is None:
        out["unknown_trip"] += 1
        trips = 1
      for c in _attr(instr, "body") + _attr(instr, "condition"):
        inner = count_launches(comps, c)
        for k, v in inner.items():
          out[k] += trips * v
        out["in_nested_loops"] += trips * (inner["launches"] - inner["in_nested_loops"])
      out["nested_loops"] += 1
      continue
    if op == "call":
      for c in _attr(instr, "to_apply"):
        out.update(count_launches(comps, c))
      continue
    if op == "conditional":
      options = [count_launches(comps, c) for c in branches(instr)]
      if options:
        out.update(min(options, key=lambda x: x["launches"]))
    out["launches"] += 1
    out[f"op:{op}"] += 1
    if op in ("fusion", "custom-call", "copy", "dynamic-update-slice"):
      out[op] += 1
    if op in MATMULS:
      out["dot"] += 1
    if is_matmul(comps, instr):
      out["matmuls"] += 1
  return out


def _reachable_whiles(comps, name: str) -> list[Instr]:
  """The `while`s run by `name` itself or through calls / branches, not inside a loop."""
  found = []
  for instr in comps[name]:
    if instr.opcode == "while":
      found.append(instr)
    elif instr.opcode == "call":
      for c in _attr(instr, "to_apply"):
        found += _reachable_whiles(comps, c)
    elif instr.opcode == "conditional":
      for c in branches(instr):
        found += _reachable_whiles(comps, c)
  return found


def decode_loops(comps, entry: str) -> list[Instr]:
  """The outermost `while`s (in program order) whose body runs a matmul: the decode loops."""
  return [w for w in _reachable_whiles(comps, entry)
          if any(contains_matmul(comps, b) for b in _attr(w, "body"))]


def loop_counts(hlo_text: str) -> list[collections.Counter]:
  """Per decode loop (program order): what one iteration launches (body + condition)."""
  comps, entry = parse_hlo(hlo_text)
  counts = []
  for w in decode_loops(comps, entry):
    c: collections.Counter = collections.Counter()
    for name in _attr(w, "body") + _attr(w, "condition"):
      c.update(count_launches(comps, name))
    counts.append(c)
  return counts


# ----------------------------------------------------------------------------- compiling


def _model_cfg(config, num_layers: int | None = None):
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for k, f in _ARCH.items():
      if f.value:
        config.model[k] = f.value
    if num_layers is not None:
      config.model.num_layers = num_layers
  return config, configs.model_config(config, _VOCAB.value or config.tokenizer.vocab_size)


def compiled_hlo(config, sampler: str, num_layers: int | None = None) -> tuple[str, object]:
  """Optimized HLO of the rollout's sampling (sampling copy of the params, then generate)."""
  config, cfg = _model_cfg(config, num_layers)
  spec = configs.resolve(config)
  graphdef, params = init_params(cfg, 0)
  sp = spec.sampler.sampling(eos_id=3, pad_id=0)
  b, p = spec.rl.prompts_per_step * spec.rl.group_size, spec.sampler.max_prompt_len
  prompts = jnp.full((b, p), 5, jnp.int32)
  lens = jnp.full((b,), p, jnp.int32)
  keys = jax.random.split(jax.random.key(0), b)

  def rollout(params, prompts, lens, keys):
    params = step_state.sampling_copy(params, spec.model.dtype)
    if sampler == "dense":
      return dense.generate_unjitted(graphdef, params, prompts, lens, keys, sp)
    return paged.generate_unjitted(graphdef, params, prompts, lens, keys, sp,
                                   spec.sampler.paged or paged.PagedConfig(),
                                   group_size=spec.rl.group_size)

  text = jax.jit(rollout).lower(params, prompts, lens, keys).compile().as_text()
  return text, cfg


def main(_):
  print(f"# rlx from {rlx.__file__}", file=sys.stderr)
  backend = jax.default_backend()
  rows = []
  cfg = None
  for sampler in _SAMPLERS.value:
    text, cfg = compiled_hlo(_CONFIG.value, sampler)
    if _HLO_DIR.value:
      with open(f"{_HLO_DIR.value}/{sampler}.hlo", "w") as f:
        f.write(text)
    full = loop_counts(text)
    fewer = []
    if _PER_LAYER.value and cfg.num_layers > 1:
      fewer = loop_counts(compiled_hlo(_CONFIG.value, sampler, cfg.num_layers - 1)[0])
    for i, c in enumerate(full):
      per = fewer[i] if len(fewer) == len(full) else None
      rows.append((f"{sampler} loop {i}", c, per))
  print(f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, heads {cfg.num_heads}/"
        f"{cfg.num_kv_heads} x {cfg.head_dim}, mlp {cfg.mlp_dim}, vocab {cfg.vocab_size}, "
        f"compute {cfg.dtype}; backend {backend} ({jax.devices()[0].device_kind})")
  if backend == "cpu":
    print("CPU: XLA runs each fusion as one compiled loop nest and every other instruction as "
          "its own thunk; fusions and launches are the proxy for GPU kernels.")
  print()
  print("| loop | " + " | ".join(COLUMNS) + " | launches / layer | matmuls / layer | "
        "nested loops | launches in them |")
  print("|---|" + "---:|" * (len(COLUMNS) + 4))
  for label, c, per in rows:
    marg = (lambda k: str(c[k] - per[k])) if per is not None else (lambda k: "-")
    flag = " (unknown trip count)" if c["unknown_trip"] else ""
    print(f"| {label} | " + " | ".join(str(c[k]) for k in COLUMNS)
          + f" | {marg('launches')} | {marg('matmuls')} | {c['nested_loops']}{flag}"
          f" | {c['in_nested_loops']} |")
  print()
  for label, c, _ in rows:
    ops = sorted(((k[3:], v) for k, v in c.items() if k.startswith("op:")),
                 key=lambda kv: (-kv[1], kv[0]))
    print(f"{label} by opcode: " + ", ".join(f"{k} {v}" for k, v in ops))


if __name__ == "__main__":
  app.run(main)
