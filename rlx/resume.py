"""What lets a run stop and resume: signals, checkpoint saves and restores, the fault hook.

  SignalFlag  SIGTERM / SIGINT for a whole run: remembered, acted on at safe points (`Stop`
              before the RL loop, a checkpoint at the next step boundary inside it).
  Saver       checkpoint saves that fail with one line naming the path and the OS error.
  restore     a checkpoint's state; a failure names the config settings that differ from
              the checkpoint's instead of calling a healthy checkpoint corrupt.
  fault       the RLX_FAULT test hook (SIGKILL at a named point of a step).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax

from rlx import checkpoint as ckpt_lib


def fault(point: str, step: int) -> None:
  """Test hook: RLX_FAULT="kill_after_rollout:5,kill_in_save:4" SIGKILLs this process there."""
  for item in filter(None, os.environ.get("RLX_FAULT", "").split(",")):
    name, _, at = item.partition(":")
    if name == point and int(at) == step:
      os.kill(os.getpid(), signal.SIGKILL)


class Stop(BaseException):
  """SIGTERM / SIGINT outside the RL loop's step boundary (raised from the handler)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class SignalFlag:
  """SIGTERM / SIGINT handling for a whole run: the handler only remembers the signal.

  Inside the RL loop the loop checkpoints and stops at the next step boundary. Before it
  (set-up, warm start, base evaluation) `check()` is polled at safe points (each warm-start
  step, each evaluation batch) and raises `Stop`, since there is no step to finish. Raising
  from the handler itself is not safe: it can land in a garbage-collector callback, where
  Python prints and drops it.
  """

  def __init__(self):
    self.signum = None
    self.deferred = False
    self._old = {}

  def check(self) -> None:
    if self.signum is not None and not self.deferred:
      raise Stop(self.signum)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: stop now
    self.signum = signum

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


class Saver:
  """Checkpoint saves that fail with one line naming the path and the OS error."""

  def __init__(self, ckpt: ckpt_lib.Checkpointer):
    self.ckpt = ckpt

  def _fail(self, step: int, e: BaseException):
    err = e
    while err is not None and not isinstance(err, OSError):
      err = err.__cause__ or err.__context__
    why = (f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
           if isinstance(err, OSError) else f"{type(e).__name__}: {' '.join(str(e).split())}")
    latest = self.ckpt.latest_step()
    keep = (f"the checkpoint of step {latest} is kept" if latest is not None
            else "no earlier checkpoint exists")
    return ckpt_lib.CheckpointError(
        f"could not save the checkpoint of step {step} to {self.ckpt.directory} "
        f"({why[:300]}); {keep}. Free space or fix permissions, then rerun to resume.")

  def ensure(self, step: int, state, meta) -> bool:
    """Step `step` on disk: waits for a save in flight, saves it unless a checkpoint of it
    exists (the step a run resumed from, or one just saved with checkpoint_every=1); returns
    whether it existed."""
    try:
      self.ckpt.wait()
    except Exception as e:  # pylint: disable=broad-except
      raise self._fail(step, e) from None
    if self.ckpt.latest_step() == step:
      return True
    self.save(step, state, meta, force=True, wait=True)
    return False

  def save(self, step: int, state, meta, *, force: bool = False, wait: bool = False) -> None:
    try:
      self.ckpt.save(step, state, meta, force=force)
      if wait:
        self.ckpt.wait()
    except Exception as e:  # pylint: disable=broad-except  (orbax wraps OS errors variously)
      raise self._fail(step, e) from None
    if wait and self.ckpt.latest_step() != step:
      raise self._fail(step, RuntimeError("the checkpoint is not on disk after the save"))

  def close(self) -> None:
    try:
      self.ckpt.close()
    except Exception as e:  # pylint: disable=broad-except
      raise self._fail(self.ckpt.latest_step() or 0, e) from None


def _config_diff(saved: dict | None, ours: dict, prefix: str = "") -> list[str]:
  """'key: checkpoint X, now Y' for every config value that differs (dotted keys)."""
  if saved is None:
    return []
  out = []
  for k in sorted(set(saved) | set(ours)):
    a, b = saved.get(k, "<absent>"), ours.get(k, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      out += _config_diff(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: checkpoint {a!r}, now {b!r}")
  return out


# Settings that change the saved state's tree or shapes (optimizer chain, replay ring, selector,
# reference params, prompt pool): a checkpoint made with other values cannot be restored.
_LAYOUT_KEYS = ("optim.", "replay.", "selection.", "rl.kl_coef", "task.", "sampler.max_",
                "model.", "tokenizer.", "lora.", "length.guard_margin", "length.length_reward")


def _lora_rank(record: dict | None) -> int:
  return int(((record or {}).get("lora") or {}).get("rank", 0) or 0)


def restore(ckpt: ckpt_lib.Checkpointer, step: int, abstract, shardings, model_cfg,
             record: dict, log) -> Any:
  """Restores `step`; a failure names the config settings that differ from the checkpoint's
  (a changed optimizer or replay setting changes the saved state's layout) instead of
  calling a healthy checkpoint corrupt."""
  import json  # pylint: disable=g-import-not-at-top
  saved = ckpt.read_meta(step).get("config")
  ours = json.loads(json.dumps(record, default=str))
  _check_tokenizer_kept(ckpt, step, saved, ours)
  theirs_lora, ours_lora = _lora_rank(saved), _lora_rank(ours)
  if (theirs_lora > 0) != (ours_lora > 0):
    what = lambda r: f"LoRA adapters (lora.rank={r})" if r else "all parameters (lora.rank=0)"
    raise ckpt_lib.CheckpointError(
        f"the checkpoint at {ckpt.directory}/{step} trains {what(theirs_lora)} and this config "
        f"trains {what(ours_lora)}: a run cannot switch between LoRA and full-parameter "
        f"training. Rerun with --config.lora.rank={theirs_lora} to resume, or pass a new "
        f"--workdir to start a new run.")
  if theirs_lora and ours_lora:
    keys = ("rank", "alpha", "targets", "base_dtype")
    changed = [f"lora.{k}: checkpoint {saved['lora'].get(k)!r}, now {ours['lora'].get(k)!r}"
               for k in keys if saved["lora"].get(k) != ours["lora"].get(k)]
    if changed:  # a changed alpha or base dtype would restore, and silently change the policy
      raise ckpt_lib.CheckpointError(
          f"the checkpoint at {ckpt.directory}/{step} was made with other LoRA settings "
          f"({'; '.join(changed)}): its adapters only mean the same policy with those. Rerun "
          f"with the checkpoint's settings to resume, or pass a new --workdir.")
  pipe = lambda r: (((r or {}).get("pipeline") or {}).get("mode", "sync"),
                    ((r or {}).get("pipeline") or {}).get("max_staleness", 1))
  (theirs_mode, theirs_k), (ours_mode, ours_k) = pipe(saved), pipe(ours)
  if theirs_mode != ours_mode or (ours_mode == "overlap" and theirs_k != ours_k):
    held = (f"pipeline.mode={theirs_mode!r}" + (f", pipeline.max_staleness={theirs_k}"
                                                  if theirs_mode == "overlap" else ""))
    raise ckpt_lib.CheckpointError(
        f"the checkpoint at {ckpt.directory}/{step} was written with {held} (an overlap "
        f"checkpoint holds the batches in flight, one per step of staleness) and this config "
        f"has pipeline.mode={ours_mode!r}"
        f"{f', max_staleness={ours_k}' if ours_mode == 'overlap' else ''}. Rerun with the "
        f"checkpoint's pipeline settings to resume, or pass a new --workdir.")
  diff = _config_diff(saved, ours)
  try:
    state, _ = ckpt.restore(step, abstract, shardings, model_cfg)
  except ckpt_lib.CheckpointError as e:
    layout = [d for d in diff if d.startswith(_LAYOUT_KEYS)]
    if not layout or "different model" in str(e):
      raise
    shown = "; ".join(layout[:6]) + (f"; and {len(layout) - 6} more" if len(layout) > 6 else "")
    raise ckpt_lib.CheckpointError(
        f"the checkpoint at {ckpt.directory}/{step} was made with other settings ({shown}), "
        f"and its saved state does not fit this config. Rerun with the checkpoint's settings "
        f"(its config is in the workdir's config.json) to resume, or pass a new --workdir to "
        f"start a new run.") from None
  held = int(jax.device_get(getattr(state, "learner", state).step))
  if held != step:  # a renamed directory: resuming it would count steps from its name
    raise ckpt_lib.CheckpointError(
        f"the checkpoint directory {ckpt.directory}/{step} holds the state after step {held}; "
        f"expected a directory named after the step it holds, as rlx writes them (was it "
        f"renamed?). Rename it back to {held}, or move it away to resume from the one before.")
  if diff:
    log(f"[rlx] resuming with settings changed since the checkpoint: {'; '.join(diff[:6])}"
        + (f"; and {len(diff) - 6} more" if len(diff) > 6 else ""))
  return state


def _check_tokenizer_kept(ckpt: ckpt_lib.Checkpointer, step: int, saved: dict | None,
                          ours: dict) -> None:
  """A resume reuses the tokenizer the run trained (WORKDIR/tokenizer.model): a changed
  tokenizer.vocab_size would change nothing but the run's record (config.json)."""
  get = lambda r, section, key: ((r or {}).get(section) or {}).get(key)
  theirs, now = get(saved, "tokenizer", "vocab_size"), get(ours, "tokenizer", "vocab_size")
  if (saved is None or theirs == now or get(ours, "tokenizer", "path")
      or get(ours, "model", "path")):
    return
  raise ckpt_lib.CheckpointError(
      f"config.tokenizer.vocab_size={now}, but the checkpoint at {ckpt.directory}/{step} was "
      f"made with {theirs}, and a resume keeps the tokenizer the run trained (its model's "
      f"vocabulary). Rerun with --config.tokenizer.vocab_size={theirs} to resume, or pass a "
      f"new --workdir to start a new run.")
