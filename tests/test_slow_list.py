"""The `slow` list in tests/conftest.py (the fast tier is `-m "not slow"`): every entry still
names a test file or a test function in it, so a renamed or deleted test cannot leave a stale
entry behind while its replacement silently joins the fast tier."""

import ast
import os

import conftest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tests_in(path: str) -> set[str]:
  """Test functions of a file: `name` at module level, `Class::name` inside a class."""
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      names.add(node.name)
    elif isinstance(node, ast.ClassDef):
      names |= {f"{node.name}::{m.name}" for m in node.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
  return {n for n in names if n.split("::")[-1].startswith("test")}


def test_every_slow_entry_names_an_existing_test():
  stale = []
  for entry in conftest.SLOW:
    path, _, name = entry.partition("::")
    if not os.path.isfile(os.path.join(REPO, path)):
      stale.append(f"{entry} (no file {path})")
    elif name and name not in _tests_in(path):
      stale.append(f"{entry} (no test {name} in {path})")
  assert not stale, "tests/conftest.py SLOW names tests that do not exist: " + ", ".join(stale)
  assert len(set(conftest.SLOW)) == len(conftest.SLOW), "an entry is listed twice"


def test_an_entry_marks_its_file_or_every_parametrization_of_its_test():
  entry = conftest.SLOW[-1]
  assert conftest.is_slow(entry) and conftest.is_slow(entry + "[0-cpu]")
  assert not conftest.is_slow(entry + "_and_more")
  assert conftest.is_slow("tests/test_main.py::anything") and "tests/test_main.py" in conftest.SLOW
