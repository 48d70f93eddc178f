r"""Training-step benchmark: where a step's time goes, against this machine's own ceilings.

Runs the experiment's own step (same config, same base model) for a few steps after
compilation and prints medians of:
  generation       the rollout half (sampler + rewards + advantages), as the trainer runs it
  sampler alone    the same sampler call on the same prompts and keys, jitted by itself, on
                   what the rollout decodes with (train.policy_params: the params, or under
                   LoRA the base with the adapters merged inside the call when
                   lora.merge_for_sampling, else attached unmerged); the in-step rollout
                   should cost no more than this plus scoring
  merge (LoRA)     train.policy_params alone: W + scale * A @ B for every adapted matrix, the
                   merge the rollout pays once per step (only with lora.merge_for_sampling)
  update           the update half as the trainer runs it (pi_old fused, padding cut)
  pi_old forward   a separate no-grad forward over the batch: what the update would spend on
                   pi_old without fusing it into the first gradient pass (0 in the step
                   with one minibatch); under LoRA the unmerged low-rank path
                   (train.model_params), as the update computes
  forward+backward value_and_grad of the policy loss over the batch, w.r.t. the trainable
                   params (under LoRA the adapters only: no [in, out] gradient of the base)
  fwd+bwd (full)   LoRA only, for reference: the same loss differentiated w.r.t. every weight
                   of the merged model (what full fine-tuning computes on this batch)
  optimizer        the optax update + apply on the trainable params (LoRA: the adapters)
  GEMMs alone      full fine-tuning only: the update's matmuls (every projection's forward
                   and two backward GEMMs, attention's QK^T / PV, the vocabulary projection),
                   each shape timed alone at the update's micro-batch shapes
                   (roofline.update_gemms, in this folder): a floor at its own shapes, where
                   the square GEMM probe is the machine's best case
  evaluation       the run's held-out evaluation (rlx.evaluate.Evaluator: greedy, the run's
                   sampler impl and PagedConfig, eval_batch_size batches, scored by the
                   task's jnp verifier, results on the host), on train.policy_params as the
                   trainer evaluates (LoRA: merged once before the evaluation, or unmerged)
  sampler (eval)   the same sampler alone on the same eval batches (already on device, one
                   jitted call per batch, group_size 1): evaluation / this is the Evaluator's
                   overhead over its decode (--eval=false skips both)
with achieved FLOP/s (XLA's cost analysis of each compiled phase / its median time) against
an f32 GEMM peak measured in the same process (a 2048^3 probe after every timed step and
once more with the phases; the fastest is the ceiling), and, for generation, the fraction of its
roofline: the larger of the bandwidth time (the decoded weights read once per decode step +
the KV cache each sequence reads, at a copy bandwidth measured in the same process) and the
compute time (2 x the decoded weights' FLOPs per generated token at the GEMM peak; unmerged
LoRA adds its 2 r (in + out) per adapted matrix). Under LoRA the forward+backward's FLOPs
are XLA's count of what the LoRA backward computes (~2x its forward, against ~3x for full
fine-tuning, which also forms every weight gradient); the ratio to the full fine-tuning
reference is printed. A config with a Python reward (task.reward) is stepped as the trainer
steps it: generate, the reward on the host (counted as generation), score + update.
--profile_dir writes a jax.profiler trace of one step (open with TensorBoard or Perfetto).

--lora_sampling_compare (needs --config.lora.rank > 0) then times, interleaved in this
process on the same prompts, keys and adapters (the ones the timed steps trained), the
sampler decoding: the full-parameter model (a plain dict of the merged weights, what a
full-parameter run's sampler reads), LoRA merged (merge + decode in one call, as the rollout
with lora.merge_for_sampling runs), LoRA unmerged (the low-rank path in every decoded
projection), and the merge alone; medians and ratios.

  python experiments/benchmarks/bench_step.py --config=experiments/arith.py --workdir=/tmp/rlx_arith
  python experiments/benchmarks/bench_step.py --config=experiments/arith.py:runlocal \
      --workdir=/tmp/b \
      --steps=5 --profile_dir=/tmp/b/trace
  python experiments/benchmarks/bench_step.py --config=experiments/arith.py:runlocal \
      --workdir=/tmp/b \
      --config.sampler.eval_batch_size=40      # evaluation in batches that pad the pool
  python experiments/benchmarks/bench_step.py --config=experiments/reasoning.py \
      --workdir=/tmp/rlx_reasoning --sampler_compare   # paged vs dense in the loop, slots, KV
  python experiments/benchmarks/bench_step.py --config=experiments/arith.py --workdir=/tmp/b_lora \
      --config.warm_start.dir=/tmp/rlx_arith/base --config.lora.rank=8 \
      --lora_sampling_compare                  # LoRA: merged vs unmerged vs full sampling
  python experiments/benchmarks/bench_step.py \
      --config=experiments/benchmarks/bench_peers_config.py:/tmp/p100 \
      --workdir=/tmp/p100/step --steps=3       # bench_peers' workload (see that config)
"""

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from ml_collections import config_flags

from rlx import evaluate, train, trainer
from rlx import sharding as shd
from rlx.model import lora as lora_lib
from rlx.rl.loss import policy_loss
from rlx.experiments.benchmarks.roofline import (copy_bandwidth, gemm_floor, gemm_peak,
                                                 update_gemms, xla_flops)
from rlx.experiments.benchmarks.step_timing import host_scorer, timed_step
from rlx.experiments.benchmarks.timing import median_time
from rlx.sampler import dense, paged

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/arith.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_arith", "Workdir (its base model is used).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps after the compile step.")
_PROFILE = flags.DEFINE_string("profile_dir", "", "Write a jax.profiler trace of one step.")
_EVAL = flags.DEFINE_boolean("eval", True, "Also time the evaluation against its sampler alone.")
_LORA_COMPARE = flags.DEFINE_boolean(
    "lora_sampling_compare", False,
    "LoRA runs: also time sampling with merged vs unmerged adapters vs the full-parameter "
    "model (same prompts, keys and adapters, interleaved).")
_PHASES = flags.DEFINE_boolean(
    "phases", True, "Time the phases and the evaluation after the steps (false: only the "
    "steps' medians and --lora_sampling_compare).")
_COMPARE_REPS = flags.DEFINE_integer("compare_reps", 9, "Interleaved rounds of the comparison.")
_SAMPLER_COMPARE = flags.DEFINE_boolean(
    "sampler_compare", False, "Also run the step with the dense sampler, interleaved with the "
    "paged one, and print the paged sampler's own statistics (slots, KV held vs stored).")


def eval_vs_sampler(setup, params, reps: int) -> tuple[float, float, str]:
  """(median s of the run's evaluation, median s of its sampler alone on the same batches,
  a description of the shapes). The Evaluator is built as the trainer builds it (jnp
  verifier; a host reward would add its own Python time)."""
  spec, cfg, exp, mesh, g = setup.spec, setup.step_cfg, setup.exp, setup.mesh, setup.exp.graphdef
  tok = exp.tokenizer
  greedy = spec.sampler.sampling(eos_id=tok.eos_id, pad_id=tok.pad_id,
                                 stop_ids=tuple(getattr(tok, "stop_ids", ()) or ()),
                                 greedy=True)
  ev = evaluate.Evaluator(g, exp.eval_pool, greedy, spec.sampler.eval_batch_size, mesh,
                          verifier=cfg.verifier, band=spec.task.band,
                          sampler_impl=cfg.sampler_impl, paged=cfg.paged)
  bs, pool = ev.batch_size, ev.pool  # the padded pool, cut as the Evaluator cuts it
  batches = [tuple(shd.put(x[i:i + bs], shd.batch_sharding(mesh, x.ndim))
                   for x in (pool.prompts, pool.prompt_lens))
             for i in range(0, pool.prompts.shape[0], bs)]
  keys = jax.device_put(jax.random.split(jax.random.key(0), bs), shd.batch_sharding(mesh))
  if cfg.sampler_impl == "paged":
    alone = functools.partial(paged.generate, g, sp=greedy, pc=cfg.paged or paged.PagedConfig(),
                              group_size=1, mesh=mesh)
  else:
    alone = functools.partial(dense.generate, g, params_cfg=greedy)

  def sampler_alone(p):
    return [alone(p, prompts, lens, keys) for prompts, lens in batches]

  # Interleaved (evaluation, sampler, evaluation, ...) after a compiling call each, so a
  # disturbance of this shared machine hits both alike; medians.
  fns = (ev.scores_and_lengths, sampler_alone)
  for fn in fns:
    jax.block_until_ready(fn(params))
  times = [[], []]
  for _ in range(reps):
    for fn, ts in zip(fns, times):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(params))
      ts.append(time.perf_counter() - t0)
  t_eval, t_alone = map(statistics.median, times)
  _, lengths = ev.scores_and_lengths(params)
  shapes = (f"{ev.n} eval prompts in {len(batches)} batches of {bs} (width "
            f"{pool.prompts.shape[1]}), max_new_tokens={greedy.max_new_tokens}, mean completion "
            f"{lengths.mean():.1f} tokens, sampler={cfg.sampler_impl}")
  return t_eval, t_alone, shapes


def lora_sampling_compare(setup, state, prompts, prompt_lens, keys, reps: int) -> None:
  """Prints medians of the sampler decoding the same policy (the trained adapters on the
  frozen base) three ways, interleaved, and of the merge alone: the full-parameter model (a
  plain tree of the merged weights), LoRA merged (merge + decode in one jitted call, as the
  rollout runs with lora.merge_for_sampling) and LoRA unmerged (the low-rank path in every
  decoded projection)."""
  cfg, g, mesh, lc = setup.step_cfg, setup.exp.graphdef, setup.mesh, setup.step_cfg.lora
  base, adapters = state.base, state.params
  sample = lambda p, pr, pl, k: train.sample(g, p, pr, pl, k, cfg, mesh)
  merge = jax.jit(lora_lib.merge, static_argnums=2)
  full = merge(base, adapters, lc)  # what a full-parameter run's sampler would read
  runs = {
      "full-parameter": (jax.jit(sample), (full, prompts, prompt_lens, keys)),
      "LoRA merged": (jax.jit(lambda b, a, *x: sample(lora_lib.merge(b, a, lc), *x)),
                      (base, adapters, prompts, prompt_lens, keys)),
      "LoRA unmerged": (jax.jit(lambda b, a, *x: sample(lora_lib.attach(b, a, lc), *x)),
                        (base, adapters, prompts, prompt_lens, keys)),
      "merge alone": (jax.jit(lambda b, a: lora_lib.merge(b, a, lc)), (base, adapters)),
  }
  outs = {name: jax.device_get(jax.block_until_ready(fn(*args)))
          for name, (fn, args) in runs.items()}  # compiles
  times = {name: [] for name in runs}
  for _ in range(reps):  # interleaved: a disturbance of a shared machine hits all alike
    for name, (fn, args) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  med = {name: statistics.median(ts) for name, ts in times.items()}
  ref = outs["full-parameter"]
  targeted = sum(lora_lib._get(base, p).nbytes  # pylint: disable=protected-access
                 for p in lora_lib.adapter_paths(adapters))
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
  print(f"\nLoRA sampling: {prompts.shape[0]} sequences, max_new_tokens="
        f"{cfg.sampling.max_new_tokens}, sampler={cfg.sampler_impl}, rank {lc.rank} on "
        f"{len(lora_lib.adapter_paths(adapters))} matrices ({targeted / 2 ** 20:.1f} MiB of "
        f"targeted base weights, adapters {adapter_bytes / 2 ** 20:.2f} MiB); medians of {reps} "
        f"interleaved rounds")
  print(f"{'sampling':22s}{'median s':>10s}{'vs full':>9s}{'tokens':>8s}{'same rows':>11s}"
        f"  extra memory while decoding")
  extra = {"full-parameter": "-", "LoRA merged": f"{targeted / 2 ** 20:.1f} MiB (merged copy)",
           "LoRA unmerged": "none (reads W, A, B)"}
  for name in ("full-parameter", "LoRA merged", "LoRA unmerged"):
    o = outs[name]
    same = np.mean(np.all(o.tokens == ref.tokens, axis=1) & (o.lengths == ref.lengths))
    print(f"{name:22s}{med[name]:10.4f}{med[name] / med['full-parameter']:8.3f}x"
          f"{int(o.lengths.sum()):8d}{same:11.0%}  {extra[name]}")
  print(f"{'merge alone':22s}{med['merge alone']:10.4f}"
        f"{med['merge alone'] / med['full-parameter']:8.3f}x")
  print(f"merged - full = {med['LoRA merged'] - med['full-parameter']:+.4f} s (merge alone "
        f"{med['merge alone']:.4f} s); unmerged / merged = "
        f"{med['LoRA unmerged'] / med['LoRA merged']:.3f}x")


def sampler_compare(setup, state, pool, steps: int):
  """Steps with the paged and the dense sampler in the loop, interleaved (same state chain,
  same update), then the paged sampler's statistics on the last batch's prompts and keys."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from rlx.sampler import paged  # pylint: disable=g-import-not-at-top
  cfg = setup.step_cfg
  if cfg.sampler_impl != "paged":
    raise app.UsageError("--sampler_compare compares the paged sampler (sampler.impl=paged, "
                         "the default) with the dense one.")
  dense_cfg = dataclasses.replace(cfg, sampler_impl="dense")
  runs = {"paged": (setup.fns, cfg),
          "dense": (train.make_step_fns(setup.exp.graphdef, dense_cfg, setup.tx, setup.mesh,
                                        jax.eval_shape(lambda: state)), dense_cfg)}
  rows = {name: [] for name in runs}
  ro = None
  host = host_scorer(setup)
  for i in range(steps + 1):
    for name, (fns, c) in runs.items():  # interleaved: shared-machine noise hits both alike
      state, ro_i, _, m, t_gen, t_upd = timed_step(fns, c, state, pool, host)
      if name == "paged":
        ro = ro_i
      if i:  # the first round compiles
        rows[name].append((t_gen, t_upd, float(m["ledger/tokens_generated"])))
  print(f"\nsampler in the loop (medians of {steps} interleaved steps each, same state chain):")
  print(f"{'sampler':10s}{'generation s':>14s}{'update s':>10s}{'step s':>9s}{'tokens/s':>10s}"
        f"{'generation share':>18s}")
  med = {}
  for name, r in rows.items():
    gen, upd, tok = map(np.asarray, zip(*r))
    med[name] = (np.median(gen), np.median(gen + upd), np.median(tok / gen))
    print(f"{name:10s}{np.median(gen):14.3f}{np.median(upd):10.3f}{np.median(gen + upd):9.3f}"
          f"{np.median(tok / gen):10.0f}{np.median(gen / (gen + upd)):18.0%}")
  print(f"dense / paged: generation {med['dense'][0] / med['paged'][0]:.2f}x, step "
        f"{med['dense'][1] / med['paged'][1]:.2f}x; paged tokens/s {med['paged'][2] / med['dense'][2]:.2f}x "
        f"dense's")
  b = ro.batch
  keys = jax.random.split(jax.random.key(2), b.prompts.shape[0])
  gen_stats = jax.jit(lambda p, pr, pl, k: paged.generate_unjitted(
      setup.exp.graphdef, p, pr, pl, k, cfg.sampling, cfg.paged or paged.PagedConfig(),
      group_size=cfg.group_size, mesh=setup.mesh, return_stats=True))
  out, st = gen_stats(train.policy_params(state, cfg), b.prompts, b.prompt_lens, keys)
  summ = st.summary()
  lengths = np.asarray(out.lengths)
  print(f"paged sampler statistics on one step's {lengths.size} rollouts (lengths median "
        f"{np.median(lengths):.0f}, max {lengths.max()}): slot utilisation "
        f"{summ['slot_utilisation']:.0%} (of a fixed-width loop: "
        f"{summ['fixed_slot_utilisation']:.0%}), KV held / KV stored "
        f"{summ['kv_held_over_stored']:.2f}x (the group's shared prompt pages stored once), "
        f"peak {summ['peak_kv_tokens']:.0f} KV token slots, {summ['iterations']:.0f} decode "
        f"iterations, {summ['prefill_chunks']:.0f} prefill chunks")
  return state


def _phases(setup, state, ro, rows, keys, probes=()) -> None:
  """The phase table of the timed steps (`rows`) and the last step's batch, and the
  evaluation against its sampler."""
  cfg, g, mesh, model = setup.step_cfg, setup.exp.graphdef, setup.mesh, setup.exp.model_cfg
  gen, upd, toks, pad, widths = map(np.asarray, zip(*rows))
  reps = max(3, min(_STEPS.value, 8))

  # --- the phases of the last step's batch, each jitted by itself. `params` is what the
  # optimizer trains (LoRA: the adapters), `base` the frozen base (None: full-parameter).
  batch = train._trim(ro.batch, int(widths[-1]))  # pylint: disable=protected-access
  lc = cfg.lora
  params, base = state.params, state.base
  logp = functools.partial(train.completion_logprobs, g,
                           temperature=cfg.sampling.policy_temperature,
                           chunk=cfg.logprob_chunk, remat=cfg.remat)
  seqs = (batch.prompts, batch.prompt_lens, batch.completions, batch.lengths)

  def policy_of(p, b):  # what the rollout decodes with (LoRA: merged, or attached unmerged)
    return train.policy_params(state.replace(params=p, base=b), cfg)

  # The update's model: the params, or the base with the adapters on the low-rank path.
  pi_old = jax.jit(lambda p, b, s: logp(train.model_params(p, b, cfg), *s)[0])

  def model_loss(model, bt):
    lp, mask = logp(model, bt.prompts, bt.prompt_lens, bt.completions, bt.lengths)
    return policy_loss(lp, jax.lax.stop_gradient(lp), bt.behaviour_logp, bt.advantages, mask,
                       cfg.loss, norm_len=cfg.sampling.max_new_tokens)[0]

  # Gradients w.r.t. the trainable params only (argnum 0; LoRA: no gradient of the base).
  fwd_bwd = jax.jit(jax.value_and_grad(
      lambda p, b, bt: model_loss(train.model_params(p, b, cfg), bt)))
  _, grads = fwd_bwd(params, base, batch)
  opt = jax.jit(lambda p, o, gr: optax.apply_updates(p, setup.tx.update(gr, o, p)[0]))
  chosen = ro.batch
  sampler = jax.jit(lambda p, b, pr, pl, k: train.sample(g, policy_of(p, b), pr, pl, k, cfg,
                                                         mesh))
  phases = {
      "sampler alone": (sampler, (params, base, chosen.prompts, chosen.prompt_lens, keys)),
  }
  if lc is not None and lc.merge_for_sampling:
    phases["merge (LoRA)"] = (jax.jit(policy_of), (params, base))
  phases.update({
      "pi_old forward": (pi_old, (params, base, seqs)),
      "forward+backward": (fwd_bwd, (params, base, batch)),
  })
  if lc is not None:  # full fine-tuning's forward+backward on the same (merged) weights
    merged = jax.jit(lora_lib.merge, static_argnums=2)(base, params, lc)
    phases["fwd+bwd (full, ref)"] = (jax.jit(jax.value_and_grad(model_loss)), (merged, batch))
  phases["optimizer"] = (opt, (params, state.opt_state, grads))
  timed = {name: (median_time(fn, *args, reps=reps), xla_flops(fn, *args))
           for name, (fn, args) in phases.items()}
  probes = [*probes, gemm_peak()]
  peak = max(probes)  # the fastest probe of the run: a ceiling (see roofline.gemm_peak)
  bw = copy_bandwidth()

  # Generation roofline: every decode step reads the decoded weights once and each sequence
  # its KV (bandwidth), and every generated token costs 2 x their FLOPs (compute); the
  # larger. Unmerged LoRA decodes W, A and B (2 r (in + out) more FLOPs per adapted matrix);
  # merged LoRA decodes a plain tree like the full-parameter model's. (XLA's cost analysis
  # counts a while loop's body once, so the sampler's FLOPs are modelled.)
  policy = policy_of(params, base)
  unmerged = lc is not None and not lc.merge_for_sampling
  n_adapter = lora_lib.num_params(params) if lc is not None else 0
  lengths = np.asarray(ro.batch.lengths)
  plens = np.asarray(ro.batch.prompt_lens)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(policy))
  kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * jnp.dtype(
      model.compute_dtype).itemsize
  kv_bytes = kv_per_token * float(np.sum(lengths * plens + lengths * (lengths + 1) / 2))
  gen_flops = 2.0 * (model.num_params() + (n_adapter if unmerged else 0)) * float(lengths.sum())
  roofline_s = max((param_bytes * float(lengths.max()) + kv_bytes) / bw, gen_flops / peak)

  print(f"\nconfig: {cfg.prompts_per_step} prompts x G={cfg.group_size}, "
        f"max_new_tokens={cfg.sampling.max_new_tokens}, sampler={cfg.sampler_impl}, "
        f"{model.num_params() / 1e6:.2f}M params, vocab {model.vocab_size}, "
        f"devices={jax.device_count()}; update widths {sorted(set(widths.tolist()))}, "
        f"padding {np.median(pad):.0%} of the update's token slots")
  if lc is not None:
    decodes = ("merged weights (merged inside the rollout, once per step)"
               if lc.merge_for_sampling else "the unmerged low-rank path")
    print(f"LoRA rank {lc.rank} (alpha {lc.alpha:g}) on {len(lora_lib.adapter_paths(params))} "
          f"matrices: {n_adapter / 1e6:.3f}M trainable params, base frozen in "
          f"{jax.tree.leaves(base)[0].dtype}; the sampler decodes {decodes}")
  print(f"machine (this process): f32 GEMM {peak / 1e9:.1f} GFLOP/s (2048^3, the fastest of "
        f"{len(probes)} probes, one after each timed step and one here; their median "
        f"{np.median(probes) / 1e9:.0f}), copy {bw / 1e9:.1f} GB/s")
  print(f"{'phase':24s}{'median s':>10s}{'GFLOP':>10s}{'GFLOP/s':>10s}{'of GEMM':>9s}")
  print(f"{'generation (in step)':24s}{np.median(gen):10.3f}{'':>10s}{'':>10s}{'':>9s}  "
        f"{roofline_s / np.median(gen):.0%} of the roofline "
        f"({roofline_s * 1e3:.1f} ms)")
  for name, (t, fl) in timed.items():
    if name == "sampler alone":  # modelled decode FLOPs (+ the merge's, counted by XLA)
      fl = gen_flops + timed.get("merge (LoRA)", (0.0, 0.0))[1]
    rate = fl / t if t else 0.0
    print(f"{name:24s}{t:10.3f}{fl / 1e9:10.2f}{rate / 1e9:10.1f}{rate / peak:9.0%}")
  upd_flops = timed["forward+backward"][1] + timed["optimizer"][1]
  print(f"{'update (in step)':24s}{np.median(upd):10.3f}{upd_flops / 1e9:10.2f}"
        f"{upd_flops / np.median(upd) / 1e9:10.1f}{upd_flops / np.median(upd) / peak:9.0%}  "
        f"{np.median(upd) / (upd_flops / peak):.2f}x the GEMM roofline")
  if lc is None:  # the update's GEMMs alone, at its shapes (full fine-tuning's matmul set)
    shape = train.update_shape(ro, cfg, jax.device_count())
    n_rows = shape.get("rows", ro.batch.lengths.shape[0])
    part_widths = tuple(shape.get("parts") or (shape["width"],))
    micro = n_rows // len(part_widths)
    prompt_w = ro.batch.prompts.shape[1]
    floor_s = floor_f = 0.0
    for w in part_widths:
      fs, ff = gemm_floor(update_gemms(model, micro, prompt_w + int(w), int(w)),
                          jnp.dtype(model.dtype))
      floor_s, floor_f = floor_s + fs, floor_f + ff
    print(f"{'GEMMs alone (floor)':24s}{floor_s:10.3f}{floor_f / 1e9:10.2f}"
          f"{floor_f / floor_s / 1e9:10.1f}{floor_f / floor_s / peak:9.0%}  the update's "
          f"matmuls at its shapes ({len(part_widths)} micro-batch(es) of {micro} rows x "
          f"{prompt_w} + {'/'.join(map(str, part_widths))} tokens), each shape timed alone; "
          f"update (in step) = {np.median(upd) / floor_s:.2f}x this floor")
  print(f"{'step':24s}{np.median(gen + upd):10.3f}")
  if lc is not None:
    fb, full_fb, fwd = (timed[k][1] for k in ("forward+backward", "fwd+bwd (full, ref)",
                                              "pi_old forward"))
    t_ratio = timed["forward+backward"][0] / timed["fwd+bwd (full, ref)"][0]
    print(f"LoRA forward+backward: {fb / 1e9:.2f} GFLOP (XLA's count) = {fb / fwd:.2f}x its "
          f"forward and {fb / full_fb:.2f}x full fine-tuning's on the same batch "
          f"({full_fb / 1e9:.2f} GFLOP = {full_fb / fwd:.2f}x the forward), in {t_ratio:.2f}x "
          f"its time. ~2/3 for the weight matmuls (no [in, out] gradient of the frozen base); "
          f"attention, softmax and the adapters' own matmuls, the same in both, move it up")
  print(f"generated tokens/step {np.median(toks):.0f}, generated tokens/s "
        f"{np.median(toks / gen):.0f}")
  print(f"generation share of step time: {np.median(gen / (gen + upd)):.0%}; in-step "
        f"generation / sampler alone: {np.median(gen) / timed['sampler alone'][0]:.2f}x")
  if _EVAL.value:
    # As the trainer evaluates: train.policy_params once (LoRA merged: one merge), then decode.
    t_eval, t_alone, shapes = eval_vs_sampler(setup, policy, max(reps, 7))
    print(f"\nevaluation: {shapes}")
    print(f"{'evaluation':24s}{t_eval:10.3f}")
    print(f"{'sampler (eval batches)':24s}{t_alone:10.3f}")
    print(f"evaluation / sampler alone: {t_eval / t_alone:.3f}x (medians of {max(reps, 7)} "
          f"interleaved runs each)")


def main(_):
  if _LORA_COMPARE.value and not _CONFIG.value.lora.rank:
    raise app.UsageError("--lora_sampling_compare needs a LoRA run (--config.lora.rank > 0).")
  setup = trainer.build(_CONFIG.value, _WORKDIR.value, log=print)
  fns, state, cfg = setup.fns, setup.state, setup.step_cfg
  pool = jax.device_put(setup.exp.train_pool, fns.pool_sharding)
  rows, probes = [], []
  ro = None
  host = host_scorer(setup)
  for i in range(max(_STEPS.value, 1) + 1):
    if i == 1 and _PROFILE.value:
      jax.profiler.start_trace(_PROFILE.value)
    state, ro, rewards, m, t_gen, t_upd = timed_step(fns, cfg, state, pool, host)
    if i == 1 and _PROFILE.value:
      jax.profiler.stop_trace()
      print(f"[bench_step] profile of step 1 written to {_PROFILE.value}")
    if i:  # step 0 compiles
      rows.append((t_gen, t_upd, float(m["ledger/tokens_generated"]),
                   float(m["ledger/update_pad_frac"]), int(m["ledger/update_width"])))
      probes.append(gemm_peak(reps=2))  # the roofline, sampled under each step's conditions
  if rewards is not None:  # the last batch as the update saw it (advantages set), for the
    # phases; scored on the state the update returned (the one passed in was donated to it)
    ro = jax.jit(functools.partial(train.score, cfg=cfg, mesh=setup.mesh))(state, ro, rewards)[1]
  keys = jax.random.split(jax.random.key(1), ro.batch.prompts.shape[0])
  if _PHASES.value:
    _phases(setup, state, ro, rows, keys, probes)
  else:
    gen, upd, toks = (np.asarray(x) for x in list(zip(*rows))[:3])
    print(f"\nsteps (medians of {len(rows)}): generation {np.median(gen):.3f} s, update "
          f"{np.median(upd):.3f} s, step {np.median(gen + upd):.3f} s, generated tokens/step "
          f"{np.median(toks):.0f}")
  if _SAMPLER_COMPARE.value:
    state = sampler_compare(setup, state, pool, max(_STEPS.value, 3))
  if _LORA_COMPARE.value:
    lora_sampling_compare(setup, state, ro.batch.prompts, ro.batch.prompt_lens, keys,
                          _COMPARE_REPS.value)


if __name__ == "__main__":
  app.run(main)
