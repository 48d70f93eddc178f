"""Held-out evaluation: greedy decoding over the eval pool, accuracy per difficulty level."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlx import distributed
from rlx import sharding as shd
from rlx.data.tasks import PromptPool, exact_match_reward
from rlx.sampler import dense
from rlx.sampler.sampling import SamplingParams


class Evaluator:
  """Greedy pass@1 on a fixed pool, in fixed-size batches (compiled once).

  Scored by the task's jnp verifier, or by `host_reward` (a checked Python reward, see
  rlx.rewards) given the decoded completions, `host` examples and `tokenizer`.
  `show_progress` draws a progress bar over the batches on stderr (long evaluations);
  `check_stop` is called before each batch (it raises to abandon the evaluation).
  """

  def __init__(self, graphdef, pool: PromptPool, sp: SamplingParams, batch_size: int,
               mesh: Mesh, *, host_reward=None, host=None, tokenizer=None,
               show_progress: bool = False, check_stop=None):
    self.show_progress = show_progress
    self.check_stop = check_stop
    self.host_reward = host_reward
    self.host = host
    self.tokenizer = tokenizer
    self.sp = sp
    self.mesh = mesh
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
      ro = dense.generate_unjitted(graphdef, params, prompts, prompt_lens, keys, sp)
      if host_reward is not None:
        return ro.tokens, ro.lengths
      return exact_match_reward(ro.tokens, answers, answer_lens)

    self._run = run
    self._graphdef = graphdef

  def scores(self, params) -> np.ndarray:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    out = []
    p = self.pool
    bs = self.batch_size
    num_batches = p.prompts.shape[0] // bs
    with tqdm(total=num_batches, desc="eval", unit="batch", leave=False, dynamic_ncols=True,
              file=sys.stderr, disable=not self.show_progress) as bar:
      for i in range(0, p.prompts.shape[0], bs):
        if self.check_stop is not None:
          self.check_stop()
        sl = slice(i, i + bs)
        args = [shd.put(x[sl], shd.batch_sharding(self.mesh, x.ndim))
                for x in (p.prompts, p.prompt_lens, p.answers, p.answer_lens)]
        out.append(self._run(params, *args))
        if self.show_progress:  # count finished batches, not dispatched ones
          jax.block_until_ready(out[-1])
        bar.update(1)
    if self.host_reward is None:
      return np.concatenate([distributed.to_host(x) for x in out])[:self.n]
    tokens = np.concatenate([distributed.to_host(t) for t, _ in out])[:self.n]
    lengths = np.concatenate([distributed.to_host(l) for _, l in out])[:self.n]
    texts = [self.tokenizer.decode(t[:l]) for t, l in zip(tokens, lengths)]
    h = self.host
    return np.asarray(self.host_reward(list(h.prompts), texts, answer=list(h.answers),
                                       difficulty=[int(d) for d in h.difficulty]))

  def __call__(self, params) -> dict[str, float]:
    s = self.scores(params)
    metrics = {"eval/accuracy": float(s.mean())}
    for level in np.unique(self.difficulty):
      metrics[f"eval/accuracy_d{int(level)}"] = float(s[self.difficulty == level].mean())
    return metrics

  def completions(self, params, indices, tokenizer) -> list[tuple[str, str]]:
    """(prompt text, completion text) for a few eval examples (for display)."""
    p = self.pool
    idx = np.asarray(indices)
    keys = jax.random.split(jax.random.key(0), len(idx))
    ro = dense.generate(self._graphdef, params, jnp.asarray(p.prompts[idx]),
                        jnp.asarray(p.prompt_lens[idx]), keys, params_cfg=self.sp)
    toks = np.asarray(ro.tokens)
    return [(tokenizer.decode(p.prompts[i]), tokenizer.decode(t)) for i, t in zip(idx, toks)]
