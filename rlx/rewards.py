r"""Rewards computed in host Python (between the rollout and update halves of a train step).

The contract of a reward function:

  reward_fn(prompts: list[str], completions: list[str], **example_fields) -> list[float]

  prompts       the B prompt strings of the batch (each repeated for the G samples of its group)
  completions   the B decoded completions, aligned with prompts
  example_fields  the task's per-example fields as lists aligned with prompts, e.g.
                answer=[...], difficulty=[...]; a reward takes the ones it needs by name and
                accepts the rest through **kwargs
  returns       B finite floats (anything float() accepts: bool, int, numpy scalars)

  def brevity_reward(prompts, completions, *, answer, **unused):
    return [math_reward([p], [c], answer=[a])[0] - 1e-3 * len(c)
            for p, c, a in zip(prompts, completions, answer)]
  register_reward("brevity", brevity_reward)

The trainer calls a reward through `compute_rewards` (or a `wrap_reward` closure), which checks
the result with `check_rewards` and turns an exception raised inside the reward into one
ValueError that names the reward function and the first failing example.

The trainer runs that call in a worker process forked from the run (rlx.reward_worker), one per
run, so config.task.reward_timeout_s and SIGTERM end even a reward stuck in C code. A reward
sees its module's state as it was at the fork and keeps its own between calls; what it changes
there does not reach the trainer's process, and it must not use JAX (score on the host).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlx.data import math_verify

RewardFn = Callable[..., Sequence[float]]
DEFAULT_RANGE = (-10.0, 10.0)


def math_reward(prompts: Sequence[str], completions: Sequence[str], *,
                answer: Sequence[str], **unused) -> list[float]:
  """1.0 when the completion's final answer equals the reference answer, else 0.0.

  The final answer is `math_verify.extract_answer` (last \\boxed{}, `####`, "The answer is",
  last number); equality is `math_verify.answers_match` (numbers as exact rationals, LaTeX and
  units normalized).
  """
  del prompts, unused
  return [1.0 if math_verify.answers_match(math_verify.extract_answer(c), a) else 0.0
          for c, a in zip(completions, answer)]


def exact_reward(prompts: Sequence[str], completions: Sequence[str], *,
                 answer: Sequence[str], **unused) -> list[float]:
  """1.0 when completion.strip() == answer.strip(), else 0.0."""
  del prompts, unused
  return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]


_REGISTRY: dict[str, RewardFn] = {"math": math_reward, "exact": exact_reward}


def register_reward(name: str, fn: RewardFn) -> None:
  """Makes `fn` available as get_reward(name) (e.g. from an experiment config file)."""
  if not callable(fn):
    raise ValueError(f"register_reward({name!r}, ...): {fn!r} is not callable.")
  _REGISTRY[name] = fn


def get_reward(name: str) -> RewardFn:
  """The reward function registered under `name` ('math', 'exact', or one registered)."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"Unknown reward {name!r}; expected one of {sorted(_REGISTRY)}.") from None


def _reward_name(fn: Callable) -> str:
  for name, registered in _REGISTRY.items():
    if registered is fn:
      return f"{name!r} ({getattr(fn, '__qualname__', repr(fn))})"
  return getattr(fn, "__qualname__", None) or repr(fn)


def _short(value: Any, n: int = 80) -> str:
  """repr(value), cut to about n characters."""
  if not isinstance(value, str):
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."
  return repr(value if len(value) <= n else value[:n] + "...")


def check_rewards(values: Any, n: int, task_name: str, prompts: Sequence[str] | None = None,
                  *, low: float = DEFAULT_RANGE[0], high: float = DEFAULT_RANGE[1],
                  reward_name: str = "reward") -> np.ndarray:
  """Validates a reward function's output; returns it as float32[n].

  Raises ValueError naming the task and the first bad example (and its prompt) when the count
  is not n, or a value is not a number, not finite, or outside [low, high].
  """
  def at(i: int) -> str:
    where = f"{task_name} example {i}"
    if prompts is not None and i < len(prompts):
      where += f" (prompt {_short(prompts[i])})"
    return where

  if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
    raise ValueError(f"{task_name}: {reward_name} returned {type(values).__name__} "
                     f"{_short(values)}; expected a list of {n} floats.")
  if len(values) != n:
    raise ValueError(f"{task_name}: {reward_name} returned {len(values)} values for {n} "
                     f"completions; expected one per completion.")
  out = np.empty((n,), np.float32)
  for i, v in enumerate(values):
    if isinstance(v, np.ndarray) and v.ndim == 0:
      v = v.item()
    if not isinstance(v, (numbers.Real, np.bool_)):
      raise ValueError(f"{reward_name} gave {type(v).__name__} {_short(v)} for {at(i)}; "
                       f"expected a number.")
    v = float(v)
    if not math.isfinite(v):
      raise ValueError(f"{reward_name} gave {v} for {at(i)}; expected a finite number.")
    if not low <= v <= high:
      raise ValueError(f"{reward_name} gave {v:g} for {at(i)}, outside the allowed range "
                       f"[{low:g}, {high:g}] (set the range if this is intended).")
    out[i] = v
  return out


def _check_fields(prompts, completions, fields: Mapping[str, Sequence], task_name: str):
  if len(completions) != len(prompts):
    raise ValueError(f"{task_name}: {len(completions)} completions for {len(prompts)} prompts; "
                     f"expected one completion per prompt.")
  for key, value in fields.items():
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
      raise ValueError(f"{task_name}: example field {key!r} is {type(value).__name__}; expected "
                       f"a list aligned with the {len(prompts)} prompts.")
    if len(value) != len(prompts):
      raise ValueError(f"{task_name}: example field {key!r} has {len(value)} entries for "
                       f"{len(prompts)} prompts; expected one per prompt.")


def compute_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], *,
                    task_name: str, low: float = DEFAULT_RANGE[0],
                    high: float = DEFAULT_RANGE[1], **example_fields) -> np.ndarray:
  """Calls `fn`, checks its output, and returns float32[len(prompts)].

  When `fn` raises, it is called again one example at a time to find the first example that
  fails; the ValueError raised names the reward function, that example and the original error
  (chained as __cause__).
  """
  prompts, completions = list(prompts), list(completions)
  _check_fields(prompts, completions, example_fields, task_name)
  name = _reward_name(fn)
  try:
    values = fn(prompts, completions, **example_fields)
  except Exception as batch_error:  # pylint: disable=broad-except
    for i in range(len(prompts)):
      one = {k: list(v[i:i + 1]) for k, v in example_fields.items()}
      try:
        fn(prompts[i:i + 1], completions[i:i + 1], **one)
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(
            f"reward function {name} raised {type(e).__name__}: {e} on {task_name} example {i} "
            f"(prompt {_short(prompts[i])}, completion {_short(completions[i])}, fields "
            f"{{{', '.join(f'{k!r}: {_short(v[0], 40)}' for k, v in one.items())}}}).") from e
    raise ValueError(f"reward function {name} raised {type(batch_error).__name__}: "
                     f"{batch_error} on the {task_name} batch of {len(prompts)} examples (each "
                     f"example alone succeeds).") from batch_error
  return check_rewards(values, len(prompts), task_name, prompts, low=low, high=high,
                       reward_name=f"reward function {name}")


def wrap_reward(fn: RewardFn | str, *, task_name: str, low: float = DEFAULT_RANGE[0],
                high: float = DEFAULT_RANGE[1]) -> Callable[..., np.ndarray]:
  """`fn` (or a registered name) as a checked reward: (prompts, completions, **fields) ->
  float32[B], with the errors of `compute_rewards`."""
  if isinstance(fn, str):
    fn = get_reward(fn)
  if not low <= high:
    raise ValueError(f"reward range [{low}, {high}] is empty; expected low <= high.")

  def checked(prompts, completions, **example_fields) -> np.ndarray:
    return compute_rewards(fn, prompts, completions, task_name=task_name, low=low, high=high,
                           **example_fields)

  checked.__name__ = checked.__qualname__ = f"checked_{getattr(fn, '__name__', 'reward')}"
  checked.__wrapped__ = fn
  return checked
