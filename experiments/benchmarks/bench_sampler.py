r"""Rollout throughput: rlx paged sampler vs rlx dense sampler vs Hugging Face `generate`.

  python experiments/benchmarks/bench_sampler.py                # 3M and 100M models, both workloads
  python experiments/benchmarks/bench_sampler.py --quick       # tiny model, seconds (CPU smoke run)
  python experiments/benchmarks/bench_sampler.py --sizes=3m --reps=5

All engines run the same weights (rlx params exported with `rlx.model.hf.save_hf` and loaded
by `transformers.AutoModelForCausalLM`, f32), the same prompts and temperature-1 sampling
(no top-k / top-p). HF gets the faster of 1 thread and all cores (a short calibration run
each) with OMP_WAIT_POLICY=PASSIVE: with spinning OpenMP threads, HF runs on this shared
2-core machine took 10-100x longer at random. Runs are measured interleaved (engine A, B,
C, A, B, C, ...) after a warm-up call (compilation) each; the table shows medians. The rlx
paged sampler runs with page_size 8 (--page_size), 32 slots for the plain workload and
32 slots for the 128 GRPO sequences (continuous batching), other settings default.

Workloads:
  plain  32 prompts x 128 new tokens (prompts of 16..32 tokens); nobody stops early.
  grpo   16 prompts x G=8 samples, prompts of 64 tokens, response lengths long-tailed up to
         256 (log-normal, median ~48, at least one of 256). Lengths are forced, the same for
         every engine: the rlx paged sampler takes `forced_lengths_B` (stop tokens masked
         before that length, EOS forced at it) and Hugging Face gets a LogitsProcessor doing
         exactly that. The rlx dense sampler has no such switch; it runs with stop tokens
         disabled to max_new_tokens=256, which is the work it does with forced EOS as well
         (its loop ends when the longest sequence -- 256 tokens -- ends). Every engine is
         credited with the same useful tokens, sum(forced lengths).

Columns: new tok/s (useful tokens / median wall time, prefill included) and the same for the
best run (the machine is shared: the best run is the least disturbed); ratios (of medians)
vs HF and vs dense; roofline = the workload's lower-bound time on this machine / measured time, where the
lower bound is max(useful FLOPs / GEMM rate, minimum bytes / memory bandwidth) with both
rates measured by small probes in this process (useful FLOPs: every prompt once per group
plus every new token, matmuls + attention; minimum bytes: the weights once per step of the
longest sequence plus each token's K/V reads); KV held = the paged pool's peak pages in use
vs the dense cache [B, prompt + max_new] of the same work; held/stored = K/V slots held per
token actually stored (time average, each prompt counted once per group); slot util = slot
steps that produced a token / (iterations x slots).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from rlx.experiments.benchmarks.timing import best_time, seconds
from rlx.model import ModelConfig, init_params
from rlx.sampler import dense, paged
from rlx.sampler.sampling import SamplingParams

MODELS = {
    # Llama-shaped (silu MLP, GQA, RoPE, RMSNorm), tied embeddings.
    "tiny": ModelConfig(vocab_size=256, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                        head_dim=16, mlp_dim=128),
    "3m": ModelConfig(vocab_size=4096, num_layers=4, d_model=192, num_heads=6, num_kv_heads=2,
                      head_dim=32, mlp_dim=640),
    "100m": ModelConfig(vocab_size=32000, num_layers=12, d_model=768, num_heads=12,
                        num_kv_heads=4, head_dim=64, mlp_dim=2048),
}
EOS = 3


@dataclasses.dataclass
class Workload:
  name: str
  prompts: np.ndarray  # [B, Pw] group-major, left-padded
  lens: np.ndarray  # [B]
  forced: np.ndarray  # [B] response lengths
  group_size: int
  max_new: int
  slots: int  # paged max_slots


def make_workload(name: str, quick: bool, vocab: int, seed: int = 0) -> Workload:
  rng = np.random.default_rng(seed)
  if name == "plain":
    n, g, width, t = (8, 1, 16, 16) if quick else (32, 1, 32, 128)
    lens = rng.integers(width // 2, width + 1, n)
    forced = np.full(n * g, t)
    slots = n
  else:
    n, g, width, t = (4, 4, 16, 32) if quick else (16, 8, 64, 256)
    lens = np.full(n, width)
    forced = np.exp(rng.normal(np.log(t * 3 / 16), 0.9, n * g)).round().clip(4, t)
    forced[rng.integers(n * g)] = t
    slots = 8 if quick else 32
  prompts = np.zeros((n, width), np.int32)
  for i, k in enumerate(lens):
    prompts[i, width - k:] = rng.integers(4, vocab, k)
  return Workload(name, np.repeat(prompts, g, 0), np.repeat(lens, g).astype(np.int32),
                  forced.astype(np.int32), g, t, slots)


# ----------------------------------------------------------------------------- probes


def probe_machine(quick: bool) -> dict[str, float]:
  """Copy bandwidth (donated in-place pass) and the best f32 GEMM rate of a few shapes."""
  n = (8 if quick else 32) * 2**20
  step = jax.jit(lambda x: x * 1.000001 + 1e-7, donate_argnums=0)
  x = [jnp.ones((n,), jnp.float32)]

  def copy():  # each call consumes the buffer the last one returned
    x[0] = step(x[0])
    return x[0]

  bandwidth = 2 * 4 * n / best_time(copy, reps=7)
  gemm = 0.0
  for m, k, nn in [(1024, 1024, 1024), (256, 768, 2048), (32, 768, 2048)]:
    a, b = jnp.ones((m, k)), jnp.ones((k, nn))
    f = jax.jit(lambda a, b: a @ b)
    gemm = max(gemm, 2 * m * k * nn / best_time(f, a, b, reps=7))
  return {"bandwidth": bandwidth, "gemm": gemm}


def roofline_seconds(cfg: ModelConfig, wl: Workload, probe) -> float:
  """Lower bound on this machine for the useful work of the workload."""
  matmul_params = cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
  prompt_tokens = int(wl.lens[::wl.group_size].sum())
  new_tokens = int(wl.forced.sum())
  # Attention per new token over its context: QK and PV, 2 flops per MAC.
  ctx = sum(int(f) * int(p) + int(f) * (int(f) - 1) // 2 for p, f in zip(wl.lens, wl.forced))
  kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
  attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx
  flops = 2 * matmul_params * (prompt_tokens + new_tokens) + attn_flops
  weight_bytes = 4 * cfg.num_params()
  bytes_min = weight_bytes * int(wl.forced.max()) + kv_per_token * ctx
  return max(flops / probe["gemm"], bytes_min / probe["bandwidth"])


# ----------------------------------------------------------------------------- engines


def rlx_engines(cfg, graphdef, params, wl: Workload, page_size: int, cascade: bool = False):
  b = len(wl.lens)
  keys = jax.random.split(jax.random.key(0), b)
  sp_paged = SamplingParams(max_new_tokens=wl.max_new, temperature=1.0, eos_id=EOS)
  # Dense: no stop token (eos_id=-1 never matches) -- the work of forced lengths, see above.
  sp_dense = SamplingParams(max_new_tokens=int(wl.forced.max()), temperature=1.0, eos_id=-1)
  pc = paged.PagedConfig(page_size=page_size, max_slots=wl.slots)
  prompts, lens, forced = (jnp.asarray(x) for x in (wl.prompts, wl.lens, wl.forced))
  stats = {}

  def run_paged():
    ro, st = paged.generate(graphdef, params, prompts, lens, keys, sp=sp_paged, pc=pc,
                            group_size=wl.group_size, forced_lengths_B=forced,
                            return_stats=True)
    stats["last"] = st
    return ro

  def run_dense():
    return dense.generate(graphdef, params, prompts, lens, keys, params_cfg=sp_dense)

  engines = {"rlx paged": run_paged, "rlx dense": run_dense}
  if cascade and wl.group_size > 1:
    pc_cascade = dataclasses.replace(pc, cascade=True)
    engines["rlx cascade"] = lambda: paged.generate(
        graphdef, params, prompts, lens, keys, sp=sp_paged, pc=pc_cascade,
        group_size=wl.group_size, forced_lengths_B=forced)
  return engines, stats


def hf_engine(cfg, params, wl: Workload, tmpdir: str):
  """Returns (callable or None, reason)."""
  # Sleep instead of spinning at OpenMP barriers: on a shared machine spinning torch threads
  # wait for descheduled siblings and a run can take 10-100x longer. Only effective if torch
  # is not imported yet.
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  try:
    import torch
    import transformers
  except ImportError:
    return None, ("transformers/torch not installed: pip install -e .[parity]  (or pip "
                  "install torch transformers safetensors)")
  try:
    from rlx.model.hf import save_hf
  except ImportError as e:
    return None, f"rlx.model.hf.save_hf not available yet ({e}); HF engine skipped"
  torch.set_num_threads(os.cpu_count() or 1)
  out = os.path.join(tmpdir, "hf")
  save_hf(cfg, params, out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  ids = torch.tensor(wl.prompts, dtype=torch.long)
  width = ids.shape[1]
  mask = (torch.arange(width)[None, :] >= (width - torch.tensor(wl.lens))[:, None]).long()
  forced = torch.tensor(wl.forced, dtype=torch.long)

  class ForcedLengths(transformers.LogitsProcessor):
    """Masks EOS before a row's forced length and forces it at that length."""

    def __call__(self, input_ids, scores):
      made = input_ids.shape[1] - width  # tokens generated so far
      end = forced == made + 1
      scores[forced > made + 1, EOS] = -float("inf")
      scores[end] = -float("inf")
      scores[end, EOS] = 0.0
      return scores

  processors = transformers.LogitsProcessorList([ForcedLengths()])

  def run(max_new_tokens=int(forced.max())):
    with torch.no_grad():
      torch.manual_seed(0)
      return model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                            eos_token_id=EOS, pad_token_id=0, logits_processor=processors)

  # Give HF the faster of 1 thread and all cores, judged on a short generation.
  timings = {}
  for threads in sorted({1, os.cpu_count() or 1}):
    torch.set_num_threads(threads)
    run(8)
    start = time.perf_counter()
    run(16)
    timings[threads] = time.perf_counter() - start
  threads = min(timings, key=timings.get)
  torch.set_num_threads(threads)
  calibration = ", ".join(f"{k}: {v:.2f}s" for k, v in timings.items())
  return run, (f"HF generate: torch {torch.__version__}, transformers {transformers.__version__}"
               f", {threads} thread(s) (16-token calibration {calibration}), "
               f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")


# ----------------------------------------------------------------------------- main


def fmt(x, spec=".2f"):
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


_QUICK = flags.DEFINE_bool("quick", False, "Tiny model and workloads (seconds).")
_SIZES = flags.DEFINE_string("sizes", "3m,100m", "Comma list of " + ",".join(MODELS) + ".")
_WORKLOADS = flags.DEFINE_string("workloads", "plain,grpo", "Comma list of plain, grpo.")
_REPS = flags.DEFINE_integer("reps", 3, "Interleaved timed repetitions.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 8, "KV cache page size of the paged sampler.")
_HF = flags.DEFINE_bool("hf", True, "Time Hugging Face generate (--nohf: skip it).")
_CASCADE = flags.DEFINE_bool("cascade", False, "Also time the paged sampler with cascade "
                             "attention (GRPO workloads).")


def main(argv):
  del argv
  sizes = ["tiny"] if _QUICK.value else _SIZES.value.split(",")
  reps = 1 if _QUICK.value and _REPS.value == 3 else _REPS.value
  print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} x{jax.device_count()}, "
        f"{os.cpu_count()} CPUs, f32")
  probe = probe_machine(_QUICK.value)
  print(f"probes: copy bandwidth {probe['bandwidth'] / 1e9:.1f} GB/s, "
        f"best f32 GEMM {probe['gemm'] / 1e9:.0f} GFLOP/s")

  rows = []
  for size in sizes:
    cfg = MODELS[size]
    graphdef, params = init_params(cfg, seed=0)
    print(f"\nmodel {size}: {cfg.num_params() / 1e6:.1f}M params")
    with tempfile.TemporaryDirectory() as tmp:
      for wl_name in _WORKLOADS.value.split(","):
        wl = make_workload(wl_name, _QUICK.value, cfg.vocab_size)
        engines, stats = rlx_engines(cfg, graphdef, params, wl, _PAGE_SIZE.value, _CASCADE.value)
        note = ""
        if _HF.value:
          hf, note = hf_engine(cfg, params, wl, tmp)
          if hf is not None:
            engines["hf generate"] = hf
        if note:
          print(f"  {wl_name}: {note}")
        for name, fn in engines.items():  # warm-up: compile (HF warmed up by its calibration)
          if name != "hf generate":
            seconds(fn)
        times = {name: [] for name in engines}
        for _ in range(reps):
          for name, fn in engines.items():
            times[name].append(seconds(fn))
        useful = int(wl.forced.sum())
        floor = roofline_seconds(cfg, wl, probe)
        summ = stats["last"].summary()
        kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
        dense_kv = len(wl.lens) * (wl.prompts.shape[1] + int(wl.forced.max())) * kv_token
        med = {k: statistics.median(v) for k, v in times.items()}
        for name in engines:
          rows.append(dict(
              model=size, workload=wl_name, engine=name, secs=med[name],
              toks=useful / med[name], best=useful / min(times[name]),
              vs_hf=(med["hf generate"] / med[name]) if "hf generate" in med else None,
              vs_dense=med["rlx dense"] / med[name], roofline=floor / med[name],
              kv=(summ["peak_kv_tokens"] * kv_token / dense_kv) if name == "rlx paged" else None,
              held=summ["kv_held_over_stored"] if name == "rlx paged" else None,
              util=summ["slot_utilisation"] if name == "rlx paged" else None))
          print(f"  {wl_name:5s} {name:12s} {med[name]:8.3f} s  {useful / med[name]:9.1f} "
                f"tok/s  (runs: {', '.join(f'{t:.3f}' for t in times[name])})")

  print("\n| model | workload | engine | new tok/s | best tok/s | vs HF | vs dense | roofline "
        "| KV held vs dense | held/stored | slot util |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['model']} | {r['workload']} | {r['engine']} | {r['toks']:.0f} | {r['best']:.0f} | "
          f"{fmt(r['vs_hf'])}x | {fmt(r['vs_dense'])}x | {fmt(100 * r['roofline'], '.1f')}% | "
          f"{fmt(r['kv'])}x | {fmt(r['held'])} | "
          f"{fmt(None if r['util'] is None else 100 * r['util'], '.0f')}% |"
          .replace("-x", "-").replace("-%", "-"))


if __name__ == "__main__":
  app.run(main)
