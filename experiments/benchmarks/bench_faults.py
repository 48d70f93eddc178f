r"""Page faults of the update: what one jitted value-and-grad costs in fresh host memory.

  python experiments/benchmarks/bench_faults.py --rows=32  # the 100M model of bench_peers
  GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \
      python experiments/benchmarks/bench_faults.py --rows=32     # freed memory kept in the process

Times the value-and-grad of a policy-gradient loss on the log-probs of `--rows` random rows of
7 prompt + 128 completion tokens (bench_peers' workload) at bench_peers' model shape, and
prints per call: wall time, minor page faults, system and user CPU time (getrusage), then the
process's peak RSS and an f32 2048^3 GEMM probe. XLA:CPU maps its temporary buffer fresh for
every call and unmaps it after, so each call faults that memory in again; see README
("Training step vs TRL") for what that costs on a VM.

  python experiments/benchmarks/bench_faults.py --rows=32 --micro_rows=8 --calls=4

times rlx's whole update (`train.update`, AdamW, one minibatch) on the same rows instead, the
whole batch at once (A) against gradient accumulation over micro-batches of --micro_rows rows
(B, `update_shape.micro_rows`), the two alternating call by call, and prints XLA's temporary
buffer size for each and the median B / A time.
"""

import resource
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from rlx import train
from rlx.model import transformer


_FLAGS = (
    flags.DEFINE_integer("rows", 32, "Rows of 7 prompt + 128 completion tokens."),
    flags.DEFINE_enum("size", "100m", ["tiny", "3m", "100m"], "bench_peers' model shape."),
    flags.DEFINE_integer("calls", 3, "Timed calls."),
    flags.DEFINE_integer("micro_rows", 0, "> 0: rlx's update, whole batch vs micro-batches of "
                         "this many rows."),
)


def main(argv) -> None:
  del argv
  args = types.SimpleNamespace(**{f.name: f.value for f in _FLAGS})
  from rlx.experiments.benchmarks.bench_peers import MODELS  # pylint: disable=g-import-not-at-top
  from rlx.experiments.benchmarks.roofline import gemm_peak  # pylint: disable=g-import-not-at-top
  cfg = MODELS[args.size]
  graphdef, params = transformer.init_params(cfg, 0)
  rng = np.random.default_rng(0)
  b, plen, t = args.rows, 7, 128
  prompts = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, plen)), jnp.int32)
  comps = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, t)), jnp.int32)
  plens, lens = jnp.full((b,), plen, jnp.int32), jnp.full((b,), t, jnp.int32)
  adv = jnp.asarray(rng.normal(size=(b,)), jnp.float32)

  if args.micro_rows:
    return accumulation_ab(args, graphdef, params, prompts, plens, comps, lens, adv)

  def loss(p):
    lp, mask = train.completion_logprobs(graphdef, p, prompts, plens, comps, lens, 1.0)
    ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))
    return jnp.sum(ratio * adv[:, None] * mask) / mask.sum()

  grad = jax.jit(jax.value_and_grad(loss))
  jax.block_until_ready(grad(params))  # compile
  print(f"{args.size}, {b} rows x ({plen} + {t}) tokens: value-and-grad per call")
  for _ in range(args.calls):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    jax.block_until_ready(grad(params))
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    faults = r1.ru_minflt - r0.ru_minflt
    sys_s = r1.ru_stime - r0.ru_stime
    print(f"  {wall:6.2f} s wall  {faults:9d} minor faults  {sys_s:6.2f} s system  "
          f"{r1.ru_utime - r0.ru_utime:6.2f} s user"
          + (f"  ({sys_s / faults * 1e6:.1f} us system per fault)" if faults else ""))
  print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB; "
        f"f32 GEMM probe (roofline.gemm_peak) {gemm_peak() / 1e9:.0f} GFLOP/s")


def _usage() -> tuple:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return time.perf_counter(), r.ru_minflt, r.ru_stime


def accumulation_ab(args, graphdef, params, prompts, plens, comps, lens, adv) -> None:
  """rlx's update on the batch at once (A) vs in micro-batches (B), alternating per call."""
  import functools  # pylint: disable=g-import-not-at-top
  import statistics  # pylint: disable=g-import-not-at-top
  from rlx.rl.loss import LossConfig  # pylint: disable=g-import-not-at-top
  from rlx.experiments.benchmarks.roofline import gemm_peak  # pylint: disable=g-import-not-at-top
  from rlx import sharding as shd  # pylint: disable=g-import-not-at-top
  from rlx.sampler.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  b, t = comps.shape
  if args.micro_rows >= b or b % args.micro_rows:
    raise SystemExit(f"--micro_rows={args.micro_rows}: expected a divisor of --rows={b} "
                     "below it.")
  lp, mask = train.completion_logprobs(graphdef, params, prompts, plens, comps, lens, 1.0)
  batch = train.Batch(
      prompts=prompts, prompt_lens=plens, completions=comps,
      behaviour_logp=jnp.where(mask, lp - 0.01, 0.0), lengths=lens,
      truncated=jnp.zeros((b,), bool), rewards=jnp.zeros((b,)), advantages=adv,
      prompt_ids=jnp.arange(b) // 8, difficulty=jnp.ones((b,), jnp.int32),
      policy_version=jnp.zeros((b,), jnp.int32))
  ro = train.Rollouts(batch, {"ledger/tokens_discarded": jnp.zeros(())})
  tx = train.make_optimizer(1e-6, 100, schedule="constant")
  mesh = shd.make_mesh(1, 1, devices=jax.devices()[:1])
  state = train.init_state(params, tx, 0, mesh, prompt_width=prompts.shape[1],
                           max_new_tokens=t)
  fns, temps = {}, {}
  for name, micro in (("A whole batch", 0), (f"B {b // args.micro_rows} x {args.micro_rows} rows",
                                              args.micro_rows)):
    cfg = train.StepConfig(prompts_per_step=b // 8, group_size=8, advantage="grpo",
                           num_updates=1, num_minibatches=1, loss=LossConfig(),
                           sampling=SamplingParams(max_new_tokens=t), update_micro_rows=micro)
    shape = train.update_shape(ro, cfg)  # as the trainer sizes it: B's parts, A's none
    fn = jax.jit(functools.partial(train.update, graphdef=graphdef, cfg=cfg, tx=tx, **shape))
    temps[name] = fn.lower(state, ro).compile().memory_analysis().temp_size_in_bytes
    jax.block_until_ready(fn(state, ro))  # compile + first run
    fns[name] = fn
  print(f"{args.size}, {b} rows x ({prompts.shape[1]} + {t}) tokens: rlx's update per call")
  times = {name: [] for name in fns}
  for _ in range(args.calls):
    for name, fn in fns.items():
      t0, f0, s0 = _usage()
      jax.block_until_ready(fn(state, ro))
      t1, f1, s1 = _usage()
      times[name].append(t1 - t0)
      print(f"  {name:24s} {t1 - t0:6.2f} s wall  {f1 - f0:9d} minor faults  "
            f"{s1 - s0:6.2f} s system", flush=True)
  a, bt = times.values()
  for name in fns:
    print(f"{name}: median {statistics.median(times[name]):.2f} s, XLA temp buffer "
          f"{temps[name] / 2**30:.2f} GB")
  print(f"B / A time: {statistics.median(bt) / statistics.median(a):.2f}x (medians of "
        f"{args.calls} alternating calls); f32 GEMM probe {gemm_peak() / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
  app.run(main)
