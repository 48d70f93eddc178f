r"""Fingerprint of a few training steps: every metric of each step, a checksum of the params
after them and of the two compiled halves (XLA's optimized HLO of rollout and update, source
locations stripped), for comparing two versions of the code on the same config, seed and base
model: equal HLO hashes mean the same computation, so any step-time difference is noise.

Runs the trainer's own jitted halves (rollout, then update) exactly as bench_step.py does, so
it runs unchanged against an older checkout (PYTHONPATH=/path/to/checkout):

  python experiments/benchmarks/step_fingerprint.py --config=experiments/arith.py \
      --workdir=/tmp/fp_new \
      --config.warm_start.dir=/tmp/rlx_arith/base --steps=3 > /tmp/fp_new.txt
  PYTHONPATH=/tmp/wt_before python experiments/benchmarks/step_fingerprint.py ... > /tmp/fp_old.txt
  diff /tmp/fp_old.txt /tmp/fp_new.txt
"""

import hashlib
import os
import re
import sys

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

import rlx
from rlx import train, trainer

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/arith.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_fingerprint", "Workdir (data cache).")
_STEPS = flags.DEFINE_integer("steps", 3, "Training steps.")
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "Also write the compiled HLO texts here.")


def main(_):
  print(f"# rlx from {rlx.__file__}", file=sys.stderr)
  setup = trainer.build(_CONFIG.value, _WORKDIR.value, log=lambda s: print(s, file=sys.stderr))
  fns, state = setup.fns, setup.state
  pool = jax.device_put(setup.exp.train_pool, fns.pool_sharding)
  for i in range(_STEPS.value):
    state, ro = fns.rollout(state, pool)
    shape = train.update_shape(ro, setup.step_cfg, jax.device_count())
    state, m = fns.update(state, ro, **shape)
    m = jax.device_get(m)
    toks = hashlib.sha1(np.asarray(ro.batch.completions).tobytes()).hexdigest()[:12]
    print(f"step {i} shape {shape} completions sha1 {toks}")
    for k in sorted(m):
      print(f"  {k} {float(np.asarray(m[k])):.9g}")
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))
  h = hashlib.sha1()
  for path, x in leaves:
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.ascontiguousarray(x).tobytes())
  print(f"params after {_STEPS.value} steps: {len(leaves)} leaves, sha1 {h.hexdigest()}")
  # The compiled programs themselves (XLA's optimized HLO without source metadata): equal
  # hashes mean the two versions run the same computation, whatever the timing noise.
  for name, fn, args, kw in (("rollout", fns.rollout, (state, pool), {}),
                             ("update", fns.update, (state, ro), shape)):
    if kw:  # update: one jitted function per static shape (train._ByShape)
      fn = fn._fns[(kw["width"], kw.get("rows"), kw.get("parts"))]  # pylint: disable=protected-access
    text = fn.lower(*args).compile().as_text()
    # Source locations (file / function / frame tables) name the checkout; drop them.
    text = re.sub(r"\nFileNames\n.*?\n(?=%)", "\n", text, flags=re.S)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^HloModule \S+", "HloModule", text)
    print(f"compiled {name}: {len(text.splitlines())} HLO lines, sha1 "
          f"{hashlib.sha1(text.encode()).hexdigest()}")
    if _HLO_DIR.value:
      os.makedirs(_HLO_DIR.value, exist_ok=True)
      with open(os.path.join(_HLO_DIR.value, f"{name}.hlo.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
  app.run(main)
