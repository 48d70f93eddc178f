r"""Pipeline benchmark: the same run in sync and overlap modes, side by side (rlx.pipeline).

Trains the experiment's config for --steps steps from the same base model, in this process,
on --devices fake CPU devices, three ways:
  sync        one mesh of every device: generation, then the update (config.pipeline sync)
  sync-split  generator and learner sub-meshes, max_staleness=0: the sync schedule on the
              split devices (each sub-mesh idles while the other works)
  overlap     the same sub-meshes, max_staleness=1: batch t+1 generated while batch t trains
and prints medians over the steps after compilation of: the step's wall time, generation and
update busy times, the overlap fraction (the share of each generation that ran while the
learner computed), and each sub-mesh's idle share (idle / (idle + busy), from the dispatch
and ready timestamps the pipeline records).

On this machine the fake devices share 2 CPU cores, so the two sub-meshes compete for the
same cores and overlap cannot shorten a step much; what is measured here is that the two
programs really run at once and where each sub-mesh waits. The speedup to expect on a pod is
then modelled from the sync run's measured generation and update times (printed below the
table with its assumptions):

  step_sync    = G + U                                     (N devices take turns)
  step_overlap = max(G * (N/g)^a, U * N/(N-g))              (g generator devices)

with the update scaling linearly with its devices (compute-bound data parallelism) and the
generation by (N/g)^a: a = 1 if decoding were compute-bound, a ~ 0 when it is bound by
reading the weights and KV cache (each decode step's cost hardly depends on the batch per
device, the regime long completions decode in). The table gives the best split and speedup
for a in {0, 0.5, 1}.

  python experiments/benchmarks/bench_pipeline.py --config=experiments/reasoning.py \
      --config.warm_start.dir=/tmp/rlx_reasoning/base --workdir_root=/tmp/rlx_bench_pipe
  python experiments/benchmarks/bench_pipeline.py --config=experiments/arith.py:runlocal --steps=6 \
      --workdir_root=/tmp/bp_local
"""

import json
import os
import shutil
import statistics

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/reasoning.py", "Config file.")
_ROOT = flags.DEFINE_string("workdir_root", "/tmp/rlx_bench_pipeline", "Where runs go.")
_STEPS = flags.DEFINE_integer("steps", 12, "Steps per mode (the first 2 compile).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Fake CPU devices.")
_GEN = flags.DEFINE_integer("generator_devices", 4, "Generator sub-mesh size.")
_MODES = flags.DEFINE_list("modes", ["sync", "sync-split", "overlap"], "Modes to run.")

SKIP = 2  # steps whose times include compilation


def mode_overrides(mode: str, steps: int, gen: int) -> dict:
  o = {"total_steps": steps, "eval_every": steps, "checkpoint_every": steps}
  if mode != "sync":
    o.update({"pipeline.mode": "overlap", "pipeline.generator_devices": gen,
              "pipeline.max_staleness": 0 if mode == "sync-split" else 1})
  return o


def summarize(lines: list[dict], mode: str) -> dict:
  rows = [l for l in lines if l.get("step", 0) > SKIP and "time/step_s" in l]
  med = lambda k: statistics.median(l[k] for l in rows) if rows else float("nan")
  out = {"steps": len(rows), "step_s": med("time/step_s"), "generate_s": med("time/generate_s"),
         "update_s": med("time/update_s")}
  if mode == "sync":
    out.update(overlap_frac=0.0, gen_idle=float("nan"), learn_idle=float("nan"))
  else:
    share = lambda idle, busy: statistics.median(
        l[idle] / max(l[idle] + l[busy], 1e-9) for l in rows)
    out.update(overlap_frac=med("pipeline/overlap_frac"),
               gen_idle=share("pipeline/gen_idle_s", "time/generate_s"),
               learn_idle=share("pipeline/learn_idle_s", "time/update_s"))
  return out


def pod_model(g_time: float, u_time: float, n: int = 64) -> list[str]:
  """Best generator share and speedup over sync for exponents a (see the docstring)."""
  lines = [f"Pod model from the sync run's G = {g_time:.3f}s, U = {u_time:.3f}s per step "
           f"(G / (G+U) = {g_time / (g_time + u_time):.0%}), N = {n} devices:", "",
           "| generation scaling a | best generator devices | step sync | step overlap | "
           "speedup |", "|---|---|---|---|---|"]
  for a in (0.0, 0.5, 1.0):
    best = min(range(1, n), key=lambda g: max(g_time * (n / g) ** a, u_time * n / (n - g)))
    t = max(g_time * (n / best) ** a, u_time * n / (n - best))
    lines.append(f"| {a:g} | {best} of {n} | {g_time + u_time:.3f}s | {t:.3f}s | "
                 f"{(g_time + u_time) / t:.2f}x |")
  return lines


def main(_):
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  from rlx import configs, trainer  # pylint: disable=g-import-not-at-top
  from rlx.metrics import read_jsonl  # pylint: disable=g-import-not-at-top
  root = _ROOT.value
  os.makedirs(root, exist_ok=True)
  base = _CONFIG.value
  results = {}
  for mode in _MODES.value:
    wd = os.path.join(root, mode)
    shutil.rmtree(wd, ignore_errors=True)
    cfg = configs.with_overrides(base, mode_overrides(mode, _STEPS.value, _GEN.value))
    if not base.warm_start.dir and results:  # reuse the first mode's warm start
      cfg.warm_start.dir = os.path.join(root, _MODES.value[0], "base")
    print(f"[bench_pipeline] {mode}: {_STEPS.value} steps", flush=True)
    trainer.run(cfg, wd, log=lambda s: None, show_progress=False)
    results[mode] = summarize(read_jsonl(os.path.join(wd, "metrics.jsonl")), mode)
  g = _GEN.value
  lines = [f"{_DEVICES.value} fake CPU devices (sub-meshes: generator {g}, learner "
           f"{_DEVICES.value - g}); medians over steps {SKIP + 1}-{_STEPS.value}.", "",
           "| mode | step wall s | generation busy s | update busy s | overlap fraction | "
           "generator idle share | learner idle share |", "|---|---|---|---|---|---|---|"]
  pct = lambda x: "-" if x != x else f"{x:.0%}"
  for mode, r in results.items():
    lines.append(f"| {mode} | {r['step_s']:.3f} | {r['generate_s']:.3f} | {r['update_s']:.3f} "
                 f"| {pct(r['overlap_frac'])} | {pct(r['gen_idle'])} | "
                 f"{pct(r['learn_idle'])} |")
  if "sync" in results and "overlap" in results:
    lines += ["", f"overlap / sync step time: "
              f"{results['overlap']['step_s'] / results['sync']['step_s']:.2f}x "
              f"(2 shared cores: the sub-meshes compete for them)"]
  if "sync" in results:
    lines += [""] + pod_model(results["sync"]["generate_s"], results["sync"]["update_s"])
  text = "\n".join(lines)
  print("\n" + text)
  with open(os.path.join(root, "results.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(root, "results.json"), "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
