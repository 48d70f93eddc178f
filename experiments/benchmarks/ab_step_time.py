r"""Step time of two checkouts of rlx, step by step in turn: A B A B ... on one config.

Separate benchmark runs of two versions on a shared machine differ by the machine's load at
the time more than by the code (run medians here spread 0.25-0.8 s for one program). This
starts one worker process per checkout (PYTHONPATH=<checkout>, same interpreter), lets each
build the run and compile its step, then hands a turn back and forth through a file so that
the two run their training steps (rollout + update, as bench_step.py times them) strictly
alternately: step k of A and step k of B are timed seconds apart, under the same load, and
only one of the two computes at a time. Prints the median step / generation / update time of
each and the median of the per-step ratios B / A.

  git worktree add /tmp/wt_before <commit>
  python experiments/benchmarks/ab_step_time.py --a=/tmp/wt_before --b=. --steps=30 -- \
      --config=experiments/arith.py --config.warm_start.dir=/tmp/rlx_arith/base

To compare two configs of one checkout, give both the same path and the difference as
--a_extra / --b_extra (e.g. --a=. --b=. --b_extra='--config.update_shape.micro_rows=32').

Everything after `--` goes to both workers (config and its overrides); each worker uses its
own workdir under --workdir_root. The workers time the step bench_step.py times
(experiments/benchmarks/step_timing.py, from this tree: trainer.build's rollout / update halves,
or with a Python reward, task.reward, generate / host reward / score + update), using only APIs rlx
has long had, so an older checkout runs unchanged.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import types

from absl import app, flags

_ROLES = ("A", "B")


def _wait_turn(path: str, want: str, timeout_s: float = 1800.0) -> None:
  t0 = time.time()
  while True:
    try:
      with open(path) as f:
        if f.read() == want:
          return
    except FileNotFoundError:
      pass
    if time.time() - t0 > timeout_s:
      raise TimeoutError(f"no turn {want!r} in {path} after {timeout_s:.0f}s")
    time.sleep(0.0005)


def _set_turn(path: str, value: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(value)
  os.replace(tmp, path)


def worker(role: str, turn_dir: str, steps: int, workdir: str, config_argv: list[str]) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  import rlx  # pylint: disable=g-import-not-at-top
  from rlx import trainer  # pylint: disable=g-import-not-at-top

  cfg_flag = config_flags.DEFINE_config_file("config", "experiments/arith.py", "Config file.")
  # ml_collections reads the --config.* overrides from sys.argv, not from the list parsed.
  sys.argv = [sys.argv[0], *config_argv]
  flags.FLAGS(sys.argv)
  setup = trainer.build(cfg_flag.value, workdir, log=lambda s: print(f"[{role}] {s}",
                                                                      file=sys.stderr))
  fns, state, cfg = setup.fns, setup.state, setup.step_cfg
  pool = jax.device_put(setup.exp.train_pool, fns.pool_sharding)
  turn = os.path.join(turn_dir, "turn")

  # This file's directory is sys.path[0]: the current tree's helper, against the checkout's rlx.
  from step_timing import host_scorer, timed_step  # pylint: disable=g-import-not-at-top
  host = host_scorer(setup)

  def step(state):
    state, _, _, _, t_gen, t_upd = timed_step(fns, cfg, state, pool, host)
    return state, (t_gen, t_upd)

  times = []
  for k in range(-1, steps):  # k = -1: the compiling step, also taken in turn
    _wait_turn(turn, f"{role}{k}")
    state, t = step(state)
    if k >= 0:
      times.append(t)
    _set_turn(turn, f"B{k}" if role == "A" else f"A{k + 1}")
  with open(os.path.join(turn_dir, f"times_{role}.json"), "w") as f:
    json.dump({"rlx": os.path.dirname(rlx.__file__), "times": times}, f)


_A = flags.DEFINE_string("a", None, "Checkout A (PYTHONPATH of worker A).")
_B = flags.DEFINE_string("b", None, "Checkout B (PYTHONPATH of worker B).")
_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per worker.")
_WORKDIR_ROOT = flags.DEFINE_string("workdir_root", "", "Workers' workdirs (default: a temp "
                                    "dir).")
_A_EXTRA = flags.DEFINE_string("a_extra", "", "Config overrides for A only, e.g. "
                               "'--config.update_shape.micro_rows=32' (shell-split, after the "
                               "shared ones).")
_B_EXTRA = flags.DEFINE_string("b_extra", "", "Config overrides for B only (as --a_extra).")
_ROLE = flags.DEFINE_enum("role", None, list(_ROLES), "Internal: run as this worker.")
_TURN_DIR = flags.DEFINE_string("turn_dir", None, "Internal: the workers' turn file's folder.")


def main(argv: list[str]) -> None:
  config_argv = argv[1:]  # what follows `--`: the config and its overrides, for both workers
  if not _A.value or not _B.value:
    raise app.UsageError("--a and --b (the two checkouts) are required.")
  args = types.SimpleNamespace(**{f.name: f.value for f in (
      _A, _B, _STEPS, _WORKDIR_ROOT, _A_EXTRA, _B_EXTRA, _ROLE, _TURN_DIR)})
  root = args.workdir_root or tempfile.mkdtemp(prefix="ab_step_time_")
  if args.role:
    extra = args.a_extra if args.role == "A" else args.b_extra
    worker(args.role, args.turn_dir, args.steps, os.path.join(root, args.role),
           [*config_argv, *shlex.split(extra)])
    return
  turn_dir = tempfile.mkdtemp(prefix="ab_turn_")
  _set_turn(os.path.join(turn_dir, "turn"), "A-1")
  procs = []
  for role, path in zip(_ROLES, (args.a, args.b)):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    procs.append(subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), f"--a={args.a}", f"--b={args.b}",
         f"--steps={args.steps}", f"--workdir_root={root}", f"--role={role}",
         f"--a_extra={args.a_extra}", f"--b_extra={args.b_extra}",
         f"--turn_dir={turn_dir}", "--", *config_argv], env=env))
  load0 = os.getloadavg()
  rcs = [proc.wait() for proc in procs]
  load1 = os.getloadavg()
  if any(rcs):
    sys.exit(f"worker exit codes {rcs}")
  res = {}
  for role in _ROLES:
    with open(os.path.join(turn_dir, f"times_{role}.json")) as f:
      res[role] = json.load(f)
  print(f"\n{args.steps} steps each, A and B in turn; load average {load0[0]:.2f} at the start, "
        f"{load1[0]:.2f} at the end")
  for role, extra in zip(_ROLES, (args.a_extra, args.b_extra)):
    print(f"  {role}: rlx from {res[role]['rlx']}" + (f", with {extra}" if extra else ""))
  print(f"{'median s':12s}{'A':>9s}{'B':>9s}{'B / A':>8s}{'median of per-step B / A':>27s}")
  for j, name in enumerate(("generation", "update", "step")):
    get = lambda role: [t[0] + t[1] if j == 2 else t[j] for t in res[role]["times"]]
    a, b = get("A"), get("B")
    pair = statistics.median(y / x for x, y in zip(a, b))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{name:12s}{ma:9.4f}{mb:9.4f}{mb / ma:8.3f}{pair:27.3f}")


if __name__ == "__main__":
  app.run(main)
