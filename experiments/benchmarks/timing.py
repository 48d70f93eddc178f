"""Wall-clock timing that the benchmark scripts share: each call is waited on
(jax.block_until_ready), so a time covers the device work and not just its dispatch, and a
result is the median (a typical run) or the best (a ceiling) of several runs after warm-up
calls, which pay for compilation. Only jax and the standard library, so a script run against
an older checkout of rlx can import it too."""

import statistics
import time

import jax


def seconds(fn, *args) -> float:
  """Wall seconds of one call fn(*args), waited on."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def _runs(fn, args, reps: int, inner: int, warmup: int) -> list[float]:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(inner)])
    times.append((time.perf_counter() - t0) / inner)
  return times


def median_time(fn, *args, reps: int, inner: int = 1, warmup: int = 1) -> float:
  """Median over `reps` runs of seconds per call, after `warmup` calls. A run is `inner`
  back-to-back calls waited on once, divided by `inner`: the per-call dispatch and host sync
  are spread over the calls, as inside one program."""
  return statistics.median(_runs(fn, args, reps, inner, warmup))


def best_time(fn, *args, reps: int, inner: int = 1, warmup: int = 1) -> float:
  """The fastest of `reps` runs (as median_time's): the estimate of a ceiling, since load on a
  shared machine only ever slows a run down."""
  return min(_runs(fn, args, reps, inner, warmup))


def median(xs) -> float:
  """The median of `xs`, NaN when there is none (a table cell, not an error)."""
  xs = list(xs)
  return statistics.median(xs) if xs else float("nan")
