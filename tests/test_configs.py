"""rlx.configs: each section checked by its spec's from_config, the step built from the specs,
one loader for config files, and no import cycle in rlx."""

import ast
import dataclasses
import os
import subprocess
import sys

import pytest

import rlx
from rlx import configs, config_file, specs, train, trainer
from rlx.data import tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_section_is_read_by_its_spec():
  config = rlx.load_config("arith", "runlocal")
  spec = configs.resolve(config)
  for name in ("checkpoint", "task", "tokenizer", "model", "sft", "sampler", "optim", "guard",
               "memory", "mesh", "pipeline", "selection", "length"):
    section = getattr(spec, name)
    assert type(section).from_config(config) == section, name
  assert specs.RLSpec.from_config(config) == spec.rl


def test_a_bad_key_is_named_by_its_section():
  config = configs.with_overrides(rlx.load_config("arith", "runlocal"), {"optim.b2": 1.0})
  with pytest.raises(configs.ConfigError, match=r"^config.optim.b2=1.0; expected 0 <= b2 < 1"):
    specs.OptimSpec.from_config(config)
  with pytest.raises(configs.ConfigError, match=r"^config.optim.b2=1.0"):
    configs.resolve(config)


def test_the_step_takes_the_rl_section_by_name():
  """Every key of config.rl reaches the step under its own name (a new update knob needs no
  copy in the trainer), the other sections as they are."""
  config = configs.with_overrides(rlx.load_config("arith", "runlocal"), {
      "rl.logprob_chunk": 4, "rl.remat": True, "rl.num_minibatches": 2,
      "replay.enabled": True, "replay.num_samples": 8, "replay.capacity": 64})
  spec = configs.resolve(config)

  class Tok:
    eos_id, pad_id, stop_ids = 3, 0, (5,)

  cfg = trainer.step_config(spec, Tok())
  for f in dataclasses.fields(spec.rl):
    assert getattr(cfg, f.name) == getattr(spec.rl, f.name), f.name
  assert cfg.replay is spec.replay and cfg.selection is spec.selection
  assert cfg.sampling.stop_ids == (5,) and cfg.sampling.eos_id == 3
  assert cfg.paged == spec.sampler.paged and cfg.verifier == tasks.Verifier()
  assert cfg.ledger_levels == tuple(sorted(set(spec.task.rl_levels or spec.task.levels)))
  assert isinstance(cfg, train.StepConfig)


def test_one_loader_for_config_files(tmp_path):
  assert rlx.load_config("arith", "runlocal") == config_file.load("arith", "runlocal")
  path = tmp_path / "no_get_config.py"
  path.write_text("x = 1\n")
  with pytest.raises(config_file.NoGetConfig, match="defines no get_config"):
    rlx.load_config(str(path))


def _top_level_imports(path, module, modules):
  """rlx modules `path` imports when it is imported (not in functions or TYPE_CHECKING)."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  out = set()
  nodes = []
  for node in tree.body:
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      continue
    nodes.extend(ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node])
  for node in nodes:
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        out.add(full if full in modules else base)
  return out & set(modules)


def test_no_import_cycle_in_rlx():
  modules = {}
  for root, _, files in os.walk(os.path.join(REPO, "rlx")):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        modules[rel.removesuffix(".__init__")] = path
  graph = {m: _top_level_imports(p, m, modules) for m, p in modules.items()}
  seen, done = [], set()

  def visit(m):  # depth-first; a module met again on the current path closes a cycle
    if m in done:
      return
    assert m not in seen, f"import cycle: {' -> '.join(seen[seen.index(m):] + [m])}"
    seen.append(m)
    for n in sorted(graph[m]):
      visit(n)
    seen.pop()
    done.add(m)

  for m in sorted(graph):
    visit(m)
  assert graph["rlx.configs"] and "rlx.configs" not in graph["rlx.data.registry"]


@pytest.mark.parametrize("old, new", [
    ("rl.update_buckets", "update_shape.width_buckets"),
    ("rl.update_parts", "update_shape.length_parts"),
    ("rl.update_micro_rows", "update_shape.micro_rows"),
    ("rl.cpu_micro_tokens", "update_shape.cpu_micro_tokens"),
    ("rl.drop_zero_adv_rows", ""),
])
def test_a_moved_update_shape_key_is_refused_naming_the_new_one(old, new):
  message = (rf"^config.{old} is now config.{new}; set that instead.$" if new else
             rf"^config.{old} is no longer a key: rows without signal are left out .*; "
             rf"remove it.$")
  base = rlx.load_config("arith", "runlocal")
  with pytest.raises(configs.ConfigError, match=message):  # an override (rlx.sweep, tests)
    configs.with_overrides(base, {old: 2})
  section, leaf = old.split(".")
  base[section][leaf] = 2  # set in an experiment file: a ConfigDict takes a new key
  with pytest.raises(configs.ConfigError, match=message):
    configs.resolve(base)


def test_a_moved_key_on_the_command_line_is_one_line(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "rlx.main", "--config=arith:runlocal",
       f"--workdir={tmp_path / 'wd'}", "--config.rl.update_micro_rows=8"],
      capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines() == [
      "rlx: error: config.rl.update_micro_rows is now config.update_shape.micro_rows; set that "
      "instead."]
  assert not os.path.exists(tmp_path / "wd")


def test_a_moved_key_in_a_sweep_is_one_line(tmp_path):
  from rlx import sweep  # pylint: disable=g-import-not-at-top
  path = tmp_path / "my_sweep.py"
  path.write_text("from rlx.experiments.arith import get_config\n"
                  "def get_sweep(arg):\n  return [{'rl.update_buckets': 2}]\n")
  with pytest.raises(sweep.SweepError, match=r"entry 0: config.rl.update_buckets is now "
                                             r"config.update_shape.width_buckets; set that"):
    sweep.load_sweep(str(path))
