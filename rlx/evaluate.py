"""Held-out evaluation: greedy decoding over the eval pool, accuracy and completion lengths
per difficulty level."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlx import distributed
from rlx import sharding as shd
from rlx.data.tasks import PromptPool, Verifier
from rlx.sampler import dense
from rlx.sampler import paged as paged_lib
from rlx.sampler.sampling import SamplingParams

SAMPLER_IMPLS = ("dense", "paged")


def decode(graphdef, params, prompts_BxP, prompt_lens_B, keys_B, sp: SamplingParams, *,
           sampler_impl: str = "dense", paged: paged_lib.PagedConfig | None = None,
           mesh: Mesh | None = None):
  """One decode of B prompts with the named sampler (pure; jit it): each prompt once, so the
  paged sampler runs with group_size=1 (no prompt sharing, every sequence owns its pages).
  `mesh`: the paged sampler runs per batch shard under shard_map (see rlx.sampler.paged)."""
  if sampler_impl == "dense":
    return dense.generate_unjitted(graphdef, params, prompts_BxP, prompt_lens_B, keys_B, sp)
  if sampler_impl == "paged":
    return paged_lib.generate_unjitted(graphdef, params, prompts_BxP, prompt_lens_B, keys_B, sp,
                                       paged or paged_lib.PagedConfig(), group_size=1,
                                       mesh=mesh)
  raise ValueError(f"sampler_impl={sampler_impl!r}; expected one of {SAMPLER_IMPLS}.")


class Evaluator:
  """Greedy pass@1 on a fixed pool, in fixed-size batches (compiled once).

  Scored by the task's jnp `verifier` (rlx.data.tasks.Verifier; default exact match), or by
  `host_reward` (a checked Python reward, see rlx.rewards) given the decoded completions,
  `host` examples and `tokenizer`. `band`: levels whose completions also get pooled length
  metrics (`eval/band_len_mean`, `eval/band_correct_len_mean`).
  `show_progress` draws a progress bar over the batches on stderr (long evaluations);
  `check_stop` is called before each batch (it raises to abandon the evaluation).
  `sampler_impl` / `paged`: the sampler that decodes ("dense", the reference oracle, or
  "paged" with its PagedConfig; None = defaults), normally the run's own
  (config.sampler.impl / RunSpec.sampler.paged). Greedy results are the same either way.
  """

  def __init__(self, graphdef, pool: PromptPool, sp: SamplingParams, batch_size: int,
               mesh: Mesh, *, verifier: Verifier | None = None, band=(), host_reward=None,
               host=None, tokenizer=None, show_progress: bool = False, check_stop=None,
               sampler_impl: str = "dense", paged: paged_lib.PagedConfig | None = None):
    if sampler_impl not in SAMPLER_IMPLS:
      raise ValueError(f"Evaluator: sampler_impl={sampler_impl!r}; expected one of "
                       f"{SAMPLER_IMPLS}.")
    self.sampler_impl = sampler_impl
    self.paged = paged
    self.show_progress = show_progress
    self._evaluated = False  # the first evaluation compiles
    self.check_stop = check_stop
    self.host_reward = host_reward
    self.host = host
    self.tokenizer = tokenizer
    self.sp = sp
    self.mesh = mesh
    verifier = verifier or Verifier()
    self.verifier = verifier
    self.band = tuple(int(l) for l in band)
    n = pool.size
    self.n = n
    self.batch_size = min(batch_size, -(-n // shd.batch_size_of(mesh)) * shd.batch_size_of(mesh))
    pad = (-n) % self.batch_size
    host = jax.tree.map(np.asarray, pool)
    # Pad with copies of the first example; their results are dropped.
    self.pool = jax.tree.map(lambda x: np.concatenate([x, np.repeat(x[:1], pad, 0)]), host)
    self.difficulty = np.asarray(host.difficulty)
    batch_sh = shd.batch_sharding(mesh)

    @functools.partial(jax.jit, out_shardings=batch_sh)
    def run(params, prompts, prompt_lens, answers, answer_lens):
      keys = jax.random.split(jax.random.key(0), prompts.shape[0])
      ro = decode(graphdef, params, prompts, prompt_lens, keys, sp, sampler_impl=sampler_impl,
                  paged=paged, mesh=mesh)
      if host_reward is not None:
        return ro.tokens, ro.lengths
      return verifier(ro.tokens, answers, answer_lens), ro.lengths

    self._run = run
    self._graphdef = graphdef
    self._batches = None  # device copies of the batches, made by the first evaluation
    # A few rows for display: one shard (their count need not divide the mesh).
    self._decode_few = jax.jit(functools.partial(decode, graphdef, sp=sp,
                                                 sampler_impl=sampler_impl, paged=paged))

  def _device_batches(self) -> list[list[jax.Array]]:
    """(prompts, prompt_lens, answers, answer_lens) of each batch, placed on the mesh once
    (the pool is fixed): an evaluation then moves no inputs, only its results."""
    if self._batches is None:
      p, bs = self.pool, self.batch_size
      self._batches = [[shd.put(x[i:i + bs], shd.batch_sharding(self.mesh, x.ndim))
                        for x in (p.prompts, p.prompt_lens, p.answers, p.answer_lens)]
                       for i in range(0, p.prompts.shape[0], bs)]
    return self._batches

  def scores(self, params) -> np.ndarray:
    """The reward of each eval example's greedy completion."""
    return self.scores_and_lengths(params)[0]

  def scores_and_lengths(self, params) -> tuple[np.ndarray, np.ndarray]:
    """(reward, completion length in tokens incl. the stop token) per eval example."""
    from rlx.progress import Progress  # pylint: disable=g-import-not-at-top
    out = []
    batches = self._device_batches()
    # The first evaluation compiles the decoder: it says so (nested under the RL bar, or as a
    # plain line in a log); later ones show only on a terminal or when they run long.
    first, self._evaluated = not self._evaluated, True
    with Progress(len(batches), desc="eval", unit="batch", leave=False, announce=first,
                  disable=not self.show_progress) as bar:
      for args in batches:
        if self.check_stop is not None:
          self.check_stop()
        out.append(self._run(params, *args))
        if self.show_progress:  # count finished batches, not dispatched ones
          jax.block_until_ready(out[-1])
        bar.update(1)
    lengths = np.concatenate([distributed.to_host(l) for _, l in out])[:self.n]
    if self.host_reward is None:
      return np.concatenate([distributed.to_host(s) for s, _ in out])[:self.n], lengths
    tokens = np.concatenate([distributed.to_host(t) for t, _ in out])[:self.n]
    texts = [self.tokenizer.decode(t[:l]) for t, l in zip(tokens, lengths)]
    h = self.host
    return np.asarray(self.host_reward(list(h.prompts), texts, answer=list(h.answers),
                                       difficulty=[int(d) for d in h.difficulty])), lengths

  def __call__(self, params) -> dict[str, float]:
    """Accuracy, mean completion length and mean length of the correct completions (reward
    > 0; NaN when none is), overall and per level (`_d<level>`)."""
    s, lengths = self.scores_and_lengths(params)
    lengths = lengths.astype(np.float64)
    metrics = {}
    groups = [("eval/accuracy", "eval/len_mean", "eval/correct_len_mean",
               np.ones_like(self.difficulty, bool))]
    groups += [(f"eval/accuracy_d{int(l)}", f"eval/len_mean_d{int(l)}",
                f"eval/correct_len_mean_d{int(l)}", self.difficulty == l)
               for l in np.unique(self.difficulty)]
    in_band = np.isin(self.difficulty, self.band)
    if self.band and in_band.any():
      groups.append((None, "eval/band_len_mean", "eval/band_correct_len_mean", in_band))
    for acc_key, len_key, correct_key, sel in groups:
      if acc_key:
        metrics[acc_key] = float(s[sel].mean())
      correct = lengths[sel & (s > 0)]
      metrics[len_key] = float(lengths[sel].mean())
      metrics[correct_key] = float(correct.mean()) if correct.size else float("nan")
    return metrics

  def completions(self, params, indices, tokenizer) -> list[tuple[str, str]]:
    """(prompt text, completion text) for a few eval examples (for display)."""
    p = self.pool
    idx = np.asarray(indices)
    keys = jax.random.split(jax.random.key(0), len(idx))
    ro = self._decode_few(params, jnp.asarray(p.prompts[idx]), jnp.asarray(p.prompt_lens[idx]),
                          keys)
    toks = np.asarray(ro.tokens)
    return [(tokenizer.decode(p.prompts[i]), tokenizer.decode(t)) for i, t in zip(idx, toks)]
