r"""Training-step benchmark: where a step's time goes, against this machine's own ceilings.

Runs the experiment's own step (same config, same base model) for a few steps after
compilation and prints medians of:
  generation       the rollout half (sampler + rewards + advantages), as the trainer runs it
  sampler alone    the same sampler call on the same prompts and keys, jitted by itself (the
                   in-step rollout should cost no more than this plus scoring)
  update           the update half as the trainer runs it (pi_old fused, padding cut)
  pi_old forward   a separate no-grad forward over the batch: what the update would spend on
                   pi_old without fusing it into the first gradient pass (0 in the step
                   with one minibatch)
  forward+backward value_and_grad of the policy loss over the batch
  optimizer        the optax update + apply
  evaluation       the run's held-out evaluation (rlx.evaluate.Evaluator: greedy, the run's
                   sampler impl and PagedConfig, eval_batch_size batches, scored by the
                   task's jnp verifier, results on the host)
  sampler (eval)   the same sampler alone on the same eval batches (already on device, one
                   jitted call per batch, group_size 1): evaluation / this is the Evaluator's
                   overhead over its decode (--eval=false skips both)
with achieved FLOP/s (XLA's cost analysis of each compiled phase / its median time) against
an f32 GEMM peak measured in the same process, and, for generation, the fraction of its
roofline: the larger of the bandwidth time (params read once per decode step + the KV cache
each sequence reads, at a copy bandwidth measured in the same process) and the compute time
(2 x params FLOPs per generated token at the GEMM peak). --profile_dir writes a
jax.profiler trace of one step (open with TensorBoard or Perfetto).

  python experiments/bench_step.py --config=experiments/arith.py --workdir=/tmp/rlx_arith
  python experiments/bench_step.py --config=experiments/arith.py:runlocal --workdir=/tmp/b \
      --steps=5 --profile_dir=/tmp/b/trace
  python experiments/bench_step.py --config=experiments/arith.py:runlocal --workdir=/tmp/b \
      --config.sampler.eval_batch_size=40      # evaluation in batches that pad the pool
"""

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rlx import evaluate, train, trainer
from rlx import sharding as shd
from rlx.rl.loss import policy_loss
from rlx.sampler import dense, paged

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/arith.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_arith", "Workdir (its base model is used).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps after the compile step.")
_PROFILE = flags.DEFINE_string("profile_dir", "", "Write a jax.profiler trace of one step.")
_EVAL = flags.DEFINE_boolean("eval", True, "Also time the evaluation against its sampler alone.")


def _median_time(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _flops(jitted, *args) -> float:
  cost = jitted.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0)) if cost else 0.0


def gemm_peak(n: int = 2048, reps: int = 5) -> float:
  """f32 FLOP/s of an n x n x n matmul on the default device (this process, now)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  return 2 * n ** 3 / _median_time(f, a, a, reps=reps)


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
  """Bytes/s read + written by an elementwise pass over `mib` MiB (donated, in place)."""
  x = jnp.zeros((mib * 2 ** 20 // 4,), jnp.float32)
  f = jax.jit(lambda v: v + 1.0, donate_argnums=0)
  for _ in range(2):
    x = f(x)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    x = jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return 2 * x.nbytes / statistics.median(times)


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


def main(_):
  setup = trainer.build(_CONFIG.value, _WORKDIR.value, log=print)
  fns, state, cfg, g = setup.fns, setup.state, setup.step_cfg, setup.exp.graphdef
  mesh = setup.mesh
  pool = jax.device_put(setup.exp.train_pool, fns.pool_sharding)
  model = setup.exp.model_cfg
  rows = []
  ro = None
  for i in range(_STEPS.value + 1):
    if i == 1 and _PROFILE.value:
      jax.profiler.start_trace(_PROFILE.value)
    t0 = time.perf_counter()
    state, ro = fns.rollout(state, pool)
    shape = train.update_shape(ro, cfg, jax.device_count())  # waits for the rollout
    t1 = time.perf_counter()
    state, m = fns.update(state, ro, **shape)
    m = jax.device_get(m)
    t2 = time.perf_counter()
    if i == 1 and _PROFILE.value:
      jax.profiler.stop_trace()
      print(f"[bench_step] profile of step 1 written to {_PROFILE.value}")
    if i:  # step 0 compiles
      rows.append((t1 - t0, t2 - t1, float(m["ledger/tokens_generated"]),
                   float(m["ledger/update_pad_frac"]), shape["width"]))
  gen, upd, toks, pad, widths = map(np.asarray, zip(*rows))
  reps = max(3, min(_STEPS.value, 8))

  # --- the phases of the last step's batch, each jitted by itself.
  batch = train._trim(ro.batch, int(widths[-1]))  # pylint: disable=protected-access
  params = state.params
  logp = functools.partial(train.completion_logprobs, g,
                           temperature=cfg.sampling.policy_temperature,
                           chunk=cfg.logprob_chunk, remat=cfg.remat)
  seqs = (batch.prompts, batch.prompt_lens, batch.completions, batch.lengths)
  pi_old = jax.jit(lambda p, s: logp(p, *s)[0])

  def loss(p, b):
    lp, mask = logp(p, b.prompts, b.prompt_lens, b.completions, b.lengths)
    return policy_loss(lp, jax.lax.stop_gradient(lp), b.behaviour_logp, b.advantages, mask,
                       cfg.loss, norm_len=cfg.sampling.max_new_tokens)[0]

  fwd_bwd = jax.jit(jax.value_and_grad(loss))
  _, grads = fwd_bwd(params, batch)
  opt = jax.jit(lambda p, o, gr: setup.tx.update(gr, o, p))
  keys = jax.random.split(jax.random.key(1), batch.prompts.shape[0])
  chosen = ro.batch
  sampler = jax.jit(lambda p, pr, pl, k: train.sample(g, p, pr, pl, k, cfg, mesh))
  phases = {
      "sampler alone": (sampler, (params, chosen.prompts, chosen.prompt_lens, keys)),
      "pi_old forward": (pi_old, (params, seqs)),
      "forward+backward": (fwd_bwd, (params, batch)),
      "optimizer": (opt, (params, state.opt_state, grads)),
  }
  timed = {name: (_median_time(fn, *args, reps=reps), _flops(fn, *args))
           for name, (fn, args) in phases.items()}
  peak = gemm_peak()
  bw = copy_bandwidth()

  # Generation roofline: every decode step reads the params once and each sequence its KV
  # (bandwidth), and every generated token costs 2 x params FLOPs (compute); the larger.
  # (XLA's cost analysis counts a while loop's body once, so the sampler's FLOPs are modelled.)
  lengths = np.asarray(ro.batch.lengths)
  plens = np.asarray(ro.batch.prompt_lens)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * jnp.dtype(
      model.compute_dtype).itemsize
  kv_bytes = kv_per_token * float(np.sum(lengths * plens + lengths * (lengths + 1) / 2))
  gen_flops = 2.0 * model.num_params() * float(lengths.sum())
  roofline_s = max((param_bytes * float(lengths.max()) + kv_bytes) / bw, gen_flops / peak)

  print(f"\nconfig: {cfg.prompts_per_step} prompts x G={cfg.group_size}, "
        f"max_new_tokens={cfg.sampling.max_new_tokens}, sampler={cfg.sampler_impl}, "
        f"{model.num_params() / 1e6:.2f}M params, vocab {model.vocab_size}, "
        f"devices={jax.device_count()}; update widths {sorted(set(widths.tolist()))}, "
        f"padding {np.median(pad):.0%} of the update's token slots")
  print(f"machine (this process): f32 GEMM {peak / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s")
  print(f"{'phase':24s}{'median s':>10s}{'GFLOP':>10s}{'GFLOP/s':>10s}{'of GEMM':>9s}")
  print(f"{'generation (in step)':24s}{np.median(gen):10.3f}{'':>10s}{'':>10s}{'':>9s}  "
        f"{roofline_s / np.median(gen):.0%} of the roofline "
        f"({roofline_s * 1e3:.1f} ms)")
  for name, (t, fl) in timed.items():
    if name == "sampler alone":
      fl = gen_flops
    rate = fl / t if t else 0.0
    print(f"{name:24s}{t:10.3f}{fl / 1e9:10.2f}{rate / 1e9:10.1f}{rate / peak:9.0%}")
  upd_flops = timed["forward+backward"][1] + timed["optimizer"][1]
  print(f"{'update (in step)':24s}{np.median(upd):10.3f}{upd_flops / 1e9:10.2f}"
        f"{upd_flops / np.median(upd) / 1e9:10.1f}{upd_flops / np.median(upd) / peak:9.0%}  "
        f"{np.median(upd) / (upd_flops / peak):.2f}x the GEMM roofline")
  print(f"{'step':24s}{np.median(gen + upd):10.3f}")
  print(f"generated tokens/step {np.median(toks):.0f}, generated tokens/s "
        f"{np.median(toks / gen):.0f}")
  print(f"generation share of step time: {np.median(gen / (gen + upd)):.0%}; in-step "
        f"generation / sampler alone: {np.median(gen) / timed['sampler alone'][0]:.2f}x")
  if _EVAL.value:
    t_eval, t_alone, shapes = eval_vs_sampler(setup, params, max(reps, 7))
    print(f"\nevaluation: {shapes}")
    print(f"{'evaluation':24s}{t_eval:10.3f}")
    print(f"{'sampler (eval batches)':24s}{t_alone:10.3f}")
    print(f"evaluation / sampler alone: {t_eval / t_alone:.3f}x (medians of {max(reps, 7)} "
          f"interleaved runs each)")


if __name__ == "__main__":
  app.run(main)
