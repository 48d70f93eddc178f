"""Tasks: tokenized prompt pools (device arrays) and jnp verifiers.

A prompt pool holds every prompt of a split as fixed-shape arrays so that the training step can
choose prompts on device:
  prompts   i32[N, P]  left-padded with pad ([BOS] + prompt tokens, right-aligned)
  prompt_lens i32[N]
  answers   i32[N, A]  answer tokens + EOS, right-padded with pad
  answer_lens i32[N]   (including EOS)
  difficulty i32[N]
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rlx.data.tokenizer import Tokenizer


def _short(value, limit: int = 80) -> str:
  """repr(value), cut to about `limit` characters (a prompt can be megabytes long)."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


@struct.dataclass
class PromptPool:
  prompts: jax.Array
  prompt_lens: jax.Array
  answers: jax.Array
  answer_lens: jax.Array
  difficulty: jax.Array

  @property
  def size(self) -> int:
    return self.prompts.shape[0]

  @property
  def max_prompt_len(self) -> int:
    return self.prompts.shape[1]

  def take(self, ids) -> "PromptPool":
    return jax.tree.map(lambda x: jnp.take(x, ids, axis=0), self)


@dataclasses.dataclass
class HostExamples:
  """The host-side strings behind a pool (for display and Python rewards)."""

  prompts: list[str]
  answers: list[str]
  difficulty: np.ndarray


def tokenize_pool(examples: Sequence[dict], tokenizer: Tokenizer, max_prompt_len: int,
                  max_answer_len: int, *, task_name: str = "task",
                  add_special_tokens: bool = True) -> tuple[PromptPool, HostExamples]:
  """Tokenizes examples ({'prompt', 'answer', 'difficulty'}) into a PromptPool (numpy).

  Prompts get the tokenizer's special tokens (BOS) unless add_special_tokens=False (chat
  templates already spell them out).
  """
  if not examples:
    raise ValueError(f"{task_name}: the dataset is empty; expected at least one example.")
  n = len(examples)
  prompts = np.full((n, max_prompt_len), tokenizer.pad_id, np.int32)
  answers = np.full((n, max_answer_len), tokenizer.pad_id, np.int32)
  prompt_lens = np.zeros((n,), np.int32)
  answer_lens = np.zeros((n,), np.int32)
  difficulty = np.zeros((n,), np.int32)
  for i, ex in enumerate(examples):
    p = tokenizer.encode(ex["prompt"], add_special_tokens=add_special_tokens)
    if len(p) > max_prompt_len:
      raise ValueError(
          f"{task_name}: example {i} prompt {_short(ex['prompt'])} has {len(p)} tokens, "
          f"longer than the maximum prompt length {max_prompt_len}; raise "
          f"config.sampler.max_prompt_len or drop the example.")
    a = tokenizer.encode(ex["answer"]) + [tokenizer.eos_id]
    if len(a) > max_answer_len:
      raise ValueError(
          f"{task_name}: example {i} answer {_short(ex['answer'])} has {len(a)} tokens "
          f"(with EOS), longer than the maximum answer length {max_answer_len}.")
    prompts[i, max_prompt_len - len(p):] = p
    prompt_lens[i] = len(p)
    answers[i, :len(a)] = a
    answer_lens[i] = len(a)
    difficulty[i] = int(ex.get("difficulty", 0))
  pool = PromptPool(prompts=prompts, prompt_lens=prompt_lens, answers=answers,
                    answer_lens=answer_lens, difficulty=difficulty)
  host = HostExamples(prompts=[ex["prompt"] for ex in examples],
                      answers=[ex["answer"] for ex in examples], difficulty=difficulty)
  return pool, host


def exact_match_reward(completions_BxT, answers_BxA, answer_lens_B):
  """1.0 where the completion equals the answer followed by EOS, else 0.0 (jnp, jittable).

  `answers` already ends with EOS at answer_lens-1, so matching the first answer_lens tokens
  is an exact match of the answer text up to EOS. Completions shorter than the answer fail.
  """
  t = completions_BxT.shape[1]
  a = answers_BxA.shape[1]
  if t < a:
    completions_BxT = jnp.pad(completions_BxT, ((0, 0), (0, a - t)), constant_values=-1)
  idx = jnp.arange(a)[None, :]
  ok = (completions_BxT[:, :a] == answers_BxA) | (idx >= answer_lens_B[:, None])
  return jnp.all(ok, axis=1).astype(jnp.float32)
