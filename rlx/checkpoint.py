"""Checkpoints of the whole RL state with orbax (params, optimizer, RNG, step, ...).

Layout: WORKDIR/checkpoints/<step>/{state, meta}. orbax writes each step into a temporary
directory and renames it when complete, so a crash mid-save leaves the previous checkpoint
as the latest restorable one. `meta` (JSON) records the model architecture and the
experiment config the state was made with; restoring into a different architecture fails
with a message instead of a shape error deep inside orbax.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

from rlx.model.config import ModelConfig


class CheckpointError(ValueError):
  pass


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


# State fields added after checkpoints were first written, None unless a feature uses them:
# a checkpoint without them restores as long as they are None in the target.
_LATER_FIELDS = ("base", "length_guard")


def _holds_later(obj) -> bool:
  return (dataclasses.is_dataclass(obj) and not isinstance(obj, type)
          and any(f.name in _LATER_FIELDS for f in dataclasses.fields(obj)))


def _later_none(obj) -> list[str]:
  """Names of the later fields that are None in `obj` or in a state nested in it (an overlap
  checkpoint's `learner`)."""
  out = []
  for f in dataclasses.fields(obj):
    v = getattr(obj, f.name)
    if f.name in _LATER_FIELDS and v is None:
      out.append(f.name)
    elif _holds_later(v):
      out += _later_none(v)
  return sorted(set(out))


def _fields_without(obj, dropped) -> dict:
  """`obj` as a dict of its fields (nested states too) without the None ones in `dropped`."""
  out = {}
  for f in dataclasses.fields(obj):
    v = getattr(obj, f.name)
    if f.name in dropped and v is None:
      continue
    out[f.name] = _fields_without(v, dropped) if _holds_later(v) else v
  return out


def _rebuild(obj, restored: dict):
  """`restored` (from `_fields_without(obj, ...)`) as obj's types, dropped fields None."""
  kw = {}
  for f in dataclasses.fields(obj):
    v = getattr(obj, f.name)
    if f.name not in restored:
      kw[f.name] = None
    elif _holds_later(v):
      kw[f.name] = _rebuild(v, restored[f.name])
    else:
      kw[f.name] = restored[f.name]
  return type(obj)(**kw)


def _without_later_fields(target) -> list[dict]:
  """Restore targets for a checkpoint written before some state fields existed: the target as
  dicts of its fields without some of the later ones that are None (each non-empty subset,
  fewest dropped first: a checkpoint may predate one and hold another); [] if there is no
  such field (nothing to retry)."""
  if not dataclasses.is_dataclass(target) or isinstance(target, type):
    return []
  none = _later_none(target)
  return [_fields_without(target, dropped)
          for n in range(1, len(none) + 1) for dropped in itertools.combinations(none, n)]


# tensorstore's write errors (raised by orbax as ValueError) end with the OS error's number.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_QUOTED_PATH = re.compile(r'"(/[^"]+)"')


def _as_os_error(e: Exception) -> Exception:
  """A tensorstore write error (e.g. a full disk) as the OSError it reports, naming the file:
  orbax raises it as a ValueError whose message holds the errno; other errors unchanged."""
  if isinstance(e, OSError):
    return e
  text = str(e)
  code = _OS_ERROR_CODE.search(text)
  if code is None:
    return e
  number = int(code.group(1))
  path = _QUOTED_PATH.search(text)
  return OSError(number, os.strerror(number), path.group(1) if path else None)


def _raise_as_os_error(e: Exception):
  err = _as_os_error(e)
  if err is e:
    raise e
  raise err from e


class Checkpointer:
  """Saves and restores TrainState-like pytrees under WORKDIR/checkpoints.

  A save that fails on the OS (a full disk) raises OSError naming the file and the error,
  not orbax's wrapped message.
  """

  def __init__(self, workdir: str, *, keep: int = 2, async_save: bool = True):
    if not isinstance(keep, int) or keep < 0:
      raise CheckpointError(f"keep={keep!r} checkpoints; expected an integer >= 1, or 0 to keep "
                            f"every checkpoint.")
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._manager = ocp.CheckpointManager(
        self.directory,
        # keep=0: every checkpoint is kept (orbax's None); never "keep none".
        options=ocp.CheckpointManagerOptions(max_to_keep=keep or None, create=True,
                                             enable_async_checkpointing=async_save),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
    try:  # also raises a failure of the previous save, which ran in the background
      return self._manager.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        meta=ocp.args.JsonSave(meta)), force=force)
    except Exception as e:  # pylint: disable=broad-except
      _raise_as_os_error(e)

  def read_meta(self, step: int) -> dict[str, Any]:
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      return dict(out["meta"])
    except Exception as e:  # orbax raises several types for missing / corrupt items
      first = " ".join(str(e).split())[:200]
      raise CheckpointError(
          f"Checkpoint {os.path.join(self.directory, str(step))} has no readable metadata "
          f"({type(e).__name__}: {first}); it was not written by rlx or is corrupt. Move it "
          f"away or use another --workdir.") from None

  def restore(self, step: int, abstract_state: Any, shardings: Any, model_cfg: ModelConfig,
              ) -> tuple[Any, dict[str, Any]]:
    meta = self.read_meta(step)
    # The compute dtype is not compared: the state holds the params in param_dtype (f32
    # masters by default), so a run checkpointed computing in float32 (model.dtype="auto" on
    # CPU) resumes computing in bfloat16 on a GPU; the resume logs the changed model.dtype.
    saved = meta.get("model")
    # Nor is scan_layers (how the layers run, not what they hold: the params are the same).
    execution = ("dtype", "scan_layers")
    saved = ({k: v for k, v in saved.items() if k not in execution} if isinstance(saved, dict)
             else saved)
    ours = json.loads(json.dumps(model_cfg.to_dict()))  # tuples -> lists, as stored
    for k in execution:
      ours.pop(k)
    if saved is not None and saved != ours:
      diffs = [f"{k}: checkpoint {saved.get(k)!r} vs config {ours.get(k)!r}"
               for k in sorted(set(saved) | set(ours)) if saved.get(k) != ours.get(k)]
      raise CheckpointError(
          f"The checkpoint at {os.path.join(self.directory, str(step))} holds a different "
          f"model ({'; '.join(diffs[:4])}). Use a new --workdir, or the config it was made "
          f"with.")
    target = _abstract(abstract_state, shardings)
    try:
      try:
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))
      except ValueError as e:
        olders = _without_later_fields(target)
        if not olders or "tree structures do not match" not in str(e):
          raise
        # A checkpoint written before a state field that is None here was added (e.g.
        # TrainState.base, LoRA's frozen base; length_guard): restore the fields it has.
        for i, older in enumerate(olders):
          try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(older)))
            break
          except ValueError as e2:
            if i + 1 == len(olders) or "tree structures do not match" not in str(e2):
              raise
        out = {"state": _rebuild(target, out["state"])}
    except Exception as e:
      first = " ".join(str(e).split())[:200]
      raise CheckpointError(
          f"Could not restore the checkpoint at {os.path.join(self.directory, str(step))} "
          f"({type(e).__name__}: {first}...). It is corrupt or from an incompatible state "
          f"layout; move it away or use another --workdir.") from None
    return out["state"], meta

  def wait(self) -> None:
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      _raise_as_os_error(e)

  def close(self) -> None:
    self.wait()
    self._manager.close()


def read_json(path: str, remedy: str = "Delete it to have it rewritten.") -> Any:
  """A JSON file rlx wrote (or a user edited); one clear error naming the file if it is not
  readable JSON, ending with `remedy` (what makes the next run work)."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except UnicodeDecodeError as e:
    raise CheckpointError(f"{path} is not UTF-8 text (byte {e.start}); expected a JSON file "
                          f"written by rlx. {remedy}") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON (line {e.lineno} column {e.colno}: "
                          f"{e.msg}). {remedy}") from None
  except IsADirectoryError:
    raise CheckpointError(f"{path} is a directory; expected a JSON file.") from None


def save_json(path: str, obj: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True, default=str)
  os.replace(tmp, path)


def read_arrays(workdir: str, step: int | None = None) -> Any:
  """The saved TrainState of WORKDIR/checkpoints/<step> (default: latest) as numpy arrays,
  on any machine (no mesh needed): for analysis, comparisons and export."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if step is None:
    steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit())
    if not steps:
      raise CheckpointError(f"No complete checkpoint under {directory}.")
    step = steps[-1]
  path = os.path.join(directory, str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  meta = ckptr.metadata(path)
  tree = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
  tree = getattr(tree, "tree", tree)
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
