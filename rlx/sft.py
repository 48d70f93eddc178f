"""Supervised warm start: teach the base model partial skill so RL starts where pass rates are
uncertain (the default experiment runs this once and caches the result in the workdir)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlx.specs import SFTSpec
from rlx.data.tokenizer import Tokenizer
from rlx.model import transformer


@dataclasses.dataclass(frozen=True)
class SFTData:
  tokens: np.ndarray  # i32[N, L] [BOS] prompt answer [EOS], right-padded
  loss_mask: np.ndarray  # bool[N, L] True on tokens to predict (answer + EOS)
  lengths: np.ndarray  # i32[N]
  difficulty: np.ndarray  # i32[N]


def tokenize_sft(examples: Sequence[dict], tokenizer: Tokenizer, max_len: int,
                 answer_key: str = "answer") -> SFTData:
  """Tokenizes (prompt, examples[answer_key]) pairs; answer_key="teacher_answer" trains on the
  task's (possibly imperfect) demonstrations."""
  n = len(examples)
  tokens = np.full((n, max_len), tokenizer.pad_id, np.int32)
  loss_mask = np.zeros((n, max_len), bool)
  lengths = np.zeros((n,), np.int32)
  for i, ex in enumerate(examples):
    p = tokenizer.encode(ex["prompt"], add_special_tokens=True)
    a = tokenizer.encode(ex.get(answer_key, ex["answer"])) + [tokenizer.eos_id]
    seq = p + a
    if len(seq) > max_len:
      raise ValueError(f"SFT example {i} ({ex['prompt']!r}) has "
                       f"{len(seq)} tokens; expected at most {max_len}.")
    tokens[i, :len(seq)] = seq
    loss_mask[i, len(p):len(seq)] = True
    lengths[i] = len(seq)
  difficulty = np.asarray([int(ex.get("difficulty", 0)) for ex in examples], np.int32)
  return SFTData(tokens, loss_mask, lengths, difficulty)


def sft_loss(graphdef, params, tokens_BxL, loss_mask_BxL, lengths_B):
  """Mean next-token cross-entropy over answer tokens."""
  b, l = tokens_BxL.shape
  pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  valid = pos < lengths_B[:, None]
  logits, _ = transformer.apply(graphdef, params, tokens_BxL, pos, valid)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, tokens_BxL[:, 1:, None], axis=-1)[..., 0]
  m = loss_mask_BxL[:, 1:].astype(jnp.float32)
  return (nll * m).sum() / jnp.maximum(m.sum(), 1.0)


def make_sft_step(graphdef, tx):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, loss_mask, lengths):
    loss, grads = jax.value_and_grad(functools.partial(sft_loss, graphdef))(
        params, tokens, loss_mask, lengths)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def level_sampler(data: SFTData, weights: dict[int, float], seed: int, *,
                  by_level: bool = False):
  """Draws batches of example indices: level drawn by `weights`, example uniform within the
  level; by_level=True draws one level per batch (whose examples then share a length)."""
  rng = np.random.default_rng(seed)
  levels = sorted(weights)
  by_level_idx = {lv: np.flatnonzero(data.difficulty == lv) for lv in levels}
  empty = [lv for lv in levels if by_level_idx[lv].size == 0]
  if empty:
    raise ValueError(f"SFT level weights name levels {empty} with no training examples.")
  probs = np.asarray([weights[lv] for lv in levels], np.float64)
  probs = probs / probs.sum()

  def draw(batch_size: int) -> np.ndarray:
    if by_level:
      return rng.choice(by_level_idx[levels[rng.choice(len(levels), p=probs)]], size=batch_size)
    lv = rng.choice(len(levels), size=batch_size, p=probs)
    return np.asarray([rng.choice(by_level_idx[levels[j]]) for j in lv], np.int64)
  return draw


def batch_width(lengths: np.ndarray, max_len: int, multiple: int = 32) -> int:
  """Columns a batch needs: its longest sequence rounded up to `multiple` (a few shapes to
  compile), at most max_len. The padding cut off changes no loss: the model is causal and
  the loss masks padding."""
  return min(max_len, -(-int(lengths.max()) // multiple) * multiple)


def train(sft: SFTSpec, seed: int, model_cfg, tokenizer, train_examples, *,
          show_progress: bool = True, check_stop=None):
  """Runs the supervised warm start `sft` (config.sft); returns host params.

  check_stop: called before each step (it raises to abandon the warm start, e.g. on SIGTERM).
  """
  from rlx.progress import Progress  # pylint: disable=g-import-not-at-top
  c = sft
  weights = {k: v for k, v in c.level_weights}
  data = tokenize_sft(train_examples, tokenizer, c.max_len, answer_key="teacher_answer")
  graphdef, params = transformer.init_params(model_cfg, seed)
  sched = optax.warmup_cosine_decay_schedule(0.0, c.lr, max(1, c.warmup_steps),
                                             max(c.steps, c.warmup_steps + 1), c.lr * 0.05)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
  opt_state = tx.init(params)
  step = make_sft_step(graphdef, tx)
  draw = level_sampler(data, weights, seed, by_level=c.batch_by_level)
  bar = Progress(c.steps, desc="warm start", unit="step", disable=not show_progress)
  # Shown, a step counts when its loss is ready, one step behind the dispatch (which runs
  # ahead): counting dispatched steps made the rate jump at each sync (the loss every 100).
  pending = None
  for i in range(c.steps):
    if check_stop is not None:
      check_stop()
    idx = draw(c.batch_size)
    width = batch_width(data.lengths[idx], c.max_len)
    params, opt_state, loss = step(params, opt_state, data.tokens[idx, :width],
                                   data.loss_mask[idx, :width], data.lengths[idx])
    if show_progress:
      if pending is not None:
        jax.block_until_ready(pending)
        bar.update(1)
      pending = loss
    if (i + 1) % 100 == 0 or i + 1 == c.steps:
      bar.set_postfix(loss=f"{float(loss):.4f}")
  if pending is not None:
    jax.block_until_ready(pending)
    bar.update(1)
  bar.close()
  return jax.device_get(params)
