r"""Exports a trained policy as a Hugging Face model directory.

  python -m rlx.export WORKDIR OUT_DIR [--step N] [--dtype bfloat16] [--force]
  python -m rlx.export WORKDIR OUT_DIR --peft [--base_model NAME]   (LoRA runs)

OUT_DIR gets config.json, model.safetensors (sharded above 5 GB) and the tokenizer files of
the run's base model (config.model.path, config.tokenizer.path, or the built-in warm start's
WORKDIR/base), so `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads the
policy of checkpoint N (default: the latest; a latest step directory without state/ is
refused rather than passed over), and `transformers.AutoTokenizer.from_pretrained(OUT_DIR)`
encodes prompts as the run did: the built-in warm start's sentencepiece model comes with a
converted tokenizer.json and a tokenizer_config.json that adds bos, a Hugging Face model with
its own tokenizer files. Only the params (and a LoRA run's frozen base) are read from the
checkpoint, on the host; no accelerator is needed. The files are written into a new
directory beside OUT_DIR and moved in at the end, so a failure (a full disk) leaves OUT_DIR
as it was. A mistake exits with one line `rlx: error: ...` (status 2); success prints
`wrote OUT_DIR (checkpoint step N)`.

A LoRA run (config.lora.rank > 0; its checkpoint holds the adapters as `params` and the
frozen base as `base`) is written merged by default: each adapted weight is W + alpha/r A @ B
(summed in f32), a plain Hugging Face model like a full-parameter run's. With --peft, OUT_DIR
instead gets a PEFT adapter directory (adapter_config.json, adapter_model.safetensors in f32
unless --dtype, and the tokenizer files), megabytes instead of the whole model, which
`peft.PeftModel.from_pretrained(base_model, OUT_DIR)` loads onto the base. Its
base_model_name_or_path is the run's base model directory (config.model.path, or the warm
start's base), or --base_model NAME (a directory or Hub id) when the base lives elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from rlx.checkpoint import Checkpointer, CheckpointError
from rlx.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from rlx.model import hf
from rlx.model.config import DTYPES, ModelConfig
from rlx.model.lora import LoRAConfig


def checkpoint_steps(workdir: str) -> list[int]:
  """The complete checkpoint steps of an rlx workdir, ascending."""
  return _steps(workdir)[0]


def _steps(workdir: str) -> tuple[list[int], list[int]]:
  """(complete checkpoint steps, step directories without state/), each ascending."""
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"workdir {workdir!r} does not exist.")
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise CheckpointError(f"{workdir} is not an rlx run: it has no checkpoints/ directory.")
  numbered = sorted(int(d) for d in os.listdir(directory) if d.isdigit())
  steps = [s for s in numbered if os.path.isdir(os.path.join(directory, str(s), "state"))]
  if not steps:
    raise CheckpointError(f"{directory} holds no complete checkpoint; train longer or pick "
                          "another workdir.")
  return steps, [s for s in numbered if s not in steps]


def pick_step(workdir: str, step: int | None = None) -> int:
  """The checkpoint step to export: `step`, or the latest. A step directory without state/
  (a damaged or partly copied checkpoint) is refused, also as the latest: exporting the
  step before it instead would be a silent surprise."""
  steps, broken = _steps(workdir)
  directory = os.path.join(workdir, "checkpoints")
  if step is None and broken and broken[-1] > steps[-1]:
    raise CheckpointError(f"the latest checkpoint {directory}/{broken[-1]} has no state/ (damaged "
                          f"or partly copied); pass --step {steps[-1]} to export the newest "
                          "complete one.")
  if step is None:
    return steps[-1]
  if step in broken:
    raise CheckpointError(f"{directory}/{step} has no state/ (damaged or partly copied); "
                          f"complete steps are {steps}.")
  if step not in steps:
    raise CheckpointError(f"step {step} has no checkpoint in {directory}; saved "
                          f"steps are {steps}.")
  return step


def _read_state(workdir: str, step: int, lora: LoRAConfig | None, need_base: bool) -> Any:
  """The TrainState fields export needs, as numpy (nothing else is read): `params`, and for
  a LoRA run (`lora` set) `base`, the frozen base params, when need_base."""
  path = os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  try:
    meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "params" not in tree:
      raise CheckpointError(f"{path} holds no params; it was not written by rlx.")
    has_base = bool(tree.get("base"))
    if lora is not None and not has_base:
      raise CheckpointError(f"{path} holds no frozen base (TrainState.base), yet the run's "
                            f"config.lora.rank is {lora.rank}; it is not a LoRA checkpoint.")
    if lora is None and has_base:
      raise CheckpointError(f"{path} holds LoRA adapters and a frozen base, yet the run's "
                            "config has no config.lora.rank > 0 saying how to apply them.")
    item = {k: tree[k] for k in (("params", "base") if need_base else ("params",))}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    out = ckptr.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                          partial_restore=True))
  except CheckpointError:
    raise
  except Exception as e:  # orbax raises several types for missing / corrupt files
    first = " ".join(str(e).split())[:200]
    raise CheckpointError(f"Could not read the params of checkpoint {path} "
                          f"({type(e).__name__}: {first}).") from None
  return out


def lora_config(config: dict[str, Any]) -> LoRAConfig | None:
  """The run's LoRAConfig from its recorded config (None: a full-parameter run)."""
  lc = config.get("lora") or {}
  if not isinstance(lc, dict) or not lc.get("rank"):
    return None
  targets = lc.get("targets", r"(q|k|v|o|gate|up|down)_proj$")
  try:
    return LoRAConfig(rank=lc["rank"], alpha=float(lc.get("alpha", 0)),
                      targets=(targets,) if isinstance(targets, str) else tuple(targets),
                      base_dtype=lc.get("base_dtype", ""))
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"The run's config.lora is not usable ({e}).") from None


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
           dtype: str | None = None, peft: bool = False, base_model: str | None = None) -> str:
  """Writes checkpoint `step` (default: latest) of an rlx run as a Hugging Face model directory.

  dtype: of the tensors in the files (default: the run's param_dtype; f32 for a PEFT
  adapter). A LoRA run is merged into its base, unless peft: then out_dir is a PEFT adapter
  directory whose base_model_name_or_path is base_model (default: the run's base model
  directory). Returns out_dir's path.
  """
  step = pick_step(workdir, step)
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
  lora = lora_config(config)
  if peft and lora is None:
    raise ValueError(f"--peft writes LoRA adapters, but the run in {workdir} trained all "
                     "parameters (config.lora.rank is 0); export it without --peft.")
  if base_model is not None and not peft:
    raise ValueError("--base_model names the base of a PEFT adapter; it needs --peft.")
  sources = tokenizer_sources(workdir, config)
  if peft and base_model is None:
    _check_base(sources[0], model_cfg)

  protected = [os.path.abspath(p) for p in [workdir, ckpt.directory] + sources]
  if out_dir in protected or out_dir.startswith(ckpt.directory + os.sep):
    raise ValueError(f"OUT_DIR {out_dir} is the run's workdir, checkpoints or base model; "
                     "pick a new directory.")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise FileExistsError(f"OUT_DIR {out_dir} is a file; expected a new or empty directory.")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
    raise FileExistsError(f"OUT_DIR {out_dir} is not empty; pass --force to overwrite it.")

  tokenizer = run_tokenizer(sources, config)
  state = _read_state(workdir, step, lora, need_base=lora is not None and not peft)
  # Written beside OUT_DIR and moved in at the end: a failure (a full disk) leaves OUT_DIR as
  # it was, and the same command can simply run again.
  with _staging(out_dir) as tmp:
    if peft:
      hf.save_peft_adapter(model_cfg, state["params"], lora, tmp, dtype=dtype or "float32",
                           base_model_name_or_path=base_model or os.path.abspath(sources[0]))
      for source in sources:
        _copy_tokenizer(source, tmp)
    else:
      if lora is None:
        hf.save_hf(model_cfg, state["params"], tmp, dtype=dtype, source_dir=sources[0])
      else:  # the merged model: W + alpha/r A @ B
        hf.save_hf(model_cfg, state["base"], tmp, dtype=dtype, source_dir=sources[0],
                   adapters=state["params"], lora_cfg=lora)
      for extra in sources[1:]:  # config.tokenizer.path: a tokenizer file or directory
        _copy_tokenizer(extra, tmp)
    _write_tokenizer_config(tokenizer, tmp)
    if not peft:
      _add_token_ids(tmp, tokenizer)
  return out_dir


def run_tokenizer(sources: list[str], config: dict[str, Any]) -> Tokenizer | HFTokenizer | None:
  """The run's tokenizer, loaded as the trainer loads it (rlx.experiment.setup): a Hugging
  Face model's with its directory's metadata, the built-in warm start's sentencepiece model
  on its own (None: the base directory holds no tokenizer.model)."""
  model_path = (config.get("model") or {}).get("path") or ""
  if model_path:
    return load_tokenizer((config.get("tokenizer") or {}).get("path") or model_path)
  path = os.path.join(sources[0], "tokenizer.model")
  return Tokenizer.load(path) if os.path.exists(path) else None


def _write_tokenizer_config(tokenizer, out_dir: str) -> None:
  """Tokenizer files that make `AutoTokenizer.from_pretrained(out_dir)` encode as the run did.

  A bare sentencepiece tokenizer (the warm start's, or a config.tokenizer.path `.model`) gets
  a converted tokenizer.json and a tokenizer_config.json that adds bos (Tokenizer.
  save_pretrained), replacing tokenizer files copied from the model directory, which the run
  did not use. A tokenizer.json tokenizer is written back as rlx read it: its post-processor
  then adds the bos / eos that tokenizer_config.json's add_bos_token / add_eos_token ask for,
  which transformers versions that ignore those flags beside a tokenizer.json (5.x) would
  otherwise leave out. A sentencepiece model with Hugging Face metadata keeps its files.
  """
  if isinstance(tokenizer, HFTokenizer):
    tokenizer.save(out_dir)
    return
  if not isinstance(tokenizer, Tokenizer) or tokenizer.meta is not None:
    return
  for name in hf._SIDE_FILES:  # pylint: disable=protected-access
    if name != "generation_config.json" and os.path.exists(os.path.join(out_dir, name)):
      os.remove(os.path.join(out_dir, name))
  tokenizer.save_pretrained(out_dir)


def _missing_ancestor(path: str) -> str | None:
  """The outermost directory of `path` (itself included) that does not exist yet."""
  missing = None
  while path and not os.path.lexists(path):
    missing, path = path, os.path.dirname(path)
  return missing


@contextlib.contextmanager
def _staging(out_dir: str):
  """A new directory beside out_dir to write into; its files become out_dir's on success.
  On any failure it is removed (with the parents it needed) and out_dir is untouched; an
  OSError becomes one that names out_dir."""
  parent = os.path.dirname(out_dir)
  created = _missing_ancestor(parent)
  tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.rlx-export-{os.getpid()}-"
                             f"{secrets.token_hex(4)}")
  try:
    os.makedirs(parent, exist_ok=True)
    os.mkdir(tmp)  # with the umask's permissions, as a directory made by hand
    yield tmp
    _publish(tmp, out_dir)
  except BaseException as e:
    shutil.rmtree(tmp, ignore_errors=True)
    if created:
      shutil.rmtree(created, ignore_errors=True)
    if isinstance(e, OSError):
      raise OSError(f"Could not write {out_dir} ({e.strerror or e}); nothing was written "
                    "there: free space (or fix permissions) and run the same command again.") \
          from None
    raise


_WEIGHTS = ("config.json", "model.safetensors.index.json", "adapter_config.json")


def _publish(tmp: str, out_dir: str) -> None:
  """Makes tmp's files out_dir's: a rename when out_dir is new or empty; for --force into a
  non-empty out_dir, its files of the kinds written (weights, tokenizer) are replaced and the
  rest kept."""
  if not os.path.lexists(out_dir) or (not os.path.islink(out_dir) and not os.listdir(out_dir)):
    os.replace(tmp, out_dir)
    return
  written = set(os.listdir(tmp))
  stale = set(hf._SIDE_FILES)  # pylint: disable=protected-access
  if "model.safetensors" in written or "model.safetensors.index.json" in written:
    stale |= {n for n in os.listdir(out_dir) if n.endswith(".safetensors")}
    stale.add("model.safetensors.index.json")
  if "adapter_config.json" in written:
    stale |= {n for n in os.listdir(out_dir)
              if n.startswith("adapter_model") and n.endswith(".safetensors")}
  for name in (stale | written) & set(os.listdir(out_dir)):
    if os.path.isfile(os.path.join(out_dir, name)):
      os.remove(os.path.join(out_dir, name))
  for name in written:
    os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
  os.rmdir(tmp)


_SHAPE_FIELDS = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                 "mlp_dim", "tie_embeddings")


def _check_base(base_dir: str, model_cfg: ModelConfig) -> None:
  """A PEFT adapter names its base: that directory must hold the model that was trained."""
  try:
    theirs = hf.config_from_hf(hf.read_config(base_dir))
  except (ValueError, OSError) as e:
    raise ValueError(f"The run's base model {base_dir} is not a Hugging Face model rlx reads "
                     f"({' '.join(str(e).split())}); pass --base_model.") from None
  diffs = [f"{k} {getattr(theirs, k)!r} vs {getattr(model_cfg, k)!r}" for k in _SHAPE_FIELDS
           if getattr(theirs, k) != getattr(model_cfg, k)]
  if diffs:
    raise ValueError(f"The run's base model {base_dir} is not the model in the checkpoint "
                     f"({'; '.join(diffs[:3])}); pass --base_model.")


def _copy_tokenizer(path: str, out_dir: str) -> None:
  if os.path.isdir(path):
    for name in hf._SIDE_FILES:  # pylint: disable=protected-access
      if os.path.exists(os.path.join(path, name)):
        shutil.copyfile(os.path.join(path, name), os.path.join(out_dir, name))
  else:
    name = "tokenizer.json" if path.endswith(".json") else "tokenizer.model"
    shutil.copyfile(path, os.path.join(out_dir, name))


def _add_token_ids(out_dir: str, tok) -> None:
  """bos / eos / pad ids of the run's tokenizer that config.json lacks (generate() reads them)."""
  if tok is None:
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
                      help="tensor dtype in the files (default: the run's param_dtype; "
                      "float32 for --peft adapters)")
  parser.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
  parser.add_argument("--peft", action="store_true",
                      help="LoRA runs: write a PEFT adapter directory (adapter_config.json + "
                      "adapter_model.safetensors + tokenizer) instead of the merged model")
  parser.add_argument("--base_model", default=None, metavar="NAME",
                      help="with --peft: the adapter's base_model_name_or_path (a directory or "
                      "Hub id; default: the run's base model directory)")
  args = parser.parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on optional files
  try:
    step = pick_step(args.workdir, args.step)
    out = export(args.workdir, args.out_dir, step=step, force=args.force, dtype=args.dtype,
                 peft=args.peft, base_model=args.base_model)
  except (CheckpointError, ValueError, OSError) as e:
    if os.environ.get("RLX_TRACEBACK"):
      raise
    fail(" ".join(str(e).split()))
  print(f"wrote {out} (checkpoint step {step})")
  return 0


if __name__ == "__main__":
  # Export is host work: leave the accelerators (perhaps training right now) alone.
  jax.config.update("jax_platforms", "cpu")
  sys.exit(main())
