"""The repository's kernels/ directory is rlx.kernels only: with the repository root on
sys.path (`python -m pytest` from it, a notebook started there) it must not stand in for
another project's top-level `kernels` package (transformers >= 5.25 imports Hugging Face's
`kernels` when it is installed, and failed on every model load when it found this one)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code, *extra_path):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join((ROOT,) + extra_path)}
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_top_level_kernels_is_the_other_package_and_rlx_kernels_still_works(tmp_path):
  other = tmp_path / "kernels"
  other.mkdir()
  (other / "__init__.py").write_text("from .layer import NAME\n")
  (other / "layer.py").write_text("NAME = 'the other kernels'\n")
  r = _run("import kernels, kernels.layer, rlx.kernels\n"
           "print(kernels.NAME, kernels.layer.__file__.startswith(%r))\n"
           "print(callable(rlx.kernels.paged_attention), rlx.kernels.__name__)" % str(tmp_path),
           str(tmp_path))
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split("\n")[:2] == ["the other kernels True", "True rlx.kernels"]


def test_without_another_kernels_the_import_error_says_what_this_directory_is():
  r = _run("import sys\n"
           "sys.path = [p for p in sys.path if not p.endswith(('site-packages', 'dist-packages'))]\n"
           "try:\n  import kernels\nexcept ModuleNotFoundError as e:\n  print('MNF', e.name, e)\n"
           "print('kernels' in sys.modules)")
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.strip().split("\n")
  assert lines[0].startswith("MNF kernels ") and "rlx.kernels" in lines[0]
  assert lines[1] == "False"
