"""The update's static shape, planned on the host from a step's rollouts.

`train.update` compiles one program per shape: the completion columns it computes on
(`width`), the rows (`rows`: with one minibatch and no KL term, rows without signal can be
left out) and length-sorted micro-batches (`parts`, each at its own width). The host reads the
rows' lengths and signal flags (so planning waits for the rollout) and picks the shape from a
small set, so that few programs compile. `row_order` is the one rule, shared with the
update, for which rows are kept.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlx import distributed


def row_order(is_replayed, zero_adv, lengths, max_len: int, rows: int, xp=np):
  """The rows an update that leaves rows out computes on, in order: replayed rows, then fresh
  rows with signal (as they come), then the shortest zero-advantage rows; the first `rows`.
  Runs on the device (xp=jax.numpy, `train.order_rows`) and on the host (numpy, `plan`)."""
  key = (xp.where(is_replayed, 0, xp.where(zero_adv, 2, 1)) * (max_len + 1) +
         xp.where(zero_adv, lengths, 0))
  return xp.argsort(key, stable=True)[:rows]


def update_width(max_len: int, max_new_tokens: int, buckets: int) -> int:
  """The completion width the update compiles for: the smallest of `buckets` widths
  (multiples of 8 spread up to max_new_tokens) that holds `max_len` tokens."""
  if buckets <= 1:
    return max_new_tokens
  for k in range(1, buckets + 1):
    w = -(-max_new_tokens * k // buckets)  # ceil(T k / n) ...
    w = min(max_new_tokens, -(-w // 8) * 8)  # ... rounded up to a multiple of 8
    if w >= max_len:
      return w
  return max_new_tokens


def update_rows(signal_rows: int, total_rows: int, multiple: int = 1) -> int:
  """Rows the update computes on: half the batch when at most half carries signal (and half
  splits over `multiple` devices), else all of it. Two compiled sizes at most."""
  half = total_rows // 2
  if total_rows % 2 == 0 and half % multiple == 0 and signal_rows <= half:
    return half
  return total_rows


def micro_parts(rows: int, micro_rows: int, num_batch_devices: int = 1, groups: int = 1) -> int:
  """`update_micro_rows`' part count: the fewest equal parts of <= micro_rows rows that split
  over the batch devices, a multiple of `groups` (update_parts) where one is (1: none does)."""
  fits = [k for k in range(-(-rows // micro_rows), rows + 1)
          if rows % (k * num_batch_devices) == 0]
  return next((k for k in fits if k % max(1, groups) == 0), fits[0] if fits else 1)


def part_widths(lengths_desc, parts: int, max_new_tokens: int, buckets: int) -> tuple:
  """Completion widths of `parts` equal micro-batches of rows sorted longest first."""
  r = len(lengths_desc) // parts
  return tuple(update_width(int(lengths_desc[i * r]), max_new_tokens, buckets)
               for i in range(parts))


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """The update's static shape (None: not cut)."""

  width: int
  rows: int | None = None
  parts: tuple[int, ...] | None = None

  def kwargs(self) -> dict:
    """As `train.update` and `StepFns.update` take it (keys only for what is set)."""
    out = {"width": self.width}
    if self.rows is not None:
      out["rows"] = self.rows
    if self.parts is not None:
      out["parts"] = self.parts
    return out


def plan(ro, cfg, num_batch_devices: int = 1, *, scored: bool = True) -> UpdatePlan:
  """The update's shape for these rollouts (`train.Rollouts`) under `cfg` (`StepConfig`).

  scored=False (host rewards: the advantages do not exist yet): the width, and with
  `update_micro_rows` the micro-batches (from the lengths alone; no rows are left out).
  """
  b = ro.batch
  if "ledger/longest_row" in ro.stats:  # from `score`: replicated scalars
    longest = int(distributed.to_host(ro.stats["ledger/longest_row"]))
    signal = int(distributed.to_host(ro.stats["ledger/signal_rows"]))
  else:
    longest = int(distributed.to_host(b.lengths).max())
    signal = int((distributed.to_host(b.advantages) != 0).sum())
  fresh_rows = total = b.lengths.shape[0]
  replay_rows = ring_max = 0
  if cfg.replay is not None:  # replayed rows: at most the ring's longest (unknown: any width)
    ring_max = (int(distributed.to_host(ro.stats["replay/ring_max_len"]))
                if "replay/ring_max_len" in ro.stats else cfg.sampling.max_new_tokens)
    longest = max(longest, ring_max)
    replay_rows = cfg.replay.num_samples
    signal += replay_rows
    total += replay_rows
  t = cfg.sampling.max_new_tokens
  width = update_width(longest, t, cfg.update_buckets)
  if not scored and cfg.update_micro_rows <= 0:
    return UpdatePlan(width)
  one_mb = cfg.num_minibatches == 1
  rows = None
  if scored and cfg.drop_zero_adv_rows and one_mb and cfg.loss.kl_coef == 0:
    rows = update_rows(signal, total, num_batch_devices)
  n = cfg.update_parts
  kept = total if rows is None else rows
  micro = cfg.update_micro_rows > 0 and one_mb and kept > cfg.update_micro_rows
  if micro:
    n = micro_parts(kept, cfg.update_micro_rows, num_batch_devices, cfg.update_parts)
  split = n > 1 and one_mb and kept % (n * num_batch_devices) == 0 and (
      cfg.update_buckets > 1 or micro)
  parts = None
  if kept < total or split:
    # The device's rows: fresh rows, then the replayed ones (their lengths unknown here:
    # bounded by the ring's longest row).
    lengths = np.concatenate([distributed.to_host(b.lengths).astype(int),
                              np.full(replay_rows, ring_max, int)])
    if kept < total:  # as `update` selects them
      is_rep = np.arange(total) >= fresh_rows
      sig = np.concatenate([distributed.to_host(b.advantages) != 0,
                            np.ones(replay_rows, bool)])
      order = row_order(is_rep, ~sig & ~is_rep, lengths, t, kept)
    else:
      order = np.arange(total)
    chosen = np.sort(lengths[order])
    # Rows left out need no columns: the width of the rows computed on.
    width = update_width(int(chosen[-1]), t, cfg.update_buckets)
    if split:
      # Micro-batches take their widths from the update_parts length groups they fall in
      # (each group: n / g parts at its longest row's width), so the compiled width tuples
      # stay those of update_parts alone: per-part widths would give one program per
      # non-increasing n-tuple of buckets (measured: a recompile most steps at n = 8).
      g = cfg.update_parts if micro and n % cfg.update_parts == 0 else (1 if micro else n)
      widths = tuple(w for w in part_widths(chosen[::-1], g, t, cfg.update_buckets)
                     for _ in range(n // g))
      # Equal widths: one micro-batch does the same work, unless accumulation was asked for.
      if len(set(widths)) > 1 or micro:
        parts = widths
  return UpdatePlan(width, rows, parts)
