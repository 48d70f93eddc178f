"""The suite's per-test time limit (pytest.ini): a hang fails its one test, also under xdist as
CI runs the suite, instead of stalling CI until the job's limit."""

import configparser
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INI = os.path.join(REPO, "pytest.ini")


def test_every_test_has_a_time_limit():
  ini = configparser.ConfigParser()
  ini.read(INI)
  assert 600 <= float(ini["pytest"]["timeout"]) <= 1800
  # signal: the hung test fails and its worker goes on (the thread method kills the worker,
  # and xdist reruns the same file on a new one, where it hangs again).
  assert ini["pytest"]["timeout_method"] == "signal"


def test_a_hang_fails_one_test_and_the_others_run_under_xdist(tmp_path):
  (tmp_path / "test_hangs.py").write_text(
      "import time\n"
      "def test_before():\n  pass\n"
      "def test_hangs():\n  time.sleep(600)\n"
      "def test_after():\n  pass\n")
  (tmp_path / "test_other.py").write_text("def test_other():\n  pass\n")
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-c", INI, f"--rootdir={tmp_path}", "-o", "timeout=3",
       "-q", "-n", "2", "--dist", "loadfile", str(tmp_path)],
      capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert out.returncode == 1, out.stdout[-3000:]
  assert "FAILED test_hangs.py::test_hangs - Failed: Timeout (>3.0s)" in out.stdout, out.stdout
  assert "1 failed, 3 passed" in out.stdout, out.stdout[-3000:]
