"""The suite's own set-up (tests/conftest.py): the processes the tests start share one
persistent XLA compilation cache, the test processes themselves compile without it, and all
of them compile at LLVM -O0 without changing a number a test checks."""

import os
import subprocess
import sys

import jax
import pytest


def _cache_dir():
  if os.environ.get("JAX_COMPILATION_CACHE_DIR") != os.environ.get("RLX_TESTS_XLA_CACHE"):
    pytest.skip("RLX_TESTS_XLA_CACHE was set before the run: no shared cache")
  return os.environ["JAX_COMPILATION_CACHE_DIR"]


def test_this_process_compiles_without_the_persistent_cache():
  assert jax.config.jax_compilation_cache_dir is None
  cache = _cache_dir()
  assert os.path.isdir(cache) and os.stat(cache).st_uid == os.geteuid(), cache
  assert os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"


def test_a_started_process_writes_to_and_reads_from_the_shared_cache(tmp_path):
  cache = _cache_dir()
  code = ("import jax, jax.numpy as jnp, time; t = time.perf_counter(); "
          "jax.jit(lambda x: jnp.sin(x) * 41.5 + 7)(jnp.arange(5.0)).block_until_ready(); "
          "print(jax.config.jax_compilation_cache_dir)")
  run = lambda env: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   timeout=120, check=True, env=env)
  out = run(None)  # the environment a test's subprocess inherits
  assert out.stdout.strip() == cache and not out.stderr.strip(), out.stderr
  # Writing and reading, with the same settings in a directory of this test's own: the shared
  # one also receives what the other xdist worker's processes compile meanwhile (a listing
  # diff there raced with them once, 2026-12-06).
  private = str(tmp_path)
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": private}
  assert run(env).stdout.strip() == private
  new = sorted(os.listdir(private))
  assert any(n.endswith("-cache") for n in new), f"nothing written to the cache: {new}"
  # JAX's lock-guarded cache (a max size is set) stamps an entry's "-atime" file on each read.
  stamps = lambda: {n: open(os.path.join(private, n), "rb").read() for n in new
                    if n.endswith("-atime")}
  written = stamps()
  again = run(env)
  assert not again.stderr.strip(), again.stderr
  assert sorted(os.listdir(private)) == new  # nothing compiled anew
  assert stamps() != written, "the second process did not read the entries the first wrote"


def test_the_suites_o0_flag_changes_no_checked_number(tmp_path):
  """conftest compiles at LLVM -O0 to save time; this is the claim that makes that honest: a
  few training steps in a process at XLA's default flags and in one at -O0 give the same
  completions, parameters and compiled HLO (bitwise), and the same metrics to float rounding."""
  from conftest import O0_FLAG  # pylint: disable=import-outside-toplevel
  if O0_FLAG not in os.environ.get("XLA_FLAGS", ""):
    pytest.skip("the suite runs without the -O0 flag (RLX_TESTS_XLA_OPT or XLA_FLAGS)")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, os.path.join(repo, "experiments", "benchmarks", "step_fingerprint.py"),
         f"--config={os.path.join(repo, 'experiments', 'arith.py')}:runlocal",
         f"--workdir={tmp_path}", "--steps=3"]
  default_flags = os.environ["XLA_FLAGS"].replace(O0_FLAG, "").strip()
  outs = []
  for flags in (default_flags, os.environ["XLA_FLAGS"]):  # the first trains the shared base
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo,
                         env={**os.environ, "XLA_FLAGS": flags})
    assert out.returncode == 0, out.stderr[-3000:]
    outs.append(out.stdout.splitlines())
  default, o0 = outs
  assert len(default) == len(o0) > 10
  exact = [l for l in default if "sha1" in l]
  assert len(exact) == 6, exact  # 3 steps' completions, the params, two compiled programs
  for a, b in zip(default, o0):
    if "sha1" in a:
      assert a == b
    else:  # "  metric value"
      (ka, va), (kb, vb) = a.split(), b.split()
      assert ka == kb and float(va) == pytest.approx(float(vb), rel=1e-5, abs=1e-5), (a, b)
