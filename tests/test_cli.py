"""python -m rlx.main as a user meets it: shipped experiment names from any directory, one-line
errors for a bad --config, no backend-probe noise, and Ctrl-C without a traceback."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*flags, cwd, timeout=120):
  return subprocess.run([sys.executable, "-m", "rlx.main", *flags], capture_output=True,
                        text=True, timeout=timeout, cwd=cwd)


def one_error_line(out):
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr
  return lines[0]


@pytest.mark.parametrize("config", [["--config=arith:runlocal"], ["--config", "arith:runlocal"]])
def test_a_shipped_experiment_runs_by_name_from_any_directory(config, tmp_path):
  out = cli(*config, f"--workdir={tmp_path / 'wd'}", "--dry_run", cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "model: 0.0M params, 2 layers, d_model 32" in out.stdout  # the runlocal variant
  assert "memory plan per device" in out.stdout
  assert "Unable to initialize backend" not in out.stderr  # JAX's platform probe stays quiet
  assert "Traceback" not in out.stderr


@pytest.mark.parametrize("config, cwd", [
    ("experiments/nope.py", REPO),
    ("experiments/arith.py", "tmp"),  # a relative path from another directory
    ("nope", "tmp"),  # neither a file nor a shipped name
])
def test_a_missing_config_file_is_one_line(config, cwd, tmp_path):
  out = cli(f"--config={config}:runlocal", f"--workdir={tmp_path / 'wd'}",
            cwd=tmp_path if cwd == "tmp" else cwd)
  line = one_error_line(out)
  prefix = (f"rlx: error: config file '{config}' does not exist; pass a path or a shipped "
            f"experiment name (")
  assert line.startswith(prefix), line
  names = line[len(prefix):-1].split(", ")
  assert {"arith", "hf_rl"} <= set(names), line
  assert not os.path.exists(tmp_path / "wd")


@pytest.mark.parametrize("source, arg, message", [
    ("def get_config(arg):\n  return 1 / 0\n", "", "config file '{path}' failed to load: "
     "ZeroDivisionError: division by zero (set RLX_TRACEBACK=1 for the traceback)"),
    ("import no_such_module_xyz\n", "", "config file '{path}' failed to load: "
     "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("x = 1\n", "", "config file '{path}' defines no get_config(arg); expected an experiment "
     "config like experiments/arith.py."),
    (None, "bogus", "config 'arith': Unknown config variant 'bogus'; expected '' or "
     "'runlocal'."),
])
def test_a_config_that_fails_to_load_is_one_line(source, arg, message, tmp_path):
  path = "arith"
  if source is not None:
    path = str(tmp_path / "my_config.py")
    with open(path, "w") as f:
      f.write(source)
  out = cli(f"--config={path}:{arg}", f"--workdir={tmp_path / 'wd'}", cwd=tmp_path)
  assert one_error_line(out).startswith("rlx: error: " + message.format(path=path))


def popen(*flags, cwd):
  proc = subprocess.Popen([sys.executable, "-m", "rlx.main", *flags], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
  seen = {"stdout": [], "stderr": []}

  def read(name, stream):
    for chunk in iter(lambda: stream.read(1), ""):
      seen[name].append(chunk)

  readers = [threading.Thread(target=read, args=(n, getattr(proc, n)), daemon=True)
             for n in seen]
  for r in readers:
    r.start()

  def text():
    return "".join(seen["stdout"]), "".join(seen["stderr"])

  def wait(timeout):
    proc.wait(timeout=timeout)
    for r in readers:
      r.join(timeout=10)
    return text()

  return proc, text, wait


def test_ctrl_c_while_the_config_loads_exits_130(tmp_path):
  slow = tmp_path / "slow.py"
  slow.write_text("import sys, time\n\n\ndef get_config(arg=''):\n"
                  "  print('loading config', file=sys.stderr, flush=True)\n  time.sleep(120)\n")
  proc, text, wait = popen(f"--config={slow}", f"--workdir={tmp_path / 'wd'}", cwd=tmp_path)
  try:
    deadline = time.time() + 120
    while "loading config" not in text()[1] and time.time() < deadline:
      time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = wait(60)
  finally:
    proc.kill()
  assert proc.returncode == 130, err[-2000:]
  assert "rlx: interrupted (Ctrl-C)" in err
  assert "Traceback" not in err


def test_ctrl_c_during_a_fresh_run_is_one_line(tmp_path):
  # A fresh workdir starts with the supervised warm start; Ctrl-C there either stops at once
  # (130) or, once the trainer handles signals, at the next boundary (75: rerun to resume).
  proc, text, wait = popen("--config=arith:runlocal", f"--workdir={tmp_path / 'wd'}",
                           cwd=tmp_path)
  try:
    deadline = time.time() + 30
    while "warm start" not in "".join(text()) and time.time() < deadline:
      time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = wait(120)
  finally:
    proc.kill()
  assert proc.returncode in (130, 75), err[-2000:]
  assert "Traceback" not in err
  assert "rlx: interrupted (Ctrl-C)" in err or "rlx: stopped by SIGINT" in err, err[-2000:]
  assert "Unable to initialize backend" not in err
