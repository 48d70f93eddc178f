"""Executes the notebooks in colab/ in quick mode (RLX_NOTEBOOK_QUICK=1), as CI does.

Each notebook must run without an error and draw at least one figure. The kernel is the
"python3" kernel of this interpreter (jupyter_client launches it with sys.executable), started
in the repository root so that the notebooks find experiments/ and never reach the network.
"""

import json
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("quickstart", "sampler", "ablations")
CELL_TIMEOUT_S = 240


def execute(name: str, workdir: str, monkeypatch, **env: str):
  """Runs colab/<name>.ipynb in a fresh kernel; returns the executed notebook."""
  monkeypatch.setenv("RLX_NOTEBOOK_QUICK", "1")
  monkeypatch.setenv("RLX_NOTEBOOK_WORKDIR", workdir)
  monkeypatch.delenv("RLX_EFFICIENCY_RESULTS", raising=False)
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  nb = nbformat.read(os.path.join(ROOT, "colab", f"{name}.ipynb"), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                   resources={"metadata": {"path": ROOT}})
  client.execute()  # raises CellExecutionError naming the cell on any error
  return nb


def images(nb) -> int:
  return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
             for out in cell.get("outputs", []))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_saved_without_outputs(name):
  nb = nbformat.read(os.path.join(ROOT, "colab", f"{name}.ipynb"), as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(not c.outputs and c.execution_count is None for c in code), (
      f"colab/{name}.ipynb: clear the outputs before saving.")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_plots(name, tmp_path, monkeypatch):
  nb = execute(name, str(tmp_path), monkeypatch)
  assert images(nb) >= 1, f"colab/{name}.ipynb ran but drew no figure."
  if name != "sampler":  # the training notebooks ran in quick mode, in the test's workdir
    assert (tmp_path / f"{name}_quick").is_dir()


def test_ablations_plots_a_benchmark_results_file(tmp_path, monkeypatch):
  """The other branch of ablations.ipynb: a results.json of experiments/benchmarks/efficiency.py."""
  curves = {arm: [[[0, 0.0, 0.40], [5, 4e3 * k, 0.50], [10, 8e3 * k, 0.60 + 0.05 * seed]]
                  for seed in range(2)]
            for arm, k in (("B0", 1.0), ("S+R", 0.7))}
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"target": 0.58, "base": 0.40, "curves": curves}))
  nb = execute("ablations", str(tmp_path), monkeypatch, RLX_EFFICIENCY_RESULTS=str(path))
  assert images(nb) >= 1
  assert not (tmp_path / "ablations_quick").exists(), "with a results file nothing should train"
  printed = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                    for out in cell.get("outputs", []))
  assert "S+R" in printed and "0.625" in printed  # the median final accuracy of the fake runs
