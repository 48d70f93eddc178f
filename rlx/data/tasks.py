"""Tasks: tokenized prompt pools (device arrays) and jnp verifiers.

A prompt pool holds every prompt of a split as fixed-shape arrays so that the training step can
choose prompts on device:
  prompts   i32[N, P]  left-padded with pad ([BOS] + prompt tokens, right-aligned)
  prompt_lens i32[N]
  answers   i32[N, A]  final-answer tokens + EOS, right-padded with pad; A is the longest
                       answer's length, not the completions' (a worked solution is long, its
                       answer short)
  answer_lens i32[N]   (including EOS)
  difficulty i32[N]

Verifiers (jnp, inside the jitted step; `Verifier` picks one by name):
  exact_match   the whole completion is the answer followed by EOS
  final_answer  the tokens after the last answer marker (e.g. "=>") are the answer + EOS
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
  # The pass-rate probe's completions where a task's reward accepts more than the answer
  # (TaskDef.probe_references): i32[N, R, L] token ids (+ EOS), their lengths i32[N, R]
  # (0: no such reference). None: the answer is the one correct completion (exact match).
  references: jax.Array | None = None
  reference_lens: jax.Array | None = None

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
                  add_special_tokens: bool = True,
                  references: Sequence[Sequence[str]] | None = None
                  ) -> tuple[PromptPool, HostExamples]:
  """Tokenizes examples ({'prompt', 'answer', 'difficulty'}) into a PromptPool (numpy).

  The answers array is as wide as the longest answer (+ EOS); max_answer_len caps it (the
  completions' length: a longer answer could never be generated). Prompts get the tokenizer's special tokens (BOS) unless add_special_tokens=False (chat
  templates already spell them out).
  """
  if not examples:
    raise ValueError(f"{task_name}: the dataset is empty; expected at least one example.")
  n = len(examples)
  prompts = np.full((n, max_prompt_len), tokenizer.pad_id, np.int32)
  prompt_lens = np.zeros((n,), np.int32)
  difficulty = np.zeros((n,), np.int32)
  answer_ids = []
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
    answer_ids.append(a)
    difficulty[i] = int(ex.get("difficulty", 0))
  answers = np.full((n, max(map(len, answer_ids))), tokenizer.pad_id, np.int32)
  answer_lens = np.asarray([len(a) for a in answer_ids], np.int32)
  for i, a in enumerate(answer_ids):
    answers[i, :len(a)] = a
  refs = ref_lens = None
  if references is not None:
    refs, ref_lens = tokenize_references(references, tokenizer, max_answer_len, n, task_name)
  pool = PromptPool(prompts=prompts, prompt_lens=prompt_lens, answers=answers,
                    answer_lens=answer_lens, difficulty=difficulty, references=refs,
                    reference_lens=ref_lens)
  host = HostExamples(prompts=[ex["prompt"] for ex in examples],
                      answers=[ex["answer"] for ex in examples], difficulty=difficulty)
  return pool, host


def tokenize_references(references, tokenizer: Tokenizer, max_answer_len: int, n: int,
                         task_name: str) -> tuple[np.ndarray, np.ndarray]:
  if len(references) != n or len({len(r) for r in references}) > 1 or not references[0]:
    raise ValueError(f"{task_name}: the probe references have counts "
                     f"{sorted({len(r) for r in references})} for {len(references)} examples; "
                     f"expected the same number (>= 1) for each of the {n} examples.")
  ids = []
  for refs in references:
    seen, row = set(), []
    for text in refs:
      t = tuple(tokenizer.encode(text)) + (tokenizer.eos_id,)
      row.append(t if len(t) <= max_answer_len and t not in seen else ())
      seen.add(t)
    ids.append(row)
  width = max(1, max(len(t) for row in ids for t in row))
  out = np.full((n, len(ids[0]), width), tokenizer.pad_id, np.int32)
  lens = np.zeros((n, len(ids[0])), np.int32)
  for i, row in enumerate(ids):
    for r, t in enumerate(row):
      out[i, r, :len(t)] = t
      lens[i, r] = len(t)
  return out, lens


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


def final_answer_reward(completions_BxT, answers_BxA, answer_lens_B, marker: tuple[int, ...]):
  """1.0 where the tokens after the last `marker` are the answer followed by EOS (jnp).

  Only markers before the completion's first EOS count (the EOS is the answer's last token,
  answers[answer_lens - 1]); a completion without a marker, with tokens between the answer and
  EOS, or without EOS (truncated) scores 0. Fixed shapes throughout, so it runs inside jit.
  """
  b, t = completions_BxT.shape
  a = answers_BxA.shape[1]
  m = len(marker)
  if m == 0:
    raise ValueError("final_answer_reward: the marker is empty; expected its token ids.")
  if t < m:
    return jnp.zeros((b,), jnp.float32)
  eos_B = jnp.take_along_axis(answers_BxA, (answer_lens_B - 1)[:, None], axis=1)[:, 0]
  is_eos = completions_BxT == eos_B[:, None]
  first_eos_B = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), t)
  starts = jnp.arange(t - m + 1)
  hit_BxS = jnp.ones((b, t - m + 1), bool)
  for k, token in enumerate(marker):
    hit_BxS &= completions_BxT[:, k:t - m + 1 + k] == token
  hit_BxS &= starts[None, :] + m <= first_eos_B[:, None]
  last_B = jnp.max(jnp.where(hit_BxS, starts[None, :], -1), axis=1)
  idx_BxA = (last_B + m)[:, None] + jnp.arange(a)[None, :]
  got_BxA = jnp.take_along_axis(completions_BxT, jnp.clip(idx_BxA, 0, t - 1), axis=1)
  got_BxA = jnp.where(idx_BxA < t, got_BxA, -1)
  ok = (got_BxA == answers_BxA) | (jnp.arange(a)[None, :] >= answer_lens_B[:, None])
  return (jnp.all(ok, axis=1) & (last_B >= 0)).astype(jnp.float32)


VERIFIERS = ("exact_match", "final_answer")


@dataclasses.dataclass(frozen=True)
class Verifier:
  """A task's jnp verifier with its static settings (hashable: a jit static argument).

    verifier(completions i32[B, T], answers i32[B, A], answer_lens i32[B]) -> f32[B]

  kind "exact_match": the completion is the answer; "final_answer": the tokens after the last
  `marker` (token ids) are (see `final_answer_reward`).
  """

  kind: str = "exact_match"
  marker: tuple[int, ...] = ()

  def __post_init__(self):
    if self.kind not in VERIFIERS:
      raise ValueError(f"verifier kind {self.kind!r}; expected one of {VERIFIERS}.")
    if self.kind == "final_answer" and not self.marker:
      raise ValueError("a final_answer verifier needs the marker's token ids; got none.")

  def __call__(self, completions_BxT, answers_BxA, answer_lens_B):
    if self.kind == "final_answer":
      return final_answer_reward(completions_BxT, answers_BxA, answer_lens_B, self.marker)
    return exact_match_reward(completions_BxT, answers_BxA, answer_lens_B)
