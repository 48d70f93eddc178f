r"""Exports a trained policy as a Hugging Face model directory.

  python -m rlx.export WORKDIR OUT_DIR [--step N] [--dtype bfloat16] [--force]

OUT_DIR gets config.json, model.safetensors (sharded above 5 GB) and the tokenizer files of
the run's base model (config.model.path, config.tokenizer.path, or the built-in warm start's
WORKDIR/base), so `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads the
policy of checkpoint N (default: the latest). Only the params are read from the checkpoint,
on the host; no accelerator is needed. A mistake exits with one line `rlx: error: ...`
(status 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from rlx.checkpoint import Checkpointer, CheckpointError
from rlx.data.tokenizer import Tokenizer, load_tokenizer
from rlx.model import hf
from rlx.model.config import DTYPES, ModelConfig


def checkpoint_steps(workdir: str) -> list[int]:
  """The complete checkpoint steps of an rlx workdir, ascending."""
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"workdir {workdir!r} does not exist.")
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise CheckpointError(f"{workdir} is not an rlx run: it has no checkpoints/ directory.")
  steps = sorted(int(d) for d in os.listdir(directory)
                 if d.isdigit() and os.path.isdir(os.path.join(directory, d, "state")))
  if not steps:
    raise CheckpointError(f"{directory} holds no complete checkpoint; train longer or pick "
                          "another workdir.")
  return steps


def _read_params(workdir: str, step: int) -> Any:
  """The `params` of the TrainState saved at `step`, as numpy (nothing else is read)."""
  path = os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  try:
    meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "params" not in tree:
      raise CheckpointError(f"{path} holds no params; it was not written by rlx.")
    item = {"params": tree["params"]}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    out = ckptr.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                          partial_restore=True))
  except CheckpointError:
    raise
  except Exception as e:  # orbax raises several types for missing / corrupt files
    first = " ".join(str(e).split())[:200]
    raise CheckpointError(f"Could not read the params of checkpoint {path} "
                          f"({type(e).__name__}: {first}).") from None
  return out["params"]


def _expand(path: str) -> str:
  if path.startswith("assets/"):  # as rlx.experiment resolves shipped assets
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets",
                        path[len("assets/"):])
  return os.path.expanduser(path)


def tokenizer_sources(workdir: str, config: dict[str, Any]) -> list[str]:
  """Where the run's tokenizer files are (directories, or a tokenizer.path file); later ones
  override earlier ones. The first is a model directory, whose token ids save_hf carries."""
  model_path = (config.get("model") or {}).get("path") or ""
  tok_path = (config.get("tokenizer") or {}).get("path") or ""
  if model_path:
    dirs = [model_path]
  else:  # the built-in warm start: WORKDIR/base, or the config.warm_start.dir it reused
    warm = (config.get("warm_start") or {}).get("dir") or ""
    candidates = [os.path.join(workdir, "base")] + ([_expand(warm)] if warm else [])
    dirs = [next((d for d in candidates if os.path.exists(os.path.join(d, "tokenizer.model"))),
                 candidates[0])]
  if tok_path:
    dirs.append(tok_path)
  for d in dirs:
    if not os.path.exists(d):
      raise FileNotFoundError(f"{d}, which holds the tokenizer of the run in {workdir}, does "
                              "not exist; restore it to export.")
  return dirs


def export(workdir: str, out_dir: str, step: int | None = None, force: bool = False,
           dtype: str | None = None) -> str:
  """Writes checkpoint `step` (default: latest) of an rlx run as a Hugging Face model directory.

  dtype: of the tensors in the files (default: the run's param_dtype). Returns out_dir's path.
  """
  steps = checkpoint_steps(workdir)
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise CheckpointError(f"step {step} has no checkpoint in {workdir}/checkpoints; saved "
                          f"steps are {steps}.")
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}, expected one of {tuple(DTYPES)}.")
  out_dir = os.path.abspath(out_dir)
  ckpt = Checkpointer(workdir, async_save=False)
  try:
    meta = ckpt.read_meta(step)
  finally:
    ckpt.close()
  if not isinstance(meta.get("model"), dict):
    raise CheckpointError(f"Checkpoint {ckpt.directory}/{step} records no model config; it was "
                          "not written by rlx.")
  model_cfg = ModelConfig.from_dict(meta["model"])
  config = meta.get("config") or {}
  sources = tokenizer_sources(workdir, config)

  protected = [os.path.abspath(p) for p in [workdir, ckpt.directory] + sources]
  if out_dir in protected or out_dir.startswith(ckpt.directory + os.sep):
    raise ValueError(f"OUT_DIR {out_dir} is the run's workdir, checkpoints or base model; "
                     "pick a new directory.")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise FileExistsError(f"OUT_DIR {out_dir} is a file; expected a new or empty directory.")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
    raise FileExistsError(f"OUT_DIR {out_dir} is not empty; pass --force to overwrite it.")

  params = _read_params(workdir, step)
  hf.save_hf(model_cfg, params, out_dir, dtype=dtype, source_dir=sources[0])
  for extra in sources[1:]:  # config.tokenizer.path: a tokenizer file or directory
    _copy_tokenizer(extra, out_dir)
  _add_token_ids(out_dir, config)
  return out_dir


def _copy_tokenizer(path: str, out_dir: str) -> None:
  if os.path.isdir(path):
    for name in hf._SIDE_FILES:  # pylint: disable=protected-access
      if os.path.exists(os.path.join(path, name)):
        shutil.copyfile(os.path.join(path, name), os.path.join(out_dir, name))
  else:
    name = "tokenizer.json" if path.endswith(".json") else "tokenizer.model"
    shutil.copyfile(path, os.path.join(out_dir, name))


def _add_token_ids(out_dir: str, config: dict[str, Any]) -> None:
  """bos / eos / pad ids of the run's tokenizer that config.json lacks (generate() reads them).

  The tokenizer is loaded as the trainer loads it: the built-in warm start's sentencepiece
  model on its own, a Hugging Face model's with its directory's metadata.
  """
  if (config.get("model") or {}).get("path"):
    tok = load_tokenizer(out_dir)
  elif os.path.exists(os.path.join(out_dir, "tokenizer.model")):
    tok = Tokenizer.load(os.path.join(out_dir, "tokenizer.model"))
  else:
    return
  path = os.path.join(out_dir, "config.json")
  with open(path, encoding="utf-8") as f:
    cfg = json.load(f)
  for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id),
                     ("pad_token_id", tok.pad_id)):
    if cfg.get(key) is None and value is not None and value >= 0:
      cfg[key] = int(value)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(cfg, f, indent=2, sort_keys=True)


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    fail(message)


def fail(message: str):
  print(f"rlx: error: {message}", file=sys.stderr)
  sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
  parser = _Parser(prog="python -m rlx.export", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir", help="the --workdir of an rlx run")
  parser.add_argument("out_dir", help="the Hugging Face directory to write (new or empty)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                      help="tensor dtype in the files (default: the run's param_dtype)")
  parser.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
  args = parser.parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on optional files
  try:
    out = export(args.workdir, args.out_dir, step=args.step, force=args.force, dtype=args.dtype)
  except (CheckpointError, ValueError, OSError) as e:
    if os.environ.get("RLX_TRACEBACK"):
      raise
    fail(" ".join(str(e).split()))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  # Export is host work: leave the accelerators (perhaps training right now) alone.
  jax.config.update("jax_platforms", "cpu")
  sys.exit(main())
