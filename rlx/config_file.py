"""Experiment config files: one rule to find them, for rlx.main, rlx.sweep and rlx.load_config.

--config=NAME[:arg] (and rlx.load_config(NAME)) takes a config file or the name of an experiment
shipped with rlx (experiments/, installed as rlx.experiments), so `--config=arith:runlocal`
works from any directory: a file of that name wins; otherwise a plain name (no directory, no
.py) is looked up among the shipped experiments. A directory of that name (e.g. a workdir called
`arith`) does not hide the shipped experiment.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pkgutil
from types import ModuleType

from rlx.errors import ConfigError


class NoGetConfig(ConfigError):
  """A config file without get_config(arg)."""


def shipped_experiments() -> list[str]:
  """Names of the experiment configs shipped as rlx.experiments (those with get_config)."""
  spec = importlib.util.find_spec("rlx.experiments")
  names = []
  for m in pkgutil.iter_modules(spec.submodule_search_locations if spec else []):
    origin = os.path.join(os.path.dirname(spec.origin), m.name + ".py")
    try:
      with open(origin, encoding="utf-8") as f:
        if "\ndef get_config(" in f.read():
          names.append(m.name)
    except OSError:
      continue
  return sorted(names)


def shipped_path(name: str) -> str | None:
  """The file of shipped experiment `name`, or None if `name` is not one."""
  if not name.isidentifier():
    return None
  try:
    spec = importlib.util.find_spec(f"rlx.experiments.{name}")
  except (ImportError, ValueError):
    return None
  return spec.origin if spec is not None and spec.origin else None


def find(path: str) -> str:
  """The file that --config's `path` (the part before ':') names.

  Raises FileNotFoundError with one line listing the shipped experiments if there is none.
  """
  if os.path.isfile(path):
    return path
  if path and os.sep not in path and "/" not in path and not path.endswith(".py"):
    shipped = shipped_path(path)
    if shipped:
      return shipped
  names = ", ".join(shipped_experiments()) or "none found"
  what = "is not a file" if os.path.exists(path) else "does not exist"
  raise FileNotFoundError(f"config file {path!r} {what}; pass a path or a shipped experiment "
                          f"name ({names})")


def load_module(file: str, module_name: str = "rlx_experiment_config") -> ModuleType:
  """Executes config file `file` (a path find() returned) as a fresh module."""
  # An explicit source loader: a config file without the .py suffix is Python too.
  loader = importlib.machinery.SourceFileLoader(module_name, file)
  spec = importlib.util.spec_from_file_location(module_name, file, loader=loader)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load(path: str, arg: str = "", module_name: str = "rlx_experiment_config"):
  """get_config(arg) of the config file `path` names (`find`): the one loader of configs, for
  --config=path:arg (rlx.main) and rlx.load_config."""
  module = load_module(find(path), module_name)
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise NoGetConfig(f"config file {path!r} defines no get_config(arg); expected an "
                      f"experiment config like experiments/arith.py.")
  return get_config(arg)
