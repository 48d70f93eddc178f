"""The update half of the training step: rollouts in, optimised params out (`update`).

`update` is a short composition of the phases below: mix replay -> order rows -> split
micro-batches -> pi_old / reference log-probs -> optimise (epochs x minibatches, the
accumulation scan, the finite-gradient guard) -> metrics and the ledger. Its static shape
(`width`, `rows`, `parts`) is planned on the host (rlx.update_plan). The names are importable
from rlx.train too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rlx import sharding as shd
from rlx.rl import replay as replay_lib
from rlx.rl.loss import importance_weights, policy_loss
from rlx.step_state import (Batch, Rollouts, StepConfig, TrainState, completion_logprobs,
                            model_params)
from rlx.update_plan import row_order


def _unminibatch(x):
  """Inverse of `_minibatches` for one array: [m, B/m, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _minibatches(tree, m: int):
  """[B, ...] -> [m, B/m, ...] with strided rows (each minibatch draws from every shard)."""
  def split(x):
    b = x.shape[0]
    return jnp.swapaxes(x.reshape(b // m, m, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, tree)


def _with_replay(state: TrainState, fresh: Batch, cfg: StepConfig):
  """Mixes replayed rows into the batch and writes the fresh signal-carrying rows to the ring.

  Returns (state, training batch, replayed-row flags bool[B+R]).
  """
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)
  idx, used, ring = replay_lib.sample(state.replay, cfg.replay, key, state.policy_version)
  rep = replay_lib.gather(ring, idx, used)
  ring = replay_lib.add(ring, fresh, fresh.advantages != 0, state.policy_version, state.step)
  rep["truncated"] = jnp.zeros(idx.shape, bool)
  fields = {k: jnp.concatenate([getattr(fresh, k), rep[k].astype(getattr(fresh, k).dtype)])
            for k in rep}
  batch = Batch(**fields)
  replayed = jnp.concatenate([jnp.zeros(fresh.lengths.shape, bool), used])
  return state.replace(replay=ring), batch, replayed


def _trim(batch: Batch, width: int) -> Batch:
  return batch.replace(completions=batch.completions[:, :width],
                       behaviour_logp=batch.behaviour_logp[:, :width])


# ----------------------------------------------------------------------------- the update
#
# `update` is a composition of phases, each a module-level function:
#   mix_replay -> order_rows -> split_micro_batches -> proximal_and_reference_logp ->
#   optimise (epochs x minibatches; gradient accumulation over micro-batches; finite guard)
#   -> update_metrics


class Ordered(NamedTuple):
  """The rows the update computes on (`order_rows`).

  batch: those rows (ordered; the whole batch when nothing is reordered), at the update's
  width; full: the whole batch at that width; order: batch row k is full row order[k] (None:
  the same rows); full_t: completion columns before any cut (the loss's length normaliser);
  norms: the loss's row / token normalisers (the whole batch's); left_out: signal rows not
  computed on (must be 0); drop: rows were left out.
  """

  batch: Batch
  full: Batch
  order: jax.Array | None
  full_t: int
  norms: dict
  left_out: jax.Array | None
  drop: bool


def mix_replay(state: TrainState, fresh: Batch, cfg: StepConfig, mesh: Mesh | None):
  """Phase 1: the fresh rows plus the replayed ones (state's ring updated). Returns (state,
  batch, replayed bool[B+R] or None)."""
  if cfg.replay is None:
    return state, fresh, None
  state, batch, replayed = _with_replay(state, fresh, cfg)
  if mesh is not None:
    batch, replayed = shd.constrain_batch((batch, replayed), mesh)
  return state, batch, replayed


def order_rows(batch: Batch, n_fresh: int, cfg: StepConfig, mesh: Mesh | None,
               width: int | None, rows: int | None, parts: tuple[int, ...] | None) -> Ordered:
  """Phase 2: cut the batch to `width` columns; with `rows`, keep the rows `row_order` picks;
  with `parts`, sort them longest first (each micro-batch's width was sized for its rows)."""
  full_t = batch.completions.shape[1]
  if width is not None and width < full_t:
    batch = _trim(batch, width)
  all_rows = batch.lengths.shape[0]
  t = batch.completions.shape[1]
  m = cfg.num_minibatches
  drop = rows is not None and rows < all_rows
  if drop and (m != 1 or cfg.loss.kl_coef > 0):
    raise ValueError(f"update rows={rows} < {all_rows} needs one minibatch and no KL term.")
  if parts is not None and (m != 1 or (rows or all_rows) % len(parts) or max(parts) > t):
    raise ValueError(f"update parts={parts} needs one minibatch, rows={rows or all_rows} "
                     f"divisible by {len(parts)} and widths <= {t}.")
  # Rows the loss averages over: the sampled ones (adaptive budgets leave some unsampled:
  # no tokens, advantage 0; they must not dilute seq_mean_* aggregations).
  unsampled = cfg.batch_size - cfg.sampled_rows
  norms = dict(norm_rows=all_rows - unsampled) if unsampled else {}
  if not drop and parts is None:
    return Ordered(batch, batch, None, full_t, norms, None, False)
  is_rep = jnp.arange(all_rows) >= n_fresh
  if drop:
    zero = (batch.advantages == 0) & ~is_rep
    order = row_order(is_rep, zero, batch.lengths, full_t, rows, xp=jnp)
  else:
    order = jnp.arange(all_rows)
  if parts is not None:  # longest first: the host sized each micro-batch's width for it
    order = order[jnp.argsort(-jnp.take(batch.lengths, order), stable=True)]
  signal = batch.advantages != 0
  left_out = signal.sum() - jnp.take(signal, order).sum()
  # (from the lengths: rows left out may be longer than the columns computed on)
  norms = dict(norm_rows=all_rows - unsampled,
               norm_tokens=batch.lengths.astype(jnp.float32).sum())
  ordered = jax.tree.map(lambda x: jnp.take(x, order, axis=0), batch)
  if mesh is not None:
    ordered = shd.constrain_batch(ordered, mesh)
  return Ordered(ordered, batch, order, full_t, norms, left_out, drop)


def split_micro_batches(batch: Batch, widths: tuple[int, ...], mesh: Mesh | None,
                        m: int) -> tuple[Batch, ...]:
  """Phase 3: equal row slices, slice i cut to widths[i] columns, each split into the
  optimizer's m minibatches ([m, rows/m, ...], strided)."""
  r = batch.lengths.shape[0] // len(widths)
  if len(widths) == 1:
    part_batches = [batch]
  else:
    part_batches = [_trim(jax.tree.map(lambda x, i=i: x[i * r:(i + 1) * r], batch), w)
                    for i, w in enumerate(widths)]
    if mesh is not None:
      part_batches = [shd.constrain_batch(b, mesh) for b in part_batches]
  return tuple(_minibatches(b, m) for b in part_batches)


@dataclasses.dataclass(frozen=True)
class _Policy:
  """The trainable model's completion log-probs (LoRA: adapters on the unmerged path)."""

  graphdef: Any
  cfg: StepConfig
  base: Any

  def model_logp(self, params, *seqs):  # params: a whole model's weights
    return completion_logprobs(self.graphdef, params, *seqs,
                               temperature=self.cfg.sampling.policy_temperature,
                               chunk=self.cfg.logprob_chunk, remat=self.cfg.remat)

  def __call__(self, params, *seqs):  # params: the trainable tree
    return self.model_logp(model_params(params, self.base, self.cfg), *seqs)

  def forward(self, params, seqs, fn=None):
    """No-grad log-probs over [m, ...] minibatches, one minibatch live at a time."""
    fn = fn or self
    return jax.lax.map(lambda x: fn(params, *x)[0], seqs)


def _seqs(b: Batch):
  return (b.prompts, b.prompt_lens, b.completions, b.lengths)


def proximal_and_reference_logp(state: TrainState, mb_parts, policy: _Policy,
                                cfg: StepConfig):
  """Phase 4: pi_old per micro-batch (the policy before this update; with fuse_pi_old the
  first minibatch's gradient pass yields it, so only the others need a forward) and the KL
  reference's log-probs (None without a KL term; LoRA: the base with the adapters off)."""
  m = cfg.num_minibatches

  def first_pi_old(b):
    if not cfg.fuse_pi_old:
      return policy.forward(state.params, _seqs(b))
    first = jnp.zeros((1, *b.behaviour_logp.shape[1:]), jnp.float32)
    if m == 1:
      return first
    rest = jax.tree.map(lambda x: x[1:], _seqs(b))
    return jnp.concatenate([first, policy.forward(state.params, rest)])

  pi_old = jax.lax.stop_gradient(tuple(first_pi_old(b) for b in mb_parts))
  ref_logp = None
  if cfg.loss.kl_coef > 0:
    ref_logp = tuple(policy.forward(state.base, _seqs(b), policy.model_logp)
                     if cfg.lora is not None else policy.forward(state.ref_params, _seqs(b))
                     for b in mb_parts)
  return pi_old, ref_logp


@dataclasses.dataclass(frozen=True)
class _Loss:
  """One micro-batch's share of the loss (the whole batch's normalisers) and its gradient."""

  policy: _Policy
  cfg: StepConfig
  full_t: int
  norms: tuple[tuple[str, Any], ...]

  def __call__(self, params, b, ref, old_in, is_first):
    logp, mask = self.policy(params, *_seqs(b))
    old = jnp.where(is_first, jax.lax.stop_gradient(logp), old_in)
    anchor = b.behaviour_logp if self.cfg.loss.anchor == "behaviour" else old
    loss, metrics = policy_loss(logp, anchor, b.behaviour_logp, b.advantages, mask,
                                self.cfg.loss, ref, norm_len=self.full_t, **dict(self.norms))
    return loss, (metrics, old, mask.astype(jnp.float32).sum())

  def grad(self, *args):
    return jax.value_and_grad(self.__call__, has_aux=True)(*args)


def _accumulate_equal_parts(loss: _Loss, params, bs, refs, olds_in, is_first):
  """Equal-shape micro-batches as one scan: part k+1 reuses part k's buffers. (A Python loop
  of value-and-grads, even with an optimization barrier between the parts, kept every part's
  activations live in XLA's buffer assignment: measured, tests/test_memory.py.)"""
  def body(acc, xs):
    b, ref, old_in = xs
    (l, (metrics, old, count)), g = loss.grad(params, b, ref, old_in, is_first)
    return (g if acc is None else jax.tree.map(jnp.add, acc, g)), (l, metrics, old, count)
  if len(bs) == 1:
    g, (l, metrics, old, count) = body(None, (bs[0], refs and refs[0], olds_in[0]))
    return g, l[None], {k: v[None] for k, v in metrics.items()}, [old], count[None]
  stack = lambda xs: None if xs is None else jax.tree.map(lambda *x: jnp.stack(x), *xs)
  g, (losses, metrics, olds, counts) = jax.lax.scan(
      body, jax.tree.map(jnp.zeros_like, params), (stack(bs), stack(refs), stack(olds_in)))
  return g, losses, metrics, [olds[k] for k in range(len(bs))], counts


def loss_and_grads(loss: _Loss, params, bs, refs, olds_in, is_first):
  """The batch's loss and gradient, micro-batch by micro-batch (gradient accumulation).

  Each part's loss already carries the whole batch's normalisers, so the summed gradient is
  the batch's. Consecutive parts of one width run as a scan (`_accumulate_equal_parts`), so
  at most one part per distinct width is live: with `update_micro_rows` at equal widths, one.
  """
  if len(bs) == 1:
    (l, (metrics, old, _)), grads = loss.grad(
        params, bs[0], None if refs is None else refs[0], olds_in[0], is_first)
    return l, metrics, (old,), grads
  runs, start = [], 0
  for k in range(1, len(bs) + 1):
    if k == len(bs) or bs[k].completions.shape != bs[start].completions.shape:
      runs.append(list(range(start, k)))
      start = k
  grads, losses, mets, olds, counts = None, [], [], [], []
  for run in runs:
    pick = lambda xs, run=run: None if xs is None else [xs[k] for k in run]
    g, l, metrics, old, count = _accumulate_equal_parts(loss, params, pick(bs), pick(refs),
                                                        pick(olds_in), is_first)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    losses.append(l)
    mets.append(metrics)
    olds += old
    counts.append(count)
  losses, counts = jnp.concatenate(losses), jnp.concatenate(counts)
  n = counts.sum()  # token means over all parts, weighted by their tokens
  metrics = {k: (jnp.concatenate([m[k] for m in mets]) * counts).sum() / jnp.maximum(n, 1.0)
             for k in mets[0]}
  metrics["loss/policy"] = losses.sum()
  return losses.sum(), metrics, tuple(olds), grads


def guarded_apply(tx, grads, loss, params, opt_state):
  """One optimizer update, skipped (params and state unchanged) when the loss or the
  gradient's global norm is non-finite. Returns (params, opt_state, grad_norm, finite).

  The norm is one fused reduction (non-finite iff an entry is, or the squares overflow f32);
  the optimizer runs under lax.cond, so a skipped update computes nothing and a kept one
  needs no select over params and optimizer state (at 100M on CPU, per-leaf isfinite on
  grads and new params plus those selects cost ~0.3 s per update; traced). With finite
  gradients, clip + AdamW give finite results. The host loop stops after K skips in a row.
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def apply(params, opt_state):
    updates, new_opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state
  params, opt_state = jax.lax.cond(finite, apply, lambda p, s: (p, s), params, opt_state)
  return params, opt_state, grad_norm, finite


def optimise(state: TrainState, mb_parts, pi_old, ref_logp, loss: _Loss, cfg: StepConfig, tx):
  """Phase 5: num_updates epochs x num_minibatches guarded optimizer steps (one scan each).
  Returns (params, opt_state, pi_old per micro-batch as computed, mean metrics)."""
  m = cfg.num_minibatches

  def minibatch_step(carry, xs):
    params, opt_state, store, epoch = carry
    j, b, ref = xs
    is_first = (epoch == 0) & (j == 0) & cfg.fuse_pi_old
    l, metrics, old, grads = loss_and_grads(loss, params, b, ref,
                                            tuple(s[j] for s in store), is_first)
    store = tuple(s.at[j].set(o) for s, o in zip(store, old))
    params, opt_state, grad_norm, finite = guarded_apply(tx, grads, l, params, opt_state)
    metrics["grad_norm"] = jnp.where(finite, grad_norm, 0.0)
    metrics["guard/skipped_updates"] = (~finite).astype(jnp.float32)
    return (params, opt_state, store, epoch), metrics

  def epoch_step(carry, epoch):
    params, opt_state, store = carry
    (params, opt_state, store, _), metrics = jax.lax.scan(
        minibatch_step, (params, opt_state, store, epoch), (jnp.arange(m), mb_parts, ref_logp))
    return (params, opt_state, store), metrics

  (params, opt_state, pi_old), metrics = jax.lax.scan(
      epoch_step, (state.params, state.opt_state, pi_old), jnp.arange(cfg.num_updates))
  skipped = metrics.pop("guard/skipped_updates").sum()
  metrics = jax.tree.map(jnp.mean, metrics)
  metrics["guard/skipped_updates"] = skipped
  return params, opt_state, pi_old, metrics


def update_metrics(metrics: dict, state: TrainState, ro: Rollouts, o: Ordered,
                   widths: tuple[int, ...], pi_old, replayed, cfg: StepConfig) -> dict:
  """Phase 6: the update's guards and shape, then the step's ledger over the whole batch."""
  batch = o.batch
  t = batch.completions.shape[1]
  r = batch.lengths.shape[0] // len(widths)
  old_logp = jnp.concatenate([jnp.pad(_unminibatch(p), ((0, 0), (0, t - w)))
                              for p, w in zip(pi_old, widths)])
  mask = jnp.arange(t)[None, :] < batch.lengths[:, None]
  # Tokens past a row's computed width would be silently dropped: must be 0 (the host sizes
  # the widths from the rows' lengths); the trainer checks it.
  row_width = jnp.repeat(jnp.asarray(widths, jnp.int32), r)
  metrics["guard/rows_over_width"] = (batch.lengths > row_width).sum().astype(jnp.float32)
  computed = sum(r * (batch.prompts.shape[1] + w) for w in widths)
  counted = (batch.advantages != 0) if o.drop else jnp.ones(batch.lengths.shape, bool)
  real = jnp.where(counted, batch.prompt_lens + batch.lengths, 0).astype(jnp.float32).sum()
  rows_c = batch.lengths.shape[0]
  if o.order is not None:  # back to the whole batch's rows; rows left out have no pi_old
    full_mask = jnp.arange(t)[None, :] < o.full.lengths[:, None]
    old_logp = jnp.zeros(full_mask.shape, jnp.float32).at[o.order].set(old_logp)
    mask = jnp.zeros(full_mask.shape, bool).at[o.order].set(mask)
    batch = o.full
  metrics["ledger/update_width"] = jnp.asarray(t, jnp.float32)
  metrics["ledger/update_rows"] = jnp.asarray(rows_c, jnp.float32)
  metrics["ledger/update_parts"] = jnp.asarray(len(widths), jnp.float32)
  # Must be 0 (the host sizes `rows` from the signal count); the trainer checks it.
  metrics["guard/signal_rows_left_out"] = (o.left_out if o.order is not None else
                                           jnp.zeros((), jnp.int32)).astype(jnp.float32)
  # Token slots the update computed on that were padding (cut columns, left-out rows and the
  # columns past each micro-batch's width are not computed, so they do not count).
  metrics["ledger/update_pad_frac"] = 1.0 - jnp.minimum(real, computed) / computed
  metrics.update(ledger(ro.batch, ro.stats, batch, mask, old_logp, replayed,
                        state.policy_version, cfg, ro.valid))
  return metrics


def update(state: TrainState, ro: Rollouts, *, graphdef, cfg: StepConfig, tx,
           mesh: Mesh | None = None, width: int | None = None,
           rows: int | None = None, parts: tuple[int, ...] | None = None
           ) -> tuple[TrainState, dict]:
  """num_updates passes of num_minibatches optimizer steps on the (fresh + replayed) batch.

  width / rows / parts: the update's static shape (`rlx.update_plan.plan`; None: all of it).
  width: completion columns computed on (columns past every row's length are padding:
    cutting them changes no result; the loss normaliser stays max_new_tokens).
  rows: with one minibatch and no KL term a zero-advantage row adds exactly nothing to the
    gradient (every per-token term is w * A * ratio), so the rows with signal (replayed rows
    first) are moved to the front and only the first `rows` are computed on; the loss keeps
    the whole batch's row and token counts as its normalisers, so the result is unchanged.
  parts: length-sorted micro-batches (one minibatch only): rows sorted longest first, split
    into len(parts) equal micro-batches, micro-batch i cut to parts[i] columns; their summed
    gradient is the batch's (one optimizer step) while short rows stop paying for the
    longest row's width.
  pi_old (the proximal policy) is the current policy's log-prob before any update: the first
  minibatch's gradient pass yields it (cfg.fuse_pi_old); later passes reuse it.
  """
  parts = tuple(parts) if parts is not None and len(parts) > 1 else None
  state, batch, replayed = mix_replay(state, ro.batch, cfg, mesh)
  o = order_rows(batch, ro.batch.lengths.shape[0], cfg, mesh, width, rows, parts)
  widths = parts or (o.batch.completions.shape[1],)
  mb_parts = split_micro_batches(o.batch, widths, mesh, cfg.num_minibatches)
  policy = _Policy(graphdef, cfg, state.base)
  pi_old, ref_logp = proximal_and_reference_logp(state, mb_parts, policy, cfg)
  loss = _Loss(policy, cfg, o.full_t, tuple(sorted(o.norms.items())))
  params, opt_state, pi_old, metrics = optimise(state, mb_parts, pi_old, ref_logp, loss, cfg,
                                                tx)
  metrics = update_metrics(metrics, state, ro, o, widths, pi_old, replayed, cfg)
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                            policy_version=state.policy_version + cfg.num_updates *
                            cfg.num_minibatches)
  return new_state, metrics


def ledger(fresh: Batch, stats: dict, batch: Batch, mask, old_logp, replayed, policy_version,
           cfg: StepConfig, valid=None) -> dict:
  """Where this step's compute went, plus reward and replay statistics (device scalars).

  fresh: this step's rollouts (after dynamic filtering); batch: what was trained on (fresh
  plus replayed rows); mask / old_logp are over `batch`; valid: fresh rows sampled (None:
  all; rlx.rl.adaptive). Every generated token is counted once:
    tokens_generated = tokens_trained - tokens_replayed (fresh rows with signal)
                       + tokens_zero_adv (fresh rows with advantage 0)
                       + tokens_discarded (dynamic filtering)
  """
  g = cfg.group_size
  b = fresh.lengths.shape[0]
  lengths = fresh.lengths.astype(jnp.float32)
  v = jnp.ones((b,), bool) if valid is None else valid
  vf = v.astype(jnp.float32)
  n_rows = vf.sum()
  groups = fresh.rewards.reshape(-1, g)
  # Zero-signal groups by their advantages (what the loss and the replay ring see), not by the
  # task rewards: shaped rewards can differ where the verifier's do not, and the other way round.
  zero_var = jnp.all(fresh.advantages.reshape(-1, g) == 0, axis=1)
  signal = fresh.advantages != 0
  # batch's first b rows are the fresh ones (at the update's width).
  drift = jnp.where(mask[:b], jnp.abs(old_logp[:b] - batch.behaviour_logp[:b]), 0.0)
  out = {
      "reward/mean": jnp.where(v, fresh.rewards, 0.0).sum() / n_rows,
      "reward/pass_at_group": jnp.mean(jnp.any((groups > 0) & v.reshape(-1, g), axis=1)),
      "ledger/tokens_trained": jnp.where(signal, lengths, 0.0).sum(),
      # Every fresh row without signal: zero-variance groups, and rows whose advantage is 0
      # in a group with signal (a filtered overlong row, a reward equal to the group mean).
      "ledger/tokens_zero_adv": jnp.where(signal, 0.0, lengths).sum(),
      "ledger/zero_adv_group_frac": zero_var.astype(jnp.float32).mean(),
      "ledger/truncated_frac": (fresh.truncated & v).astype(jnp.float32).sum() / n_rows,
      "ledger/response_len_mean": lengths.sum() / n_rows,
      "ledger/sequences": n_rows,
      "ledger/logp_drift_max": drift.max(),
      # Optimizer updates between the policy that generated each fresh row and the one
      # trained (0 in the sync step; up to pipeline.max_staleness x updates per step in
      # overlap mode, rlx.pipeline).
      "ledger/staleness_mean": ((policy_version - fresh.policy_version) * vf).sum() / n_rows,
      "ledger/staleness_max": (policy_version - fresh.policy_version).max().astype(
          jnp.float32),
      **stats,
  }
  out["ledger/tokens_wasted"] = out["ledger/tokens_zero_adv"] + out["ledger/tokens_discarded"]
  level_G = fresh.difficulty.reshape(-1, g)[:, 0]
  for level in cfg.ledger_levels:
    out[f"ledger/mixed_groups_d{level}"] = jnp.sum(
        (level_G == level) & ~zero_var).astype(jnp.float32)
  if cfg.staleness_hist:  # fresh rows per staleness bin (rlx.pipeline: up to max_staleness)
    hist = replay_lib.staleness_histogram(policy_version - fresh.policy_version,
                                          jnp.ones(fresh.lengths.shape, bool))
    for i, lo in enumerate(replay_lib.STALENESS_BINS):
      out[f"ledger/staleness_hist_{lo}"] = hist[i].astype(jnp.float32)
  if replayed is not None:
    rep_len = jnp.where(replayed, batch.lengths, 0).astype(jnp.float32)
    rep_tokens = rep_len.sum()
    rep_mask = mask & replayed[:, None]
    w_raw = jnp.exp(old_logp - batch.behaviour_logp)
    staleness = policy_version - batch.policy_version
    hist = replay_lib.staleness_histogram(staleness, replayed)
    out.update({
        "ledger/tokens_replayed": rep_tokens,
        "replay/rows": replayed.astype(jnp.float32).sum(),
        "replay/reuse_ratio": rep_tokens / jnp.maximum(
            rep_tokens + out["ledger/tokens_trained"], 1.0),
        "replay/ess": replay_lib.effective_sample_size(
            importance_weights(old_logp, batch.behaviour_logp, cfg.loss.is_cap,
                               cfg.loss.is_mode)[0], rep_mask),
        "replay/capped_frac": (jnp.where(rep_mask, w_raw > cfg.loss.is_cap, False).sum() /
                               jnp.maximum(rep_mask.sum(), 1)),
        "replay/staleness_mean": (jnp.where(replayed, staleness, 0).sum() /
                                  jnp.maximum(replayed.sum(), 1)),
    })
    for i, lo in enumerate(replay_lib.STALENESS_BINS):
      out[f"replay/staleness_hist_{lo}"] = hist[i].astype(jnp.float32)
    out["ledger/tokens_trained"] = out["ledger/tokens_trained"] + rep_tokens
  else:
    out["ledger/tokens_replayed"] = jnp.zeros((), jnp.float32)
  return out
