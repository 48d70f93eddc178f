r"""Compile time of the training step against depth, layers unrolled vs scanned (issue 39).

For each depth and each `model.scan_layers`, builds the trainer's jitted halves on a config
(no warm start: the time is XLA's, not the weights') and times lowering + compiling the
rollout and the update, side by side in one process; prints each time, the deep / shallow
ratio per mode and the optimized HLO's size, for each `--sampler` (both samplers scan their
layers when asked, rlx.model.transformer.scans_layers).

  python experiments/benchmarks/compile_depth.py --config=experiments/reasoning.py \
      --depths=4,24 --sampler=paged,dense
"""

import os
import sys
import tempfile
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from rlx import configs, train, trainer

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/reasoning.py", "Config file.")
_DEPTHS = flags.DEFINE_list("depths", ["4", "24"], "model.num_layers values.")
_SAMPLERS = flags.DEFINE_list("sampler", ["paged", "dense"], "sampler.impl values.")


def compile_seconds(config, workdir: str) -> dict[str, float]:
  """Seconds to lower and compile the rollout and the update of `config`'s first step."""
  setup = trainer.build(config, workdir, log=lambda s: None)
  fns, state = setup.fns, setup.state
  pool = jax.device_put(setup.exp.train_pool, fns.pool_sharding)
  out = {}
  t0 = time.perf_counter()
  rollout = fns.rollout.lower(state, pool).compile()
  out["rollout"] = time.perf_counter() - t0
  state, ro = rollout(state, pool)  # (the rollout donates the state it is given)
  shape = train.update_shape(ro, setup.step_cfg, jax.device_count())
  fn = fns.update._make(shape["width"], shape.get("rows"), shape.get("parts"))  # pylint: disable=protected-access
  t0 = time.perf_counter()
  update = fn.lower(state, ro).compile()
  out["update"] = time.perf_counter() - t0
  out["rollout_hlo"] = len(rollout.as_text())
  out["update_hlo"] = len(update.as_text())
  return out


def main(_):
  depths = [int(d) for d in _DEPTHS.value]
  # Not timed: the process's first build pays one-off costs (imports, XLA's own warm-up)
  # that would land on whichever case came first.
  with tempfile.TemporaryDirectory() as wd:
    compile_seconds(configs.with_overrides(_CONFIG.value, {
        "model.num_layers": depths[0], "sft.steps": 0, "total_steps": 1}),
                    os.path.join(wd, "run"))
  rows = []
  for sampler in _SAMPLERS.value:
    for scan in (False, True):
      times = {}
      for depth in depths:
        config = configs.with_overrides(_CONFIG.value, {
            "model.num_layers": depth, "model.scan_layers": scan, "sampler.impl": sampler,
            "sft.steps": 0, "total_steps": 1})
        with tempfile.TemporaryDirectory() as wd:
          times[depth] = compile_seconds(config, os.path.join(wd, "run"))
        t = times[depth]
        print(f"[compile_depth] {sampler:5s} scan={int(scan)} layers={depth:3d}: rollout "
              f"{t['rollout']:6.1f} s ({t['rollout_hlo'] / 1e3:.0f}k HLO chars), update "
              f"{t['update']:6.1f} s ({t['update_hlo'] / 1e3:.0f}k)", file=sys.stderr, flush=True)
      rows.append((sampler, scan, times))
  lo, hi = depths[0], depths[-1]
  print(f"\n| sampler | layers | rollout s @{lo} | @{hi} | ratio | update s @{lo} | @{hi} | "
        f"ratio | step ratio |")
  print("|---|---|---|---|---|---|---|---|---|")
  for sampler, scan, t in rows:
    r, u = (t[hi][k] / t[lo][k] for k in ("rollout", "update"))
    step = (t[hi]["rollout"] + t[hi]["update"]) / (t[lo]["rollout"] + t[lo]["update"])
    print(f"| {sampler} | {'scanned' if scan else 'unrolled'} | {t[lo]['rollout']:.1f} | "
          f"{t[hi]['rollout']:.1f} | {r:.2f}x | {t[lo]['update']:.1f} | {t[hi]['update']:.1f} "
          f"| {u:.2f}x | {step:.2f}x |")


if __name__ == "__main__":
  app.run(main)
