r"""Tokens-to-target benchmark: does rlx reach the same accuracy with fewer generated tokens?

--task=arith (default): all arms start from the same warm-start model (experiments/arith.py's)
and train on the same prompt pool, which mixes solved (2-digit), uncertain (3-4 digit, the
band) and impossible (5-digit) problems, as a real RL data set does.
--task=chains: experiments/chains.py (rlx.data.op_chains: 48 digit permutations in chains of
1-4, a teacher unreliable on half of them at three rates; many skills, most groups
zero-variance, a band that moves). Accuracy is greedy, held-out, on chains with an unreliable
operator (levels 2-4).
--task=path/to/my_experiment.py (or a shipped experiment's name): any experiment config whose
task registers itself (rlx.data.registry) and sets task.band (the levels whose held-out
accuracy, eval/band_accuracy, is measured), with a warm start or a model.path: the check of a
task family the levers were not tuned on. It runs as chains does: 400 steps, evaluations
every 10, the target at half of the pilot B0's base-to-plateau gain; nothing else of the
config is changed but what the arms and flags set.
--task=reasoning: experiments/reasoning.py (worked column addition, 15-200-token completions),
with its length reward off in every arm but K, and 200 held-out problems per band level (3-4
digits). Accuracy is greedy, held-out, on the band.

  B0     plain GRPO: uniform prompts, fresh rollouts only
  B1     B0 + DAPO dynamic filtering (2x oversampling, zero-variance groups dropped)
  S      pass-rate selection (--select_mode, default band)
  Q      band selection scoring unvisited prompts by their bucket's E[p(1-p)] instead of
         p(1-p) at the bucket's mean (selection.bucket_score=spread; pass_rate_prior.py)
  R      replay ring (decoupled-PPO correction)
  S+R    both
  S+R+L  both + DAPO overlong shaping and filtering
  K      B0 + Kimi k1.5's group length reward (length.length_reward; the reasoning default,
         0.5); K<w> at weight w (e.g. K0.1)
  D      Dr. GRPO advantages (rl.advantage=dr_grpo: r - mean_g, no std division), e.g.
         D+K0.2, where the length reward's weight then sets its push in all-correct groups
  O      B0 with generation and training overlapped on two sub-meshes, one step off-policy
         (pipeline.mode=overlap; needs --cpu_devices >= 2): what the staleness costs
  +A     with rl.anchor=behaviour (e.g. O+A): the clip around the behaviour policy
  V      adaptive rollout budgets (rlx.rl.adaptive): --adaptive_first samples per prompt, then
         rl.group_size - first more for --adaptive_extend groups (default half), the most
         uncertain first: 3/4 of B0's sequences per step at the defaults (G0 4, G 8)
  U      as V, unsolved groups first (AR3PO)
  H      SRPO's history resampling (selection.mode=history: prompts all-correct at their last
         visit wait selection.history_cooldown steps)
  G      GRESO's probabilistic skip (selection.mode=skip: a prompt zero-variance at its last z
         visits is kept with probability skip_keep_base^z)
  X      the oracle selector (selection.mode=oracle): prompts chosen by their true current
         pass rate, probed by teacher forcing; not a lever but the headroom any selection
         could reach (its probes are FLOPs, counted in the FLOPs column, not generated tokens)
  E      the probe lever (selection.mode=probe): the oracle's probe on probe_factor (8) x
         the prompts per step, the likeliest to give mixed groups sampled (exact-match tasks
         and tasks with probe references, e.g. reasoning;
         = X with oracle_candidates = 8 x prompts_per_step, without dynamic filtering)
  C      with E or X: candidates ranked by mixed-group chance per expected generated token
         (selection.probe_score=mixed_per_token), e.g. E+C+P2
  P<k>   k fresh prompts per step (e.g. S+P8): each arm's own batch shape
  R<k>   replay with k replayed rows per step (e.g. R128); N<k>: k optimizer passes over each
         batch (e.g. R+N2): the update-to-data ratio
  <arm>@<lr>  the arm at its own optim.lr (e.g. R32@7.5e-5); --lrs=a,b,c runs every arm at
         each rate; the main table compares each cell with B0 at the same rate, and a
         best-vs-best table each arm's best rate with B0's best (the same tuning budget for
         every arm)

The target accuracy is fixed before the comparison from a pilot B0 run (its own seed): the
mean band accuracy of the pilot's evaluations in the last third of its run, minus 0.02,
floored to 0.01 ("where B0 gets"). For each arm and seed the
generated tokens (including discarded ones) at the first evaluation reaching the target
from which the run stays within 0.03 of it are recorded (`tokens_to_target`); runs that
never reach it are censored. Ratios to B0 use medians, with a bootstrap
interval over seeds.

  python experiments/benchmarks/efficiency.py --quick --workdir_root=/tmp/rlx_eff  # 3x80 steps
  python experiments/benchmarks/efficiency.py --workdir_root=/tmp/rlx_eff_full --seeds=4  # 200
  python experiments/benchmarks/efficiency.py --task=reasoning \
      --workdir_root=/tmp/rlx_eff_reason  # 100
"""

from __future__ import annotations

import json
import math
import os
import re
import time

import numpy as np
from absl import app, flags

_TASK = flags.DEFINE_string("task", "arith", "Task family: arith, reasoning, chains, or an "
                            "experiment config (a .py file or a shipped experiment's name) "
                            "whose task is run as chains is: see the docstring.")
_ROOT = flags.DEFINE_string("workdir_root", "/tmp/rlx_efficiency", "Where runs go.")
_QUICK = flags.DEFINE_bool("quick", False, "Short runs (<= 15 min on 2 cores).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per arm.")
_STEPS = flags.DEFINE_integer("steps", 0, "RL steps per run (0: arith 80 quick, 200 full; "
                              "reasoning 60 quick, 100 full).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 0, "Steps between evals (0: 5).")
_SELECT = flags.DEFINE_string("select_mode", "band", "Selection mode of the S arms.")
_ARMS = flags.DEFINE_list("arms", [], "Arms to run (empty: B0 B1 S R S+R S+R+L V, and K "
                          "for --task=reasoning).")
_BASE_DIR = flags.DEFINE_string("base_dir", "", "A warm-start dir to reuse (else made).")
_REPLAY_PRIORITY = flags.DEFINE_string("replay_priority", "uniform", "R arms: priority.")
_REPLAY_SAMPLES = flags.DEFINE_integer("replay_samples", 64, "R arms: replayed rows / step.")
_REPLAY_STALENESS = flags.DEFINE_integer("replay_staleness", 4, "R arms: max staleness.")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 0, "Fresh prompts per step, every arm "
                                "(0: arith 16, reasoning the config's 8).")
_IS_MODE = flags.DEFINE_string("replay_is_mode", "truncate", "R arms: rl.is_mode.")
_IS_CAP = flags.DEFINE_float("replay_is_cap", 2.0, "R arms: rl.is_cap (C).")
# Measured on this task (see README): with the proximal anchor (decoupled PPO) stale replayed
# advantages kept pushing and hurt (and collapsed runs with 4 prompts per step); the
# behaviour anchor bounds each sample's push and made replay harmless.
_ANCHOR = flags.DEFINE_string("replay_anchor", "behaviour", "R arms: rl.anchor.")
_ADAPT_FIRST = flags.DEFINE_integer("adaptive_first", 4, "V / U arms: round-1 samples per "
                                    "prompt (G0; extended groups get rl.group_size).")
_ADAPT_EXTEND = flags.DEFINE_integer("adaptive_extend", 0, "V / U arms: groups extended per "
                                     "step (0: half of prompts_per_step).")
_LR = flags.DEFINE_float("lr", 0.0, "optim.lr of every arm (0: the config's): the tuning grid.")
_LRS = flags.DEFINE_list("lrs", [], "Run every arm at each of these optim.lr values (arm@lr) "
                         "and report each arm's best rate against B0's best.")
_GROUP = flags.DEFINE_integer("group_size", 0, "rl.group_size of every arm (0: the config's).")
_TARGET = flags.DEFINE_float("target", 0.0, "Fixed target band accuracy (0: from a pilot B0 "
                             "run); a tuning grid fixes it once for all its cells.")
_TARGET_GAIN = flags.DEFINE_float("target_gain", 0.0, "Target from the pilot as base + this "
                                   "share of its base-to-plateau gain (0: the plateau minus "
                                   "0.02; --task=chains defaults to 0.5).")
_SHADOW = flags.DEFINE_integer("shadow_probe", -1, "H / G arms: uniform prompts probed for "
                               "their true pass rate every 10 steps, to check the rule's "
                               "exclusions (-1: 128 on chains, else 0 (needs exact match)).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Fake CPU devices (the O arm needs 2+).")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE config override of every arm and the "
                                 "warm start (VALUE a Python literal, else a string), e.g. "
                                 "--set='task.rl_level_weights={\"1\": 0.75, \"2\": 0.0833}': "
                                 "a task variant.")

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the configs
BUILT_IN = ("arith", "reasoning", "chains")


def task_kind() -> str:
  """"arith", "reasoning", "chains", or "file" (--task names an experiment config)."""
  task = _TASK.value if flags.FLAGS.is_parsed() else "arith"
  return task if task in BUILT_IN else "file"


def task_config():
  """The experiment config --task names (its get_config()), before any override."""
  import rlx  # pylint: disable=g-import-not-at-top
  kind = task_kind()
  if kind == "file":
    try:
      return rlx.load_config(_TASK.value)
    except FileNotFoundError as e:
      raise app.UsageError(f"--task={_TASK.value!r}: expected arith, reasoning, chains or an "
                           f"experiment config file ({e})") from None
  return rlx.load_config(os.path.join(EXPERIMENTS, f"{kind}.py"))


# Every letter an arm is made of ("+"-joined); R, N and K take a number after the letter.
_ARM_TOKEN = re.compile(r"^(B0|B1|S|Q|L|V|U|O|A|D|H|G|X|E|C|R\d*|N\d+|P\d+|M\d+|"
                        r"K(\d+(\.\d*)?|\.\d+)?)$")


def arm_overrides(arm: str, select_mode: str) -> dict:
  o = {}
  toks = arm.split("+")
  bad = [t for t in toks if not _ARM_TOKEN.match(t) or (len(toks) > 1 and t in ("B0", "B1"))]
  if bad:
    raise ValueError(f"arm {arm!r}: unknown part(s) {bad}; "
                     "expected B0 or B1 alone, or '+'-joined S, Q, L, V, U, O, A, D, H, G, X, E, C, "
                     "R[rows], N<passes>, P<prompts>, M<band %>, K[weight] (e.g. V+S+R32, K0.2, "
                     "X+P8, M50)")
  picks = [t for t in toks if t in ("S", "Q", "H", "G", "X", "E")]
  if len(picks) > 1:
    raise ValueError(f"arm {arm!r}: {' and '.join(picks)} are each a prompt-selection rule; "
                     f"an arm takes one (e.g. {picks[0]}+R).")
  if arm == "B1":
    o.update({"selection.dynamic_filter": True, "selection.oversample": 2})
  if "S" in toks:
    o["selection.mode"] = select_mode
  if "Q" in toks:  # band selection, unvisited prompts scored by their bucket's E[p(1-p)]
    o.update({"selection.mode": "band", "selection.bucket_score": "spread"})
  # R<k>: replay with k replayed rows per step; N<k>: k optimizer passes over each batch
  # (the update-to-data knobs).
  rows = [int(t[1:]) for t in toks if t[:1] == "R" and t[1:].isdigit()]
  if "R" in toks or rows:
    o.update({"replay.enabled": True,
              "replay.num_samples": rows[0] if rows else _REPLAY_SAMPLES.value,
              "replay.capacity": 1024, "replay.max_staleness": _REPLAY_STALENESS.value,
              "replay.max_reuse": 2, "replay.priority": _REPLAY_PRIORITY.value,
              "rl.is_mode": _IS_MODE.value, "rl.is_cap": _IS_CAP.value,
              "rl.anchor": _ANCHOR.value})
  if "L" in toks:
    o.update({"length.overlong_shaping": True, "length.overlong_filter": True})
    if task_kind() == "reasoning":  # DAPO's soft buffer, scaled to 224 new tokens
      o["length.overlong_buffer"] = 32
  # K: Kimi k1.5's group length reward at 0.5 (the reasoning config's), K<w> at weight w.
  for t in toks:
    if t[:1] == "K":
      o["length.length_reward"] = float(t[1:]) if len(t) > 1 else 0.5
  # Adaptive rollout budgets (rlx.rl.adaptive): V extends the most uncertain groups, U the
  # unsolved ones first (AR3PO).
  # adaptive.extend_groups 0 here: half the config's prompts per step (`make_config`).
  for letter, priority in (("V", "uncertain"), ("U", "unsolved")):
    if letter in toks:
      o.update({"adaptive.first": _ADAPT_FIRST.value,
                "adaptive.extend_groups": _ADAPT_EXTEND.value,
                "adaptive.priority": priority})
  for t in toks:
    if t[:1] == "N" and t[1:].isdigit():
      o["rl.num_updates"] = int(t[1:])
  if "O" in toks:
    o["pipeline.mode"] = "overlap"
  if "A" in toks:  # the clip around the behaviour policy (as the R arms use)
    o["rl.anchor"] = "behaviour"
  if "D" in toks:  # Dr. GRPO advantages: r - mean_g, no division by the group's std
    o["rl.advantage"] = "dr_grpo"
  if "H" in toks:
    o["selection.mode"] = "history"
  if "G" in toks:
    o["selection.mode"] = "skip"
  parsed = flags.FLAGS.is_parsed()  # (tests call this without parsing the command line)
  shadow = _SHADOW.value if parsed else -1
  if shadow < 0:
    shadow = 128 if parsed and task_kind() == "chains" else 0
  if ("H" in toks or "G" in toks) and shadow:
    o["selection.shadow_probe"] = shadow
  if "X" in toks:
    o["selection.mode"] = "oracle"
  if "E" in toks:
    o["selection.mode"] = "probe"
  if "C" in toks:  # E or X ranking by mixed-group chance per expected generated token
    if not {"E", "X"} & set(toks):
      raise ValueError(f"arm {arm!r}: C ranks the candidates of the probe or the oracle; "
                       f"expected it with E or X (e.g. E+C+P2).")
    o["selection.probe_score"] = "mixed_per_token"
  for t in toks:
    if t[:1] == "P" and t[1:].isdigit():
      o["rl.prompts_per_step"] = int(t[1:])
    if t[:1] == "M":  # a static mixture: the band's share of the RL pool (`band_mixture`)
      share = int(t[1:])
      if not 0 < share <= 100:
        raise ValueError(f"arm {arm!r}: M{share}; expected M<band share in percent, 1-100> "
                         "(e.g. M50).")
      o[_BAND_SHARE] = share / 100
  return o


# The override key an M arm sets; `make_config` turns it into task.rl_level_weights.
_BAND_SHARE = "_band_share"


def band_mixture(task, share: float) -> dict:
  """task.rl_level_weights giving the band levels `share` of the RL pool in total and the
  other RL levels the rest, each side split as the task's own weights split it (uniform when
  it has none): the static data-curation baseline a user tries first ("train mostly on the
  levels the model gets wrong"), issue 36's B0 + mixture."""
  levels = [int(l) for l in (task.rl_levels or task.levels)]
  band = {int(l) for l in task.band}
  if not band or not band & set(levels) or not set(levels) - band:
    raise ValueError(f"an M arm needs RL levels both in and out of task.band; the task has "
                     f"rl_levels={levels} and band={sorted(band)}.")
  own = {int(k): float(v) for k, v in dict(task.rl_level_weights).items()}
  w = {l: own.get(l, 0.0) if own else 1.0 for l in levels}
  out = {}
  for side, total in ((band, share), (set(levels) - band, 1.0 - share)):
    mass = sum(w[l] for l in levels if l in side)
    for l in levels:
      if l in side:
        out[str(l)] = total * w[l] / mass if mass > 0 else total / len(side & set(levels))
  return out


def _rate(text: str) -> float | None:
  """A learning rate written as text: a positive finite float, else None."""
  try:
    value = float(text)
  except ValueError:
    return None
  return value if math.isfinite(value) and value > 0 else None


def split_arm(arm: str) -> tuple[str, float | None]:
  """"R32@7.5e-5" -> ("R32", 7.5e-5); an arm without "@" -> (arm, None)."""
  name, at, lr = arm.partition("@")
  if not at:
    return arm, None
  if not name or _rate(lr) is None:
    raise ValueError(f"--arms: {arm!r}; expected <arm>@<learning rate>, the rate a positive "
                     f"number (like R32@7.5e-5).")
  return name, _rate(lr)


def expand_arms(arms, lrs) -> list[str]:
  """Each arm at each rate of lrs (arm@lr), unless it names its own; lrs empty: unchanged."""
  bad = [lr for lr in lrs if _rate(lr) is None]
  if bad:
    raise ValueError(f"--lrs: {bad[0]!r}; expected positive learning rates (like "
                     f"--lrs=1.875e-5,3.75e-5,7.5e-5).")
  out = []
  for a in arms:
    out += [a] if "@" in a or not lrs else [f"{a}@{_rate(lr):g}" for lr in lrs]
  return out


def b0_of(cell: str, cells) -> str | None:
  """The B0 cell a cell is compared with in the main table: B0 at the same rate, else B0."""
  lr = split_arm(cell)[1]
  same = [c for c in cells if split_arm(c) == ("B0", lr)]  # by value: 7.5e-5 == 7.5e-05
  return same[0] if same else ("B0" if "B0" in cells else None)


def arm_family(name: str) -> str:
  """The arm without its batch shape (P<k>) or mixture share (M<k>): the cells a tuning grid
  compares as one arm ("S+P8" -> "S", "P8" -> "B0", "M50+P8" -> "M")."""
  toks = [t for t in name.split("+") if not (t[:1] == "P" and t[1:].isdigit())]
  toks = ["M" if t[:1] == "M" and t[1:].isdigit() else t for t in toks]
  return "+".join(toks) or "B0"


def best_cells(ttt: dict) -> dict:
  """{arm family: its cell (arm@lr) with the fewest median tokens to target}, over the cells
  of each arm family (censored runs count as infinite; the first cell wins a tie)."""
  best = {}
  for cell, t in ttt.items():
    name = arm_family(split_arm(cell)[0])
    if name not in best or np.median(t) < np.median(ttt[best[name]]):
      best[name] = cell
  return best


def check_base(base_dir: str, config) -> None:
  """--base_dir must be a warm start the arms' config accepts: else every run would train its
  own at its seed, silently (the trainer's log is off here), as the reasoning runs of
  2026-12-07/08 did with a base whose task recorded 128 held-out problems per level, where
  the benchmark sets 200 (efficiency_probe_reasoning.md)."""
  from rlx import configs, warm_start  # pylint: disable=g-import-not-at-top
  ok, why = (False, f"{base_dir} is not a directory") if not os.path.isdir(base_dir) else (
      warm_start.base_matches(base_dir, configs.resolve(config)))
  if not ok:
    raise app.UsageError(f"--base_dir={base_dir}: {why}. The arms would each train their own "
                         f"warm start; give a base made with the benchmark's task settings (or "
                         f"none: the benchmark makes one in --workdir_root/base_run).")


def make_config(steps: int, eval_every: int, seed: int, base_dir: str, data_dir: str,
                overrides: dict):
  from rlx import configs  # pylint: disable=g-import-not-at-top
  kind = task_kind()
  base = task_config()
  common = {"seed": seed, "total_steps": steps, "eval_every": eval_every,
            "checkpoint_every": steps, "warm_start.dir": base_dir, "task.data_dir": data_dir}
  if kind in ("arith", "reasoning"):
    common["task.eval_levels"] = (3, 4)
  if _PROMPTS.value:
    common["rl.prompts_per_step"] = _PROMPTS.value
  if _LR.value:
    common["optim.lr"] = _LR.value
  if _GROUP.value:
    common["rl.group_size"] = _GROUP.value
  if kind == "reasoning":
    # 400 held-out band problems as on arith; plain GRPO has no length reward and no KL
    # (the experiment's own KL 0.1 since 8390341).
    common.update({"task.num_eval_per_level": 200, "length.length_reward": 0.0,
                   "rl.kl_coef": 0.0})
  elif kind == "arith":
    common.update({"task.rl_levels": (2, 3, 4, 5), "rl.prompts_per_step": _PROMPTS.value or 16})
  overrides = dict(overrides)
  share = overrides.pop(_BAND_SHARE, None)
  config = configs.with_overrides(base, {**common, **parse_sets(_SET.value), **overrides})
  if share is not None:
    config.task.rl_level_weights = band_mixture(config.task, share)
  if config.model.path:  # a task starting from a checkpoint of its own has no warm start
    config.warm_start.dir = ""
  if config.adaptive.first and not config.adaptive.extend_groups:
    config.adaptive.extend_groups = max(1, config.rl.prompts_per_step // 2)
  return config


def parse_sets(items: list[str]) -> dict:
  """--set KEY=VALUE items as overrides; VALUE is a Python literal or else a plain string."""
  import ast  # pylint: disable=g-import-not-at-top
  out = {}
  for item in items:
    key, eq, text = item.partition("=")
    if not eq or not key.strip():
      raise app.UsageError(f"--set={item!r}: expected KEY=VALUE, e.g. --set=optim.lr=3e-4.")
    try:
      out[key.strip()] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      out[key.strip()] = text
  return out


def run_one(config, workdir: str) -> dict:
  """Trains (or reads a finished run) and returns its accuracy-vs-tokens curve."""
  from rlx import trainer  # pylint: disable=g-import-not-at-top
  from rlx.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  done_path = os.path.join(workdir, "efficiency_run.json")
  if os.path.exists(done_path):
    with open(done_path) as f:
      return json.load(f)
  t0 = time.time()
  trainer.run(config, workdir, log=lambda s: None, show_progress=False)
  wall = time.time() - t0
  tokens, step_s, units, curve, extra = 0.0, 0.0, 0.0, [], []
  levels: dict[str, list] = {}
  for line in read_metrics(workdir):
    tokens += line.get("ledger/tokens_generated", 0.0)
    step_s += line.get("time/step_s", 0.0)
    units += compute_units(line)
    for k, v in line.items():
      if k.startswith("ledger/mixed_groups_d"):
        levels.setdefault(k[len("ledger/mixed_groups_d"):], []).append(v)
    for k, v in line.items():
      if k.startswith("select/shadow_"):
        levels.setdefault(k, []).append(v)
    if "ledger/zero_adv_group_frac" in line:
      levels.setdefault("zero_var", []).append(line["ledger/zero_adv_group_frac"])
    if "eval/band_accuracy" in line:
      curve.append((line["step"], tokens, line["eval/band_accuracy"]))
      extra.append((line["step"], step_s, units))
  # extra[i] = (step, seconds in train steps so far, compute units so far) at curve[i].
  out = {"curve": curve, "extra": extra, "per_step": levels, "wall_s": wall}
  with open(done_path, "w") as f:
    json.dump(out, f)
  return out


def compute_units(line: dict) -> float:
  """A step's model compute in forward-token units (one unit = 2 x params FLOPs): prompts
  prefilled and tokens generated (1 each), tokens trained on incl. replayed rows (3: forward +
  backward; the pi_old pass is fused into the first gradient pass), and the oracle's
  teacher-forced probes (1 each)."""
  return (line.get("ledger/prompt_tokens", 0.0) + line.get("ledger/tokens_generated", 0.0) +
          3.0 * line.get("ledger/tokens_trained", 0.0) + line.get("ledger/probe_tokens", 0.0))


SUSTAIN_MARGIN = 0.03  # ~1.4 standard errors of a 400-prompt band evaluation near p = 0.75


def tokens_to_target(curve, target, margin=SUSTAIN_MARGIN):
  """Generated tokens at the first evaluation at or above the target after which every later
  evaluation (at least one) stays at or above target - margin.

  A transient does not count: right after RL starts the band accuracy jumps for a few
  steps and falls back (visible in every arm's curve), and a short run's target can sit
  below that jump; a single noisy evaluation above the target does not count either.
  """
  i = first_sustained(curve, target, margin)
  return math.inf if i is None else curve[i][1]


def first_sustained(curve, target, margin=SUSTAIN_MARGIN):
  """Index of the evaluation `tokens_to_target` stops at (None: never)."""
  for i, (_, _, acc) in enumerate(curve[:-1]):
    if acc >= target - 1e-9 and min(a for _, _, a in curve[i + 1:]) >= target - margin - 1e-9:
      return i
  return None


def at_target(run: dict, target, what: str, margin=SUSTAIN_MARGIN) -> float:
  """A run's optimizer steps ("steps"), train-step seconds ("wall") or compute units ("flops")
  at its tokens-to-target evaluation (inf: never reached)."""
  i = first_sustained(run["curve"], target, margin)
  if i is None:
    return math.inf
  step, wall, units = run["extra"][i]
  return {"steps": step, "wall": wall, "flops": units}[what]


def area_under_curve(curve, budget):
  """Mean band accuracy over generated tokens 0..budget (step function through each eval)."""
  area, prev_t, prev_a = 0.0, 0.0, curve[0][2]
  for _, t, a in curve[1:]:
    t = min(t, budget)
    area += prev_a * max(t - prev_t, 0.0)
    prev_t, prev_a = t, a
    if t >= budget:
      break
  area += prev_a * max(budget - prev_t, 0.0)
  return area / budget if budget > 0 else math.nan


def accuracy_at(curve, budget):
  """Band accuracy of the last eval at or before `budget` generated tokens."""
  acc = curve[0][2]
  for _, tokens, a in curve:
    if tokens <= budget:
      acc = a
  return acc


def bootstrap_ratio(x, y, n=2000, seed=0):
  """Median(x)/median(y) with a 90% bootstrap interval over seeds (inf = censored)."""
  rng = np.random.default_rng(seed)
  x, y = np.asarray(x, float), np.asarray(y, float)
  ratios = []
  for _ in range(n):
    mx = np.median(rng.choice(x, len(x)))
    my = np.median(rng.choice(y, len(y)))
    ratios.append(mx / my if np.isfinite(my) and my > 0 else math.nan)
  ratios = np.asarray(ratios)
  ratios = ratios[~np.isnan(ratios)]
  if not len(ratios):
    return math.nan, (math.nan, math.nan)
  point = np.median(x) / np.median(y) if np.isfinite(np.median(y)) else math.nan
  return point, (float(np.quantile(ratios, 0.05)), float(np.quantile(ratios, 0.95)))


def fmt_tokens(t):
  return "censored" if not np.isfinite(t) else f"{t / 1e3:.1f}k"


def main(_):
  if _CPU_DEVICES.value:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  quick = _QUICK.value
  reasoning = task_kind() == "reasoning"
  chains = task_kind() in ("chains", "file")  # a task of one's own runs as chains does
  steps = _STEPS.value or ((300 if quick else 400) if chains else
                           (60 if quick else 100) if reasoning else (80 if quick else 200))
  arms = _ARMS.value or (["B0", "B1", "S", "R", "S+R", "S+R+L", "V"] +
                         (["K"] if reasoning else []))
  if _LRS.value and _LR.value:
    raise app.UsageError(f"--lr={_LR.value:g} and --lrs={','.join(_LRS.value)}: give one; "
                         "--lrs runs every arm at each of its rates.")
  arms = expand_arms(arms, _LRS.value)
  for arm in arms:  # every arm's name checked before the first run starts
    arm_overrides(split_arm(arm)[0], _SELECT.value)
  eval_every = _EVAL_EVERY.value or (10 if chains else 5)
  root = _ROOT.value
  os.makedirs(root, exist_ok=True)
  t_start = time.time()

  base_dir = _BASE_DIR.value or os.path.join(root, "base_run", "base")
  data_dir = os.path.join(root, "data")
  first = make_config(1, 1, 0, "", data_dir, {})
  if _BASE_DIR.value and not first.model.path:
    check_base(_BASE_DIR.value, first)
  if not (first.model.path or os.path.exists(os.path.join(base_dir, "model.safetensors"))):
    print(f"[efficiency] warm start -> {base_dir}", flush=True)
    from rlx import configs, experiment  # pylint: disable=g-import-not-at-top
    experiment.setup(configs.resolve(first), os.path.dirname(base_dir), log=lambda s: None)

  if _TARGET.value:
    target, base_acc, pilot_final = _TARGET.value, float("nan"), float("nan")
    print(f"[efficiency] target given: {target:.2f}", flush=True)
  else:
    print(f"[efficiency] pilot B0 (seed 100), {steps} steps", flush=True)
    pilot = run_one(make_config(steps, eval_every, 100, base_dir, data_dir, {}),
                    os.path.join(root, "pilot_B0"))
    base_acc, pilot_final = pilot["curve"][0][2], pilot["curve"][-1][2]
    late = [acc for step, _, acc in pilot["curve"] if step >= 2 * steps / 3]
    gain = _TARGET_GAIN.value or (0.5 if chains else 0.0)
    if gain:
      target = math.floor(100 * (base_acc + gain * (float(np.mean(late)) - base_acc))) / 100
    else:
      target = math.floor(100 * (float(np.mean(late)) - 0.02)) / 100
    print(f"[efficiency] base band accuracy {base_acc:.3f}; pilot B0 final {pilot_final:.3f}; "
          f"target fixed at {target:.2f}", flush=True)

  results = {}
  for arm in arms:
    for seed in range(_SEEDS.value):
      wd = os.path.join(root, arm.replace("+", "_").replace("@", "_lr"), f"seed{seed}")
      name, lr = split_arm(arm)
      overrides = arm_overrides(name, _SELECT.value)
      if lr is not None:
        overrides["optim.lr"] = lr
      cfg = make_config(steps, eval_every, seed, base_dir, data_dir, overrides)
      r = run_one(cfg, wd)
      results.setdefault(arm, []).append(r)
      print(f"[efficiency] {arm:6s} seed {seed}: final {r['curve'][-1][2]:.3f}, tokens "
            f"{r['curve'][-1][1] / 1e3:.1f}k, to target {fmt_tokens(tokens_to_target(r['curve'], target))}, "
            f"{r['wall_s']:.0f}s", flush=True)

  budget = min(r["curve"][-1][1] for rs in results.values() for r in rs)
  ttt = {a: [tokens_to_target(r["curve"], target) for r in rs] for a, rs in results.items()}
  lines = [
      f"Task {_TASK.value}{' (' + '; '.join(_SET.value) + ')' if _SET.value else ''}. Target band accuracy {target:.2f} (base {base_acc:.3f}, pilot B0 final "
      f"{pilot_final:.3f}); {steps} steps per run, {_SEEDS.value} seeds per arm; accuracy at "
      f"a fixed budget of {budget / 1e3:.1f}k generated tokens.",
      "",
      "| arm | tokens to target (median) | per seed | ratio vs B0 (90% CI) | reached | "
      "acc @ budget | final acc | wall s (median) |",
      "|---|---|---|---|---|---|---|---|",
  ]
  table = {}
  for arm, rs in results.items():
    t = np.asarray(ttt[arm])
    med = float(np.median(t))
    ref = b0_of(arm, ttt)
    if ref is None:  # no B0 here at its rate nor plain (e.g. --arms=R32 alone)
      ratio = "- (no B0 at its rate)"
    elif arm == ref:
      ratio = "1.00x"
    else:
      point, (lo, hi) = bootstrap_ratio(ttt[ref], t)
      ratio = f"{point:.2f}x ({lo:.2f}-{hi:.2f})" if np.isfinite(point) else "n/a (censored)"
    acc_b = np.median([accuracy_at(r["curve"], budget) for r in rs])
    final = np.median([r["curve"][-1][2] for r in rs])
    wall = np.median([r["wall_s"] for r in rs])
    reached = int(np.isfinite(t).sum())
    lines.append(f"| {arm} | {fmt_tokens(med)} | {', '.join(fmt_tokens(x) for x in t)} | "
                 f"{ratio} | {reached}/{len(t)} | {acc_b:.3f} | {final:.3f} | {wall:.0f} |")
    table[arm] = {"tokens_to_target": [None if not np.isfinite(x) else x for x in t],
                  "acc_at_budget": float(acc_b), "final": float(final), "wall_s": float(wall)}
  best = best_cells(ttt)
  if len(best) < len(ttt) and "B0" in best:  # some arm ran at several rates: best vs best
    b0 = best["B0"]
    lines += ["", f"Best vs best (each arm at its best rate against {b0}):", "",
              "| arm | best cell | tokens to target (median) | ratio vs best B0 (90% CI) |",
              "|---|---|---|---|"]
    for name, cell in best.items():
      point, (lo, hi) = bootstrap_ratio(ttt[b0], ttt[cell])
      ratio = f"{point:.2f}x ({lo:.2f}-{hi:.2f})" if np.isfinite(point) else "n/a (censored)"
      lines.append(f"| {name} | {cell} | {fmt_tokens(float(np.median(ttt[cell])))} | "
                   f"{'1.00x' if cell == b0 else ratio} |")
  lines += more_metrics(results, ttt, target, budget)
  if chains:  # the pilot gates; the band's evaluation size sets their noise floor
    t = make_config(steps, eval_every, 0, base_dir, data_dir, {}).task
    levels = len(t.band) or len(t.eval_levels) or len(t.levels) or 1
    lines += chains_gates(results, ttt, target, eval_n=levels * t.num_eval_per_level)
  lines += shadow_report(results, target)
  text = "\n".join(lines)
  print("\n" + text)
  print("\n(ratio = B0 tokens / arm tokens: >1 means the arm needs fewer generated tokens)")
  with open(os.path.join(root, "results.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(root, "results.json"), "w") as f:
    json.dump({"target": target, "base": base_acc, "pilot_final": pilot_final,
               "steps": steps, "arms": table,
               "curves": {a: [r["curve"] for r in rs] for a, rs in results.items()}}, f)
  plot(results, target, base_acc, os.path.join(root, "efficiency.png"))
  print(f"\n[efficiency] wrote {root}/results.md, results.json, efficiency.png "
        f"in {(time.time() - t_start) / 60:.1f} min")


def gain_thresholds(results: dict, ttt: dict) -> tuple[float, float, list[float]]:
  """(base, plateau, accuracies at 25/50/75% of B0's base-to-plateau gain): base is the
  step-0 band accuracy, the plateau the median over B0's runs of their last third's mean."""
  b0 = best_cells(ttt).get("B0") or next(iter(results))
  base = float(np.median([r["curve"][0][2] for rs in results.values() for r in rs]))
  plateau = float(np.median([
      np.mean([a for st, _, a in r["curve"] if st >= 2 * r["curve"][-1][0] / 3])
      for r in results[b0]]))
  return base, plateau, [base + f * (plateau - base) for f in (0.25, 0.5, 0.75)]


def more_metrics(results: dict, ttt: dict, target: float, budget: float) -> list[str]:
  """The other ways to count "fewer" (issue 36): tokens to 25/50/75% of B0's gain, area under
  accuracy-vs-tokens, optimizer steps, train-step seconds and compute to target; each arm's
  best cell, medians over seeds, ratio = B0 / arm (>1: the arm needs less)."""
  best = best_cells(ttt)
  if "B0" not in best:
    return []
  base, plateau, levels = gain_thresholds(results, ttt)
  cols = [f"tokens to {int(100 * f)}% gain" for f in (0.25, 0.5, 0.75)]
  cols += ["AUC @ budget", "steps to target", "step-seconds to target", "compute to target"]

  def values(cell):
    rs = results[cell]
    out = [[tokens_to_target(r["curve"], lv) for r in rs] for lv in levels]
    out.append([area_under_curve(r["curve"], budget) for r in rs])
    for what in ("steps", "wall", "flops"):
      out.append([at_target(r, target, what) if "extra" in r else math.nan for r in rs])
    return [float(np.median(v)) for v in out]

  ref = values(best["B0"])
  lines = ["", f"Other measures (best cells; B0's gain: base {base:.3f} -> plateau "
           f"{plateau:.3f}; compute in forward-token units, 2 x params FLOPs each; ratio = "
           f"B0 / arm, AUC arm / B0):", "",
           "| arm | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
  for name, cell in best.items():
    row = []
    for j, (v, r) in enumerate(zip(values(cell), ref)):
      if j == 3:  # AUC: higher is better
        row.append(f"{v:.3f} ({v / r:.2f}x)" if r > 0 else f"{v:.3f}")
      elif math.isfinite(v) and math.isfinite(r) and v > 0:
        row.append(f"{v:.4g} ({r / v:.2f}x)")
      else:
        row.append("censored" if not math.isfinite(v) else f"{v:.4g}")
    lines.append(f"| {name} ({cell}) | " + " | ".join(row) + " |")
  return lines


def band_moves(per_step: dict, upto: int, window: int = 20) -> tuple[list[int], int]:
  """The level with the most mixed groups in each `window`-step span before step `upto`
  (from ledger/mixed_groups_d<level>), and how often it changes."""
  levels = sorted(k for k in per_step if k.isdigit())
  leaders = []
  for w in range(0, upto, window):
    counts = [sum(per_step[l][w:min(w + window, upto)]) for l in levels]
    if max(counts, default=0) > 0:
      leaders.append(int(levels[int(np.argmax(counts))]))
  changes = sum(a != b for a, b in zip(leaders, leaders[1:]))
  return leaders, changes


def chains_gates(results: dict, ttt: dict, target: float, eval_n: int) -> list[str]:
  """Issue 36's gates for a task (run on the pilot before any lever is compared), from the
  best B0 cell: steps and evaluations to target, zero-variance share up to it, the band's
  moves, the target's place in B0's gain, signal-limitedness (B0 at half the prompts) and the
  oracle's headroom (X)."""
  best = best_cells(ttt)
  b0 = best.get("B0")
  if b0 is None:
    return []
  rs = results[b0]
  steps = [at_target(r, target, "steps") for r in rs]
  med_steps = float(np.median(steps))
  reached = [r for r, st in zip(rs, steps) if math.isfinite(st)]
  n_evals = [sum(1 for st, _, _ in r["curve"] if 0 < st < s) for r, s in zip(rs, steps)
             if math.isfinite(s)]
  zero = [np.mean(r["per_step"]["zero_var"][:int(s)]) for r, s in zip(rs, steps)
          if math.isfinite(s) and "per_step" in r]
  moves = [band_moves(r["per_step"], int(s)) for r, s in zip(rs, steps)
           if math.isfinite(s) and "per_step" in r]
  # The same among the unreliable operator classes alone (levels 2-4): level 1 is filler of
  # reliable operators, whose rare slips lead by count wherever it is most of the pool.
  band_only = [band_moves({k: v for k, v in r["per_step"].items() if k.isdigit() and k != "1"},
                          int(s)) for r, s in zip(rs, steps)
               if math.isfinite(s) and "per_step" in r]
  base, plateau, _ = gain_thresholds(results, ttt)
  share = (target - base) / (plateau - base) if plateau > base else math.nan
  sd = math.sqrt(max(plateau * (1 - plateau), 1e-9) / max(eval_n, 1))
  lines = ["", f"Gates (B0 = {b0}; {len(rs)} seeds, {len(reached)} reached the target):", "",
           "| gate | wanted | measured |", "|---|---|---|",
           f"| steps to target (median) | 100-400 | {med_steps:.0f} |",
           f"| evaluations before the target | >= 10 | "
           f"{', '.join(str(n) for n in n_evals) or '-'} |",
           f"| zero-variance groups up to the target | >= 70% | "
           f"{', '.join(f'{100 * z:.0f}%' for z in zero) or '-'} |",
           f"| changes of the most-mixed level before the target | >= 2 | "
           f"{', '.join(f'{c} ({chr(8594).join(map(str, lv))})' for lv, c in moves) or '-'} |",
           *(["| the same among levels 2-4 (the unreliable classes) | >= 2 | " + (", ".join(
               f"{c} ({chr(8594).join(map(str, lv))})" for lv, c in band_only) or "-") + " |"]
             if task_kind() == "chains" else []),
           f"| target in B0's base-to-plateau gain | 40-60% | {100 * share:.0f}% (base "
           f"{base:.3f}, plateau {plateau:.3f}) |",
           f"| target below the plateau, in eval standard deviations | >= 4 | "
           f"{(plateau - target) / sd:.1f} ({eval_n} band problems) |"]
  half = [c for c in ttt if arm_family(split_arm(c)[0]) == "B0" and c != b0 and
          split_arm(c)[1] == split_arm(b0)[1]]
  for c in half:
    st = float(np.median([at_target(r, target, "steps") for r in results[c]]))
    lines.append(f"| steps at another batch shape ({c} / {b0}) | >= 1.6x at half the prompts | "
                 f"{st / med_steps:.2f}x |")
  if "X" in best:
    point, (lo, hi) = bootstrap_ratio(ttt[b0], ttt[best["X"]])
    lines.append(f"| oracle (X) vs tuned B0, tokens to target | >= 3x, 90% CI low >= 2x | "
                 f"{point:.2f}x ({lo:.2f}-{hi:.2f}), {len(ttt[best['X']])} seeds |")
  return lines


def shadow_share(run: dict, upto: int | None) -> dict | None:
  """A run's shadow-probe sums (rlx.train.shadow_probe) over its first `upto` steps (None:
  all): the chance of a mixed group among excluded, down-weighted and all probed prompts."""
  ps = run.get("per_step", {})
  if not ps.get("select/shadow_probed"):
    return None
  tot = {k: float(sum(ps.get(f"select/shadow_{k}", [])[:upto])) for k in (
      "probed", "mixed_sum", "excluded", "excluded_mixed_sum", "down", "down_mixed_sum")}
  if not tot["probed"]:
    return None
  div = lambda a, b: a / b if b else math.nan
  return {"excluded_frac": div(tot["excluded"], tot["probed"]),
          "excluded_mixed": div(tot["excluded_mixed_sum"], tot["excluded"]),
          "down_mixed": div(tot["down_mixed_sum"], tot["down"]),
          "all_mixed": div(tot["mixed_sum"], tot["probed"])}


def shadow_report(results: dict, target: float) -> list[str]:
  """The H / G arms' falsification check (written before their runs, issue 36): a rule that
  excludes prompts is wrong if >= 30% of the prompts it excludes would have given a mixed
  group. Sums up to each run's target step (the whole run where it never got there)."""
  rows = []
  for cell, rs in results.items():
    shares = []
    for r in rs:
      st = at_target(r, target, "steps")
      sh = shadow_share(r, int(st) if math.isfinite(st) else None)
      if sh:
        shares.append(sh)
    if not shares:
      continue
    med = {k: float(np.nanmedian([s[k] for s in shares])) for k in shares[0]}
    verdict = "falsified" if med["excluded_mixed"] >= 0.3 else "holds"
    rows.append(f"| {cell} | {100 * med['excluded_frac']:.0f}% | "
                f"{100 * med['excluded_mixed']:.1f}% | {100 * med['down_mixed']:.1f}% | "
                f"{100 * med['all_mixed']:.1f}% | {verdict} |")
  if not rows:
    return []
  return ["", "Shadow probe (true pass rates of uniformly drawn prompts every 10 steps, up to "
          "the target; medians over seeds). Falsified if >= 30% of excluded prompts would "
          "have given a mixed group:", "",
          "| cell | excluded | mixed chance, excluded | mixed chance, down-weighted | "
          "mixed chance, all probed | criterion |", "|---|---|---|---|---|---|"] + rows


def plot(results, target, base_acc, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 5))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (arm, rs) in enumerate(results.items()):
    c = colors[i % len(colors)]
    for j, r in enumerate(rs):
      tok = [p[1] / 1e3 for p in r["curve"]]
      acc = [p[2] for p in r["curve"]]
      ax.plot(tok, acc, color=c, alpha=0.35, lw=1)
    # Median curve over seeds on the common eval steps.
    steps = [p[0] for p in rs[0]["curve"]]
    tok = np.median([[p[1] for p in r["curve"]] for r in rs], axis=0) / 1e3
    acc = np.median([[p[2] for p in r["curve"]] for r in rs], axis=0)
    ax.plot(tok, acc, color=c, lw=2.5, label=arm)
    del steps
  ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:.2f}")
  ax.axhline(base_acc, color="gray", ls=":", lw=1, label=f"base {base_acc:.2f}")
  ax.set_xlabel("generated tokens (thousands, incl. discarded)")
  ax.set_ylabel("held-out greedy accuracy, 3-4 digit band" if task_kind() in ("arith", "reasoning")
                else "held-out greedy accuracy, the task's band")
  ax.set_title("Accuracy vs generated tokens (thin: seeds, thick: median)")
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
