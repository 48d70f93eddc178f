r"""Peak host memory of `rlx.model.hf.load_hf` against the checkpoint's size.

  python experiments/benchmarks/load_memory.py              # ~0.5B params (Qwen2.5-0.5B shape), f32
  python experiments/benchmarks/load_memory.py --dtype=bfloat16  # same model, bf16 files as bf16
  python experiments/benchmarks/load_memory.py --params=5e6 --json  # ~20 MB, seconds (the test)

Writes a random checkpoint one tensor at a time (the writer never holds the model), then
loads it in a fresh subprocess whose resident memory is sampled every 2 ms (and checked
against ru_maxrss). The loaded parameters live in host memory here (CPU backend), so the
best possible peak is baseline + checkpoint size; the table shows how close the loader gets:
`increase / checkpoint` should stay <= 1.3.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags


def _config(num_params: float):
  from rlx.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  if num_params >= 1e8:  # Qwen2.5-0.5B: 494M params, tied, 136M of them in the embedding
    return ModelConfig(vocab_size=151_936, num_layers=24, d_model=896, num_heads=14,
                       num_kv_heads=2, head_dim=64, mlp_dim=4864, qkv_bias=True,
                       tie_embeddings=True, rope_theta=1e6, max_position=32768)
  small = dict(vocab_size=8192, d_model=256, num_heads=4, num_kv_heads=2, head_dim=64,
               mlp_dim=1024, qkv_bias=True, tie_embeddings=True)
  per_layer = ModelConfig(num_layers=2, **small).num_params() - ModelConfig(
      num_layers=1, **small).num_params()
  layers = max(1, round((num_params - 8192 * 256) / per_layer))
  return ModelConfig(num_layers=layers, **small)


def write_checkpoint(out_dir: str, num_params: float, dtype: str) -> tuple[int, int]:
  """Random weights, streamed to disk one tensor at a time. Returns (params, file bytes)."""
  from rlx.model import hf  # pylint: disable=g-import-not-at-top
  from rlx.model.config import DTYPES  # pylint: disable=g-import-not-at-top
  cfg = _config(num_params)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf.config_to_hf(cfg, dtype=dtype), f, indent=2)
  tensors = []
  for path, (shape, _) in hf._param_paths(cfg).items():  # pylint: disable=protected-access
    name, transposed = hf.hf_name(cfg, path)
    tensors.append((name, shape[::-1] if transposed else shape))
  rng = np.random.default_rng(0)

  def fetch(name):
    shape = dict(tensors)[name]
    x = rng.standard_normal(shape, np.float32)
    x *= 0.02
    return x

  hf.write_safetensors(out_dir, sorted(tensors), fetch, dtype=np.dtype(DTYPES[dtype]))
  size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)
             if f.endswith(".safetensors"))
  return cfg.num_params(), size


def measure_load(ckpt_dir: str, dtype: str) -> dict:
  """Runs in the fresh subprocess: baseline RSS, then load_hf under a sampler thread."""
  import jax  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  from rlx.model import hf  # pylint: disable=g-import-not-at-top
  jax.devices()  # backend up before the baseline
  proc = psutil.Process()
  baseline = proc.memory_info().rss
  peak = [baseline]
  stop = threading.Event()

  def sample():
    while not stop.is_set():
      peak[0] = max(peak[0], proc.memory_info().rss)
      time.sleep(0.002)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  t0 = time.perf_counter()
  _, params = hf.load_hf(ckpt_dir, dtype=dtype)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - t0
  stop.set()
  thread.join()
  maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
  return {"baseline_rss_bytes": baseline, "peak_rss_bytes": max(peak[0], maxrss),
          "params_bytes": int(sum(x.nbytes for x in jax.tree.leaves(params))),
          "load_seconds": seconds}


_PARAMS = flags.DEFINE_float("params", 5e8, "Approximate parameter count.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Dtype of the files and of the loaded params.")
_DIR = flags.DEFINE_string("dir", None, "Where to write the checkpoint (default: a temp dir).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line only.")
_MEASURE = flags.DEFINE_string("measure", None, "Child mode: load this checkpoint and measure.")


def main(argv):
  del argv
  if _MEASURE.value:
    print(json.dumps(measure_load(_MEASURE.value, _DTYPE.value)))
    return

  with tempfile.TemporaryDirectory(dir=_DIR.value) as tmp:
    ckpt = os.path.join(tmp, "ckpt")
    t0 = time.perf_counter()
    num_params, size = write_checkpoint(ckpt, _PARAMS.value, _DTYPE.value)
    write_s = time.perf_counter() - t0
    writer_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    child = subprocess.run([sys.executable, os.path.abspath(__file__), f"--measure={ckpt}",
                            f"--dtype={_DTYPE.value}"], capture_output=True, text=True, check=False)
    if child.returncode:
      sys.exit(f"loader subprocess failed:\n{child.stderr[-3000:]}")
    r = json.loads(child.stdout.strip().splitlines()[-1])
  increase = r["peak_rss_bytes"] - r["baseline_rss_bytes"]
  result = {"num_params": num_params, "dtype": _DTYPE.value, "checkpoint_bytes": size,
            "writer_peak_rss_bytes": writer_rss, "write_seconds": write_s, **r,
            "rss_increase_bytes": increase, "increase_over_checkpoint": increase / size,
            "peak_over_checkpoint": r["peak_rss_bytes"] / size}
  if _JSON.value:
    print(json.dumps(result))
    return
  mb = lambda b: f"{b / 2**20:,.0f} MiB"  # pylint: disable=unnecessary-lambda-assignment
  rows = [("parameters", f"{num_params / 1e6:,.1f} M ({_DTYPE.value})"),
          ("checkpoint on disk", mb(size)),
          ("writer peak RSS", mb(writer_rss)),
          ("loader baseline RSS (jax + rlx imported)", mb(r["baseline_rss_bytes"])),
          ("loader peak RSS", mb(r["peak_rss_bytes"])),
          ("loaded params", mb(r["params_bytes"])),
          ("peak - baseline", mb(increase)),
          ("(peak - baseline) / checkpoint", f"{increase / size:.3f}"),
          ("peak / checkpoint", f"{r['peak_rss_bytes'] / size:.3f}"),
          ("load time", f"{r['load_seconds']:.1f} s"),
          ("write time", f"{write_s:.1f} s")]
  width = max(len(k) for k, _ in rows)
  for k, v in rows:
    print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
  app.run(main)
