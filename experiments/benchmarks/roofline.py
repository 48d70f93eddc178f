"""This machine's ceilings, measured in the running process, and the update's matmul floor:
the helpers experiments/benchmarks/bench_step.py (and bench_faults.py) report against. No
flags, so tests and other scripts can import it."""

import jax
import jax.numpy as jnp

from rlx.experiments.benchmarks.timing import best_time, median_time


def xla_flops(jitted, *args) -> float:
  """XLA's FLOP count of the program `jitted(*args)` asks for: the cost analysis of the
  lowered (pre-optimisation) HLO, where every matmul is still a dot. The compiled module's
  count misses work moved into library calls: on an H200 (jax 0.11.2) it counted 60-101
  GFLOP for a 100M model's forward + backward of ~2,600, and 24 for its forward of ~870
  (cuBLAS GEMMs are custom calls; the count varied with which fusions autotuning picked).
  On CPU the two agree. The compiled count is the fallback where a backend cannot analyse
  the lowered module."""
  lowered = jitted.lower(*args)
  for analyse in (lowered.cost_analysis, lambda: lowered.compile().cost_analysis()):
    try:
      cost = analyse()
    except Exception:  # pylint: disable=broad-except
      continue
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost and cost.get("flops"):
      return float(cost["flops"])
  return 0.0


_matmul = jax.jit(lambda x, y: x @ y)


def gemm_peak(n: int = 2048, reps: int = 5) -> float:
  """f32 FLOP/s of an n x n x n matmul on the default device (this process, now): the
  fastest of `reps` runs. A ceiling, so the best run is its estimate (load on a shared
  machine only ever slows a run down; one process's median of 5 ranged 184-448 GFLOP/s
  within an hour on the 2-core VM)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  return 2 * n ** 3 / best_time(_matmul, a, a, reps=reps)


def update_gemms(model, rows: int, seq: int, width: int) -> list[tuple]:
  """The matmuls of one forward + backward over a micro-batch of `rows` sequences of `seq`
  tokens whose last `width` positions are scored, as (batch, m, k, n, count) per call: every
  projection x @ W of every layer (q, k, v, o, gate, up, down) with its two backward GEMMs
  (g @ W^T and x^T @ g), attention's QK^T and PV per row and head with theirs, and the
  vocabulary projection over the scored positions. Llama / Qwen / Gemma-shaped models."""
  t, d, hd = rows * seq, model.d_model, model.head_dim
  q, kv, f, L = model.num_heads * hd, model.num_kv_heads * hd, model.mlp_dim, model.num_layers
  out = []
  for k_, n_, c in ((d, q, 1), (d, kv, 2), (q, d, 1), (d, f, 2), (f, d, 1)):
    out += [(1, t, k_, n_, c * L), (1, t, n_, k_, c * L), (1, k_, t, n_, c * L)]
  b = rows * model.num_heads  # scores = q k^T [seq, hd] x [hd, seq]; out = p v
  for m_, k_, n_ in ((seq, hd, seq), (seq, seq, hd)):
    out += [(b, m_, k_, n_, L), (b, m_, n_, k_, L), (b, k_, m_, n_, L)]
  tv, v = rows * width, model.vocab_size
  out += [(1, tv, d, v, 1), (1, tv, v, d, 1), (1, d, tv, v, 1)]
  return out


def gemm_floor(gemms, dtype, reps: int = 3, inner: int = 8) -> tuple[float, float]:
  """(seconds, FLOPs) of these matmuls, each shape jitted and timed alone on this process's
  XLA, times its count: what the update would take if everything but its GEMMs were free. A
  floor at the update's own shapes, where the square GEMM probe is the machine's best case.

  Each timing is `inner` back-to-back calls and one wait, divided by `inner` (median of
  `reps`): the per-call dispatch and host sync are spread over the calls, as the update's
  GEMMs, all inside one program, pay neither. Timed one call at a time, an H200 'floor' for
  a 100M model's update came out at 0.079 s, three times the whole update (0.027 s)."""
  total_s = total_f = 0.0
  mm = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
  for (bt, m, k, n, count) in gemms:
    a = jnp.ones((bt, m, k), dtype)
    b_ = jnp.ones((bt, k, n), dtype)
    total_s += count * median_time(mm, a, b_, reps=reps, inner=inner)
    total_f += count * 2.0 * bt * m * k * n
  return total_s, total_f


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
  """Bytes/s read + written by an elementwise pass over `mib` MiB (donated, in place)."""
  f = jax.jit(lambda v: v + 1.0, donate_argnums=0)
  x = [jnp.zeros((mib * 2 ** 20 // 4,), jnp.float32)]

  def step():  # each call consumes the buffer the last one returned
    x[0] = f(x[0])
    return x[0]

  return 2 * x[0].nbytes / median_time(step, reps=reps, warmup=2)
