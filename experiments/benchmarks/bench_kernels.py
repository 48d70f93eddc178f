r"""Benchmarks rlx's paged decode attention kernels side by side.

  python experiments/benchmarks/bench_kernels.py --out /tmp/bench.md        # on a GPU/TPU
  python experiments/benchmarks/bench_kernels.py --quick                    # CPU, seconds

For each decode shape (bf16, D=128, every sequence at full context, pages in
shuffled order) it times the ``gpu`` (or ``tpu``) Pallas kernel, the XLA
``reference`` and, where available, JAX's own Pallas paged attention, and
reports the median time, the KV bandwidth achieved (K+V bytes attended / time)
as a fraction of the device's HBM peak, the speedup over the reference and the
max |error| against the reference. A second table compares cascade attention
(shared prompt pages read once per GRPO group) with plain paged attention.
``--quick`` shrinks everything to tiny f32 shapes and runs the Pallas kernels in
interpret mode, to show the script works. Every row is guarded: a failing or
unavailable implementation prints an error row and the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

try:
  from rlx.experiments.benchmarks.timing import median_time
  from rlx.kernels import cascade_paged_attention, paged_attention
except ImportError:  # running from a checkout without `pip install -e .`
  import importlib.util
  import os
  from timing import median_time  # this file's folder is sys.path[0]
  _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  _spec = importlib.util.spec_from_file_location(
      "rlx.kernels", os.path.join(_root, "kernels", "__init__.py"),
      submodule_search_locations=[os.path.join(_root, "kernels")])
  sys.modules.setdefault("rlx", types.ModuleType("rlx"))
  _kernels = importlib.util.module_from_spec(_spec)
  sys.modules["rlx.kernels"] = _kernels
  _spec.loader.exec_module(_kernels)
  cascade_paged_attention = _kernels.cascade_paged_attention
  paged_attention = _kernels.paged_attention

# HBM peak GB/s by substring of jax.Device.device_kind (first match wins).
PEAK_GBPS = {
    "H200": 4800, "H100": 3350, "H800": 3350, "A100": 2039, "L4": 300,
    "TPU v6": 1640, "TPU v5p": 2765, "TPU v5": 819, "TPU v4": 1228,
    "cpu": 25,
}

# (batch, context, num_kv_heads, num_q_heads)
FULL_SHAPES = [(8, 512, 2, 16), (8, 4096, 8, 32), (32, 1024, 8, 32),
               (64, 2048, 4, 32), (128, 1024, 8, 64), (128, 4096, 8, 32),
               (256, 512, 2, 16), (256, 2048, 8, 32)]
QUICK_SHAPES = [(2, 64, 2, 8), (4, 32, 1, 4)]
# (num_groups, group_size, prompt, suffix, num_kv_heads, num_q_heads)
FULL_CASCADE = [(16, 8, 1024, 256, 8, 32), (8, 16, 1024, 256, 8, 32),
                (32, 8, 1024, 256, 4, 32)]
QUICK_CASCADE = [(2, 2, 32, 16, 1, 4)]


@dataclasses.dataclass
class Row:
  table: str
  config: str
  impl: str
  time_us: float | None = None
  gbps: float | None = None
  peak_frac: float | None = None
  speedup: float | None = None
  max_err: float | None = None
  error: str | None = None


def make_paged(rng, batch, context, num_kv, num_q, head_dim, page_size, dtype):
  pages_per_seq = context // page_size
  num_pages = batch * pages_per_seq + 1
  k = rng.standard_normal((num_kv, num_pages, page_size, head_dim), np.float32)
  v = rng.standard_normal((num_kv, num_pages, page_size, head_dim), np.float32)
  q = rng.standard_normal((batch, num_q, head_dim), np.float32)
  table = (1 + rng.permutation(batch * pages_per_seq)).reshape(batch, pages_per_seq)
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.full((batch,), context, jnp.int32), jnp.asarray(table, jnp.int32))


def available_impls(quick: bool):
  """[(name, kwargs for paged_attention or None, note)] for this backend."""
  backend = jax.default_backend()
  impls = [("reference", dict(impl="reference"))]
  if backend == "tpu" or quick:
    impls.append(("tpu", dict(impl="tpu", interpret=quick)))
  if backend in ("gpu", "cuda", "rocm") or quick:
    impls.append(("gpu", dict(impl="gpu", interpret=quick)))
  if backend in ("gpu", "cuda", "rocm") or quick:
    impls.append(("jax_gpu", None))
  if backend == "tpu":
    impls.append(("jax_tpu", None))
  return impls


def jax_paged_fn(name: str, quick: bool, sm_scale: float, page_size: int,
                 pages_per_seq: int):
  """JAX's own Pallas paged attention (no sm_scale arg: q is pre-scaled)."""
  if name == "jax_gpu":
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    splits = 1
    while splits * 2 <= min(16, pages_per_seq) and pages_per_seq % (splits * 2) == 0:
      splits *= 2
    per_block = min(8, pages_per_seq // splits)
    return lambda q, k, v, lengths, table: jax_pa.paged_attention(
        q * sm_scale, k, v, table, lengths, k_splits=splits,
        pages_per_compute_block=per_block, interpret=quick)
  from jax.experimental.pallas.ops.tpu import paged_attention as jax_pa
  per_block = max(1, min(pages_per_seq, 512 // page_size))
  while pages_per_seq % per_block:
    per_block -= 1
  return lambda q, k, v, lengths, table: jax_pa.paged_attention(
      q * sm_scale, k, v, lengths, table, pages_per_compute_block=per_block)


def bench_paged(args, peak_gbps, rows):
  rng = np.random.default_rng(0)
  dtype = jnp.float32 if args.quick else jnp.bfloat16
  timing = dict(warmup=args.warmup, reps=args.repeats, inner=args.inner)
  for batch, context, num_kv, num_q in (QUICK_SHAPES if args.quick else FULL_SHAPES):
    config = f"B={batch} ctx={context} Hkv={num_kv} Hq={num_q}"
    try:
      inputs = make_paged(rng, batch, context, num_kv, num_q, args.head_dim,
                          args.page_size, dtype)
    except Exception as e:  # e.g. out of memory
      rows.append(Row("paged", config, "-", error=f"{type(e).__name__}: {e}"[:200]))
      print_row(rows[-1])
      continue
    kv_bytes = 2 * batch * context * num_kv * args.head_dim * inputs[1].dtype.itemsize
    sm_scale = args.head_dim ** -0.5
    ref_time = ref_out = None
    for name, kwargs in available_impls(args.quick):
      row = Row("paged", config, name)
      try:
        if kwargs is None:
          fn = jax.jit(jax_paged_fn(name, args.quick, sm_scale, args.page_size,
                                    context // args.page_size))
        else:
          fn = jax.jit(lambda *x, kw=kwargs: paged_attention(*x, sm_scale=sm_scale, **kw))
        out = jax.block_until_ready(fn(*inputs))
        seconds = median_time(fn, *inputs, **timing)
        fill_row(row, seconds, kv_bytes, peak_gbps, ref_time)
        if name == "reference":
          ref_time, ref_out = seconds, out
        elif ref_out is not None:
          row.max_err = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                              - ref_out.astype(jnp.float32))))
      except Exception as e:
        row.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        if args.verbose:
          traceback.print_exc()
      rows.append(row)
      print_row(row)


def bench_cascade(args, peak_gbps, rows):
  rng = np.random.default_rng(1)
  dtype = jnp.float32 if args.quick else jnp.bfloat16
  P, D = args.page_size, args.head_dim
  timing = dict(warmup=args.warmup, reps=args.repeats, inner=args.inner)
  impls = [n for n, kw in available_impls(args.quick) if kw and n in ("tpu", "gpu")][:1]
  impls.append("reference")
  for groups, group_size, prompt, suffix, num_kv, num_q in (
      QUICK_CASCADE if args.quick else FULL_CASCADE):
    batch = groups * group_size
    config = f"groups={groups} G={group_size} prompt={prompt} suffix={suffix} Hkv={num_kv} Hq={num_q}"
    try:
      prompt_pages, suffix_pages = prompt // P, suffix // P
      num_pages = 1 + groups * prompt_pages + batch * suffix_pages
      k = jnp.asarray(rng.standard_normal((num_kv, num_pages, P, D), np.float32), dtype)
      v = jnp.asarray(rng.standard_normal((num_kv, num_pages, P, D), np.float32), dtype)
      q = jnp.asarray(rng.standard_normal((batch, num_q, D), np.float32), dtype)
      perm = 1 + rng.permutation(num_pages - 1)
      prefix_table = perm[:groups * prompt_pages].reshape(groups, prompt_pages)
      suffix_table = perm[groups * prompt_pages:].reshape(batch, suffix_pages)
      plain_table = np.concatenate(
          [np.repeat(prefix_table, group_size, axis=0), suffix_table], axis=1)
      prefix_len = jnp.full((groups,), prompt, jnp.int32)
      suffix_len = jnp.full((batch,), suffix, jnp.int32)
      plain_len = jnp.full((batch,), prompt + suffix, jnp.int32)
    except Exception as e:
      rows.append(Row("cascade", config, "-", error=f"{type(e).__name__}: {e}"[:200]))
      print_row(rows[-1])
      continue
    sm_scale = D ** -0.5
    item = k.dtype.itemsize
    plain_bytes = 2 * batch * (prompt + suffix) * num_kv * D * item
    cascade_bytes = 2 * (groups * prompt + batch * suffix) * num_kv * D * item
    for impl in impls:
      kw = dict(sm_scale=sm_scale, impl=impl, interpret=args.quick and impl != "reference")
      bench_cascade_pair(config, group_size, kw, (q, k, v), (plain_len, plain_table),
                         (prefix_len, prefix_table, suffix_len, suffix_table),
                         plain_bytes, cascade_bytes, peak_gbps, timing, args, rows)


def bench_cascade_pair(config, group_size, kw, qkv, plain, cascade, plain_bytes,
                       cascade_bytes, peak_gbps, timing, args, rows):
  impl = kw["impl"]
  q, k, v = qkv
  plain_len, plain_table = plain
  prefix_len, prefix_table, suffix_len, suffix_table = cascade
  plain_time = plain_out = None
  for name, fn, fn_args, nbytes in (
      (f"plain[{impl}]", jax.jit(lambda *x: paged_attention(*x, **kw)),
       (q, k, v, plain_len, jnp.asarray(plain_table, jnp.int32)), plain_bytes),
      (f"cascade[{impl}]",
       jax.jit(lambda *x: cascade_paged_attention(*x, group_size=group_size, **kw)),
       (q, k, v, prefix_len, jnp.asarray(prefix_table, jnp.int32), suffix_len,
        jnp.asarray(suffix_table, jnp.int32)), cascade_bytes)):
    row = Row("cascade", config, name)
    try:
      out = jax.block_until_ready(fn(*fn_args))
      seconds = median_time(fn, *fn_args, **timing)
      fill_row(row, seconds, nbytes, peak_gbps, plain_time)
      if plain_time is None:
        plain_time, plain_out = seconds, out
      else:
        row.max_err = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                            - plain_out.astype(jnp.float32))))
    except Exception as e:
      row.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
      if args.verbose:
        traceback.print_exc()
    rows.append(row)
    print_row(row)


def fill_row(row: Row, seconds: float, nbytes: int, peak_gbps: float, base_time):
  row.time_us = seconds * 1e6
  row.gbps = nbytes / seconds / 1e9
  row.peak_frac = row.gbps / peak_gbps
  row.speedup = None if base_time is None else base_time / seconds


HEADER = ("table", "config", "impl", "time_us", "GB/s", "%peak", "speedup", "max_err", "error")


def _cells(row: Row):
  fmt = lambda x, f: "" if x is None else format(x, f)
  return (row.table, row.config, row.impl, fmt(row.time_us, ".1f"), fmt(row.gbps, ".1f"),
          fmt(None if row.peak_frac is None else 100 * row.peak_frac, ".1f"),
          fmt(row.speedup, ".2f"), fmt(row.max_err, ".2e"), row.error or "")


def print_row(row: Row):
  print(" | ".join(_cells(row)), flush=True)


def to_markdown(rows, meta) -> str:
  lines = [f"# bench_kernels ({meta['device_kind']}, peak {meta['peak_gbps']} GB/s, "
           f"jax {meta['jax']}{', quick' if meta['quick'] else ''})", "",
           "speedup: vs reference (paged) / vs plain paged (cascade); "
           "max_err: vs the same baseline.", "",
           "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
  lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
  return "\n".join(lines) + "\n"


_FLAGS = (
    flags.DEFINE_bool("quick", False, "Tiny f32 shapes, Pallas kernels in interpret mode (CPU)."),
    flags.DEFINE_float("peak_gbps", None, "HBM peak in GB/s (default: by device kind, H200 "
                       "4800)."),
    flags.DEFINE_string("out", None, "Write results: *.json as JSON, anything else as "
                        "markdown."),
    flags.DEFINE_integer("page_size", 16, "KV cache page size."),
    flags.DEFINE_integer("head_dim", 128, "Head dimension."),
    flags.DEFINE_integer("warmup", 2, "Calls before timing (compilation)."),
    flags.DEFINE_integer("repeats", None, "Timed runs (default 7, --quick 3)."),
    flags.DEFINE_integer("inner", None, "Back-to-back calls per timed run (default 10, --quick "
                         "1)."),
    flags.DEFINE_bool("skip_cascade", False, "Skip the cascade attention table."),
    flags.DEFINE_bool("verbose", False, "Print tracebacks."),
)


def main(argv):
  del argv
  args = types.SimpleNamespace(**{f.name: f.value for f in _FLAGS})
  device = jax.devices()[0]
  kind = device.device_kind
  peak = args.peak_gbps or next(
      (v for k, v in PEAK_GBPS.items() if k.lower() in kind.lower()), None)
  if peak is None:
    peak = PEAK_GBPS["cpu"] if device.platform == "cpu" else 1000.0
    print(f"note: unknown device kind {kind!r}; assuming {peak} GB/s peak "
          "(pass --peak_gbps)")
  if device.platform == "cpu" and not args.quick:
    print("note: no accelerator, so the Pallas kernels can only run in interpret "
          "mode and the full shapes would take hours: running --quick instead.")
    args.quick = True
  if args.quick:
    args.head_dim = min(args.head_dim, 64)
  args.repeats = args.repeats or (3 if args.quick else 7)
  args.inner = args.inner or (1 if args.quick else 10)
  meta = dict(device_kind=kind, platform=device.platform, peak_gbps=peak,
              jax=jax.__version__, quick=args.quick, page_size=args.page_size,
              head_dim=args.head_dim)
  print(f"device: {kind} ({device.platform}), peak {peak} GB/s, jax {jax.__version__}")
  print(" | ".join(HEADER))

  rows: list[Row] = []
  bench_paged(args, peak, rows)
  if not args.skip_cascade:
    bench_cascade(args, peak, rows)

  if args.out:
    if args.out.endswith(".json"):
      with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=[dataclasses.asdict(r) for r in rows]), f, indent=1)
    else:
      with open(args.out, "w") as f:
        f.write(to_markdown(rows, meta))
    print(f"wrote {args.out}")
  failed = sum(r.error is not None for r in rows)
  print(f"{len(rows) - failed} rows ok, {failed} with errors")


if __name__ == "__main__":
  app.run(main)
