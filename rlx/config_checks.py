"""Reading one config key with its check: the helpers each spec's `from_config` uses.

A leaf module (it imports only rlx.errors), so the specs beside their code (rlx.rl.*,
rlx.model.lora, rlx.sampler.paged) can check their own config section without importing
rlx.configs. Every failure is one ConfigError naming the key, the bad value and what was
expected.
"""

from __future__ import annotations

import math

from rlx.errors import ConfigError

# Far beyond any real run; a value above is a typo (1e9) that would otherwise fail deep inside
# XLA while sizing buffers.
MAX_TOKENS = 1 << 20


def need(ok: bool, msg: str) -> None:
  if not ok:
    raise ConfigError(msg)


def get(config, key: str):
  value = config
  for part in key.split("."):
    value = value[part]
  return value


def number(config, key: str, lo: float | None = None, hi: float | None = None, *,
           lo_open: bool = False, hi_open: bool = False, what: str = "") -> float:
  value = get(config, key)
  # Non-finite values are refused: an infinite lr or weight decay would turn finite gradients
  # into non-finite params, which the update's guard (gradient norm only) does not check.
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  try:
    ok = ok and math.isfinite(value)
  except OverflowError:  # an int beyond float range (10**400)
    ok = False
  if ok and lo is not None:
    ok = value > lo if lo_open else value >= lo
  if ok and hi is not None:
    ok = value < hi if hi_open else value <= hi
  if not ok:
    lo_s = "" if lo is None else f"{lo:g} {'<' if lo_open else '<='} "
    hi_s = "" if hi is None else f" {'<' if hi_open else '<='} {hi:g}"
    leaf = key.rsplit(".", 1)[-1]
    raise ConfigError(f"config.{key}={value!r}; expected {what or lo_s + leaf + hi_s}.")
  return float(value)


def integer(config, key: str, lo: int = 1, hi: int | None = None) -> int:
  value = get(config, key)
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (
      hi is None or value <= hi)
  if not ok:
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ConfigError(f"config.{key}={value!r}; expected an integer {rng}.")
  return value


def integers(config, key: str) -> tuple[int, ...]:
  value = get(config, key)
  try:
    return tuple(int(x) for x in (value or ()))
  except (TypeError, ValueError):
    raise ConfigError(f"config.{key}={value!r}; expected a tuple of integers.") from None


def level_weights(config, key: str, *, allow_empty: bool = False
                  ) -> tuple[tuple[int, float], ...]:
  """{'level': weight} as sorted (level, weight) pairs: weights >= 0, at least one > 0."""
  value = dict(get(config, key))
  if not value and allow_empty:
    return ()
  try:
    weights = tuple(sorted((int(k), float(v)) for k, v in value.items()))
  except (TypeError, ValueError):
    raise ConfigError(f"config.{key}={value!r}; expected {{'level': weight}} with integer "
                      f"levels and numeric weights.") from None
  need(all(w >= 0 for _, w in weights) and any(w > 0 for _, w in weights),
       f"config.{key}={value!r}; expected non-negative weights, at least one positive.")
  return weights

