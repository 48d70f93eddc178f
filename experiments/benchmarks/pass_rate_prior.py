r"""How well can a prompt's pass rate be guessed before it is ever sampled?

The prompt selector (rlx.rl.selection) estimates an unvisited prompt's pass rate by its
difficulty bucket's running rate. This measures that prior against richer pre-rollout
estimates, on prompts the estimators never saw:

  1. Ground truth: the experiment's own rollout half (uniform prompts, the run's sampler and
     verifier, no update) from the base model or a checkpoint, with `--group_size` samples per
     prompt (default 16); a prompt's empirical pass rate p^ is its mean reward.
  2. Features from one prefill of the prompt (no generation): the entropy and top probability
     of the first completion token's distribution (the sampler's temperature), the prompt's
     mean token NLL under the model, and its length.
  3. The prompts are split in half at random (`--splits` times): estimators are fitted on one
     half and scored on the other, whose prompts they never saw:
       flat      0.5 for every prompt (the selector's prior before any bucket has a rate)
       global    the fitted half's mean pass rate
       bucket    the fitted half's mean per difficulty bucket (the selector's prior)
       features  a binomial logistic regression on the prefill features alone
       bucket+features  the same with the bucket one-hot
       probe k + bucket  k samples of the prompt itself (its first k), shrunk towards the
                 bucket's rate with 2 pseudo-samples: what a first sampling round
                 (rlx.rl.adaptive) knows; not free, k samples are generated
       teacher-forced probe  the probability of the prompt's correct completions at the
                 sampling temperature (rlx.train.true_pass_rate, what selection.mode=probe
                 ranks by): exact on an exact-match task, on a task with probe references
                 (TaskDef.probe_references) the sum over them, a lower bound; nothing fitted,
                 one forward per reference, no generation
     and, for selection only, the bucket's spread-aware score: its prompts' mean unbiased
     group variance E[p(1-p)] (what selection.bucket_score=spread tracks) rather than p(1-p)
     at its mean pass rate.
  4. Scores on the held-out half: mean squared error against p^ with the part of it that the
     finite group explains (E[p^(1-p^)]/(G-1), the binomial noise no estimator can remove)
     reported next to it, and R^2 = 1 - MSE / Var(p^); and what selection would get: choosing
     the `--keep` fraction of held-out prompts with the largest predicted chance of a mixed
     group of the training group size (1 - p^g - (1-p)^g, the chance a GRPO group carries
     signal), the realised mixed-group chance of the chosen prompts (from p^), next to a random
     choice and an oracle that knows p^.

  python experiments/benchmarks/pass_rate_prior.py --task=arith --workdir=/tmp/prior_arith \
      --set=warm_start.dir=/tmp/eff_arith/base_run/base --set=task.data_dir=/tmp/eff_arith/data
  python experiments/benchmarks/pass_rate_prior.py --task=reasoning --workdir=/tmp/prior_reason \
      --set=warm_start.dir=/tmp/eff_reason/base_run/base --set=task.data_dir=/tmp/eff_reason/data \
      --prompts=256

Writes `pass_rate_prior.json`, `pass_rate_prior.md` and the samples (`pass_rate_prior.npz`,
for `--raw`) to the workdir.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

# This script's own flag set (parsed in __main__), so that importing it next to
# efficiency.py (same flag names, e.g. in one test process) defines nothing twice.
_FLAGS = flags.FlagValues()
_F = {"flag_values": _FLAGS}
_TASK = flags.DEFINE_enum("task", "arith", ["arith", "reasoning"], "Task family.", **_F)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_prior", "Workdir (base model / data).",
                               **_F)
_PROMPTS = flags.DEFINE_integer("prompts", 512, "Distinct prompts to sample (at least).", **_F)
_GROUP = flags.DEFINE_integer("group_size", 16, "Samples per prompt for the ground truth.",
                              **_F)
_PER_STEP = flags.DEFINE_integer("prompts_per_step", 32, "Prompts per rollout call.", **_F)
_TRAIN_G = flags.DEFINE_integer("train_group_size", 8, "Group size whose mixed-group chance "
                                "the selection score uses.", **_F)
_KEEP = flags.DEFINE_float("keep", 0.25, "Fraction of held-out prompts selection keeps.", **_F)
_SPLITS = flags.DEFINE_integer("splits", 50, "Random fit / held-out splits.", **_F)
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint of --from_run to sample from (-1: the "
                             "base model).", **_F)
_FROM = flags.DEFINE_string("from_run", "", "A run's workdir whose checkpoint --step is read "
                            "(its config must match the task's model).", **_F)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the rollouts and the splits.", **_F)
_RAW = flags.DEFINE_string("raw", "", "Score the samples saved by an earlier run "
                           "(WORKDIR/pass_rate_prior.npz) instead of sampling again.", **_F)
_OVERRIDES = flags.DEFINE_multi_string("set", [], "Extra config overrides key=value "
                                       "(python literal values).", **_F)

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the configs


def _config():
  import ast  # pylint: disable=g-import-not-at-top
  import rlx  # pylint: disable=g-import-not-at-top
  from rlx import configs  # pylint: disable=g-import-not-at-top
  base = rlx.load_config(os.path.join(EXPERIMENTS, f"{_TASK.value}.py"))
  o = {"seed": _SEED.value, "rl.group_size": _GROUP.value,
       "rl.prompts_per_step": _PER_STEP.value, "selection.mode": "uniform",
       "replay.enabled": False}
  # The task settings efficiency.py runs with (so its warm start matches).
  if _TASK.value == "arith":
    o["task.rl_levels"] = (2, 3, 4, 5)
  else:
    o["task.num_eval_per_level"] = 200
  for kv in _OVERRIDES.value:
    k, v = kv.split("=", 1)
    try:
      o[k] = ast.literal_eval(v)
    except (ValueError, SyntaxError):
      o[k] = v
  return configs.with_overrides(base, o)


@functools.partial(jax.jit, static_argnums=(0,))
def prefill_features(graphdef, params, prompts_BxP, prompt_lens_B, temperature):
  """First completion token's entropy and log top probability; the prompt's mean token NLL."""
  from rlx.model import transformer  # pylint: disable=g-import-not-at-top
  from rlx.sampler.sampling import prompt_positions  # pylint: disable=g-import-not-at-top
  pos, valid = prompt_positions(prompt_lens_B, prompts_BxP.shape[1])
  logits, _ = transformer.apply(graphdef, params, prompts_BxP, pos, valid)
  logits = logits.astype(jnp.float32)
  first = jax.nn.log_softmax(logits[:, -1] / temperature, axis=-1)
  entropy = -(jnp.exp(first) * first).sum(-1)
  log_top = first.max(-1)
  lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  tok_lp = jnp.take_along_axis(lp, prompts_BxP[:, 1:, None], axis=-1)[..., 0]
  # Predicted positions: the prompt's own tokens after its first (left padding excluded).
  m = valid[:, 1:] & valid[:, :-1]
  nll = -(tok_lp * m).sum(-1) / jnp.maximum(m.sum(-1), 1)
  return entropy, log_top, nll


def collect(config, workdir):
  """Per distinct prompt: reward sum, samples, bucket, prompt tokens and prefill features."""
  import rlx  # pylint: disable=g-import-not-at-top
  from rlx import sharding as shd  # pylint: disable=g-import-not-at-top
  from rlx import trainer  # pylint: disable=g-import-not-at-top
  setup = trainer.build(config, workdir, log=print)
  state, fns = setup.state, setup.fns
  if _STEP.value >= 0:
    saved = rlx.read_checkpoint(_FROM.value or workdir, _STEP.value)
    params = jax.tree.map(lambda a, b: np.asarray(a).astype(b.dtype), saved["params"],
                          state.params)
    state = state.replace(params=shd.put(params, fns.state_sharding.params))
  pool = shd.put(setup.exp.train_pool, fns.pool_sharding)
  g = config.rl.group_size
  per = {}
  calls = 0
  while len(per) < _PROMPTS.value:
    state, ro = fns.rollout(state, pool)
    calls += 1
    b = jax.device_get(ro.batch)
    for i in range(0, len(b.rewards), g):
      pid = int(b.prompt_ids[i])
      e = per.setdefault(pid, {"r": [], "bucket": int(b.difficulty[i]),
                               "prompt": np.asarray(b.prompts[i]),
                               "len": int(b.prompt_lens[i])})
      e["r"].append(np.asarray(b.rewards[i:i + g], np.float64))
    print(f"[prior] rollout call {calls}: {len(per)} distinct prompts", flush=True)
  ids = sorted(per)
  prompts = np.stack([per[i]["prompt"] for i in ids])
  lens = np.array([per[i]["len"] for i in ids], np.int32)
  temp = float(config.sampler.temperature) or 1.0
  params = jax.device_get(state.params)
  feats = []
  for s in range(0, len(ids), 64):
    feats.append([np.asarray(x) for x in prefill_features(
        setup.exp.graphdef, params, jnp.asarray(prompts[s:s + 64]),
        jnp.asarray(lens[s:s + 64]), temp)])
  ent, logtop, nll = (np.concatenate([f[k] for f in feats]) for k in range(3))
  tf_probe = teacher_forced_probe(setup, state, ids)
  # Rewards of each prompt's first group (a prompt drawn again adds its groups to the sums).
  first = np.stack([per[i]["r"][0] for i in ids])
  return {"k": np.array([np.concatenate(per[i]["r"]).sum() for i in ids]),
          "n": np.array([sum(len(x) for x in per[i]["r"]) for i in ids], float),
          "first": first, "bucket": np.array([per[i]["bucket"] for i in ids]),
          "len": lens.astype(float),
          "entropy": ent, "log_top": logtop, "nll": nll, "tf_probe": tf_probe}


def teacher_forced_probe(setup, state, ids):
  """f64[len(ids)]: rlx.train.true_pass_rate of the pool's prompts `ids` (see module doc);
  a task's probe references are tokenized here when the run's config did not ask for them."""
  from rlx import experiment, train  # pylint: disable=g-import-not-at-top
  from rlx.data import registry, tasks  # pylint: disable=g-import-not-at-top
  exp, cfg = setup.exp, setup.step_cfg
  pool = exp.train_pool
  make_refs = registry.get_task(setup.spec.task.name).probe_references
  if make_refs is not None and pool.references is None:
    fmt, _ = experiment.prompt_formatter(setup.spec, exp.tokenizer)
    if fmt("1+2=") != "1+2=":  # an instruction or chat template wraps the problems
      raise ValueError("the probe references are made from the pool's prompt texts, which "
                       "must be the bare problems: run without task.instruction and "
                       "tokenizer.chat_template.")
    refs, lens = tasks.tokenize_references(
        [tuple(make_refs({"prompt": p})) for p in exp.train_host.prompts], exp.tokenizer,
        setup.spec.sampler.max_new_tokens, pool.size, "probe references")
    pool = pool.replace(references=refs, reference_lens=lens)
  elif make_refs is None and cfg.verifier.kind != "exact_match":
    return np.full(len(ids), np.nan)
  fn = jax.jit(lambda params, pool, i: train.true_pass_rate(
      state.replace(params=params), pool, i, graphdef=exp.graphdef, cfg=cfg))
  pool = jax.device_put(pool)  # once, not with every batch of 64
  ids = np.asarray(ids, np.int32)
  out = [np.asarray(fn(state.params, pool, jnp.asarray(np.resize(ids[s:s + 64], 64))))[
      :len(ids[s:s + 64])] for s in range(0, len(ids), 64)]
  return np.concatenate(out).astype(np.float64)


def fit_logistic(x_NxF, k_N, n_N, l2=1e-2, iters=50):
  """Binomial logistic regression by Newton's method (k successes of n per row)."""
  w = np.zeros(x_NxF.shape[1])
  for _ in range(iters):
    p = 1 / (1 + np.exp(-(x_NxF @ w)))
    grad = x_NxF.T @ (n_N * p - k_N) + l2 * w
    hess = (x_NxF * (n_N * p * (1 - p))[:, None]).T @ x_NxF + l2 * np.eye(len(w))
    step = np.linalg.solve(hess, grad)
    w -= step
    if np.abs(step).max() < 1e-8:
      break
  return w


def design(d, idx, buckets, with_bucket, mu=None, sd=None):
  """Intercept, optional bucket one-hot, standardised prefill features (mu / sd: the fitted
  half's, reused for the held-out half)."""
  cols = [np.ones(len(idx))]
  if with_bucket:
    cols += [(d["bucket"][idx] == b).astype(float) for b in buckets[1:]]
  f = np.stack([d["entropy"][idx], d["log_top"][idx], d["nll"][idx], d["len"][idx]], 1)
  if mu is None:
    mu, sd = f.mean(0), f.std(0) + 1e-9
  cols += list(((f - mu) / sd).T)
  return np.stack(cols, 1), mu, sd


def mixed(p, g):
  return 1 - p ** g - (1 - p) ** g


PROBE = 4  # samples a probe estimator may look at; the held-out truth excludes them
PSEUDO = 2.0  # a probe's prior weight (pseudo-samples at the bucket's rate)


def evaluate(d, rng, splits: int, g: int, keep_frac: float):
  """Scores of every estimator over `splits` random fit / held-out halves (see module doc)."""
  phat = d["k"] / d["n"]
  # Held-out truth: a prompt's pass rate without its first PROBE samples, so that the probe
  # estimators (which look at those) are scored on samples they did not see.
  truth_p = (d["k"] - d["first"][:, :PROBE].sum(1)) / (d["n"] - PROBE)
  n_prompts = len(phat)
  buckets = np.unique(d["bucket"])
  probes = [f"probe {k} + bucket" for k in (1, 2, 4)]
  names = ["flat", "global", "bucket", "features", "bucket+features"] + probes
  if "tf_probe" in d and np.isfinite(d["tf_probe"]).all():
    names.append("teacher-forced probe")
  mse = {m: [] for m in names}
  chosen = {m: [] for m in names + ["bucket, spread-aware", "random", "oracle"]}
  var, noise = [], []
  for _ in range(splits):
    perm = rng.permutation(n_prompts)
    fit, test = perm[:n_prompts // 2], perm[n_prompts // 2:]
    pt = truth_p[test]
    var.append(pt.var())
    noise.append(np.mean(pt * (1 - pt)) / (d["n"][test].mean() - PROBE - 1))
    glob = phat[fit].mean()
    est = {"flat": np.full(len(test), 0.5), "global": np.full(len(test), glob)}
    rates = {b: d["k"][fit][d["bucket"][fit] == b].sum() / max(
        d["n"][fit][d["bucket"][fit] == b].sum(), 1) for b in buckets}
    est["bucket"] = np.array([rates[b] if (d["bucket"][fit] == b).any() else glob
                              for b in d["bucket"][test]])
    # Spread-aware bucket score for selection, what `selection.bucket_score=spread` tracks:
    # the bucket's mean unbiased group variance over its fitted prompts, E[p(1-p)], rather
    # than p(1-p) at the bucket's mean p (two buckets with the same mean differ when one's
    # prompts sit nearer 0 and 1).
    pq = phat * (1 - phat) * d["n"] / np.maximum(d["n"] - 1, 1)
    pq_rate = {b: pq[fit][d["bucket"][fit] == b].mean()
               if (d["bucket"][fit] == b).any() else glob * (1 - glob) for b in buckets}
    spread_score = np.array([pq_rate[b] for b in d["bucket"][test]])
    for name, wb in (("features", False), ("bucket+features", True)):
      xf, mu, sd = design(d, fit, buckets, wb)
      w = fit_logistic(xf, d["k"][fit], d["n"][fit])
      xt, _, _ = design(d, test, buckets, wb, mu, sd)
      est[name] = 1 / (1 + np.exp(-(xt @ w)))
    for name, k in zip(probes, (1, 2, 4)):
      est[name] = (d["first"][test, :k].sum(1) + PSEUDO * est["bucket"]) / (k + PSEUDO)
    if "teacher-forced probe" in names:
      est["teacher-forced probe"] = d["tf_probe"][test]
    keep = max(1, int(round(keep_frac * len(test))))
    truth = mixed(pt, g)
    for m in names:
      mse[m].append(np.mean((est[m] - pt) ** 2))
      # Ties (flat, global, bucket) broken at random.
      order = np.lexsort((rng.random(len(test)), -mixed(est[m], g)))
      chosen[m].append(truth[order[:keep]].mean())
    order = np.lexsort((rng.random(len(test)), -spread_score))
    chosen["bucket, spread-aware"].append(truth[order[:keep]].mean())
    chosen["random"].append(truth.mean())
    chosen["oracle"].append(np.sort(truth)[::-1][:keep].mean())
  return {"prompts": n_prompts, "samples_per_prompt": float(d["n"].mean()),
          "mean_pass": float(phat.mean()), "var": float(np.mean(var)),
          "noise": float(np.mean(noise)),
          "mse": {m: (float(np.mean(v)), float(np.std(v))) for m, v in mse.items()},
          "chosen": {m: (float(np.mean(v)), float(np.std(v))) for m, v in chosen.items()},
          "by_bucket": {int(b): (int((d["bucket"] == b).sum()),
                                 float(phat[d["bucket"] == b].mean()),
                                 float(phat[d["bucket"] == b].std()),
                                 float(np.mean(d["tf_probe"][d["bucket"] == b]))
                                 if "tf_probe" in d else float("nan"))
                        for b in buckets}}


def report(r, title):
  lines = [f"{title}: {r['prompts']} prompts x {r['samples_per_prompt']:.0f} samples, mean "
           f"pass rate {r['mean_pass']:.3f}; {_SPLITS.value} random half / half splits "
           f"(mean +- sd over splits).", "",
           "| bucket | prompts | mean p^ | sd of p^ across prompts | mean teacher-forced probe |",
           "|---|---|---|---|---|"]
  for b, (n, m, s, tf) in r["by_bucket"].items():
    lines.append(f"| {b} | {n} | {m:.3f} | {s:.3f} | {tf:.3f} |")
  v, z = r["var"], r["noise"]
  lines += ["", f"Held-out truth p^: each prompt's samples after its first {PROBE} (which only "
            f"the probe estimators see). Var(p^) over held-out prompts {v:.4f}, of which "
            f"binomial noise of the finite group ~{z:.4f} (no estimator can remove it).", "",
            "| estimator | MSE vs p^ | R^2 | mixed-group chance of the chosen "
            f"{_KEEP.value:.0%} (g={_TRAIN_G.value}) |", "|---|---|---|---|"]
  for m, (mu, sd) in r["mse"].items():
    c, cs = r["chosen"][m]
    lines.append(f"| {m} | {mu:.4f} +- {sd:.4f} | {1 - mu / v:.3f} | {c:.3f} +- {cs:.3f} |")
  for m in ("bucket, spread-aware", "random", "oracle"):
    c, cs = r["chosen"][m]
    lines.append(f"| {m} choice | | | {c:.3f} +- {cs:.3f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  if _RAW.value:
    data = dict(np.load(_RAW.value))
  else:
    data = collect(_config(), _WORKDIR.value)
    np.savez(os.path.join(_WORKDIR.value, "pass_rate_prior.npz"), **data)
  r = evaluate(data, np.random.default_rng(_SEED.value), _SPLITS.value, _TRAIN_G.value,
               _KEEP.value)
  when = ("base model" if _STEP.value < 0 else
          f"checkpoint step {_STEP.value} of {_FROM.value or _WORKDIR.value}")
  text = report(r, f"Task {_TASK.value}, {when}")
  print(text, flush=True)
  with open(os.path.join(_WORKDIR.value, "pass_rate_prior.json"), "w") as f:
    json.dump(r, f, indent=1)
  with open(os.path.join(_WORKDIR.value, "pass_rate_prior.md"), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  if any(a in ("-h", "--help", "--helpfull") for a in sys.argv[1:]):
    print(__doc__ + "\nFlags:\n" + _FLAGS.get_help())
    sys.exit(0)
  try:
    rest = _FLAGS(sys.argv)
  except flags.Error as e:
    sys.exit(f"{e}; see --help.")
  app.run(main, argv=rest)
