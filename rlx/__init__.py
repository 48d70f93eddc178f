"""rlx: sample-efficient RL post-training of language models in JAX.

The public API (what the notebooks and README use); names load lazily, so `import rlx` stays
cheap and `rlx.kernels` can be imported without the trainer's dependencies:

  rlx.default_config()                 every config key at its default (rlx.configs.defaults)
  rlx.load_config("arith", arg="")     an experiment's get_config(arg): a file path, or the name
                                       of one shipped in experiments/ (installed as
                                       rlx.experiments)
  rlx.with_overrides(config, {"rl.group_size": 8})   dotted-key overrides, keys checked
  rlx.run(config, workdir)             train (resumes from the workdir's last checkpoint)
  rlx.build(config, workdir)           everything before the first step (for benchmarks)
  rlx.dry_run(config, workdir)         the per-device memory plan, without compiling
  rlx.read_metrics(workdir)            metrics.jsonl as one dict per step (workdir or file)
  rlx.read_checkpoint(workdir, step)   a saved TrainState as numpy arrays
  rlx.load_hf / rlx.save_hf            Hugging Face safetensors in and out
  rlx.init_params(model_cfg, seed)     (graphdef, params) of a fresh model
  rlx.graphdef_for(model_cfg)          the graphdef the samplers need for loaded params
  rlx.load_tokenizer                   sentencepiece .model or tokenizer.json (+ chat template)
  rlx.generate_dense / generate_paged  the samplers (same Rollout output)
  rlx.SamplingParams, rlx.PagedConfig, rlx.ModelConfig
  rlx.make_report(workdir)             PNG plots + summary (python -m rlx.report)
  rlx.export.export(workdir, out_dir)  a trained policy as a Hugging Face directory
                                       (python -m rlx.export WORKDIR OUT_DIR [--step N])
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "default_config": ("rlx.configs", "defaults"),
    # Not "train": that name is the rlx.train module (the pure step).
    "run": ("rlx.trainer", "run"),
    "with_overrides": ("rlx.configs", "with_overrides"),
    "init_params": ("rlx.model.transformer", "init_params"),
    "graphdef_for": ("rlx.model.transformer", "graphdef_for"),
    "build": ("rlx.trainer", "build"),
    "dry_run": ("rlx.trainer", "dry_run"),
    "read_metrics": ("rlx.metrics", "read_metrics"),
    "read_checkpoint": ("rlx.checkpoint", "read_arrays"),
    "load_hf": ("rlx.model.hf", "load_hf"),
    "save_hf": ("rlx.model.hf", "save_hf"),
    "load_tokenizer": ("rlx.data.tokenizer", "load_tokenizer"),
    "generate_dense": ("rlx.sampler.dense", "generate"),
    "generate_paged": ("rlx.sampler.paged", "generate"),
    "SamplingParams": ("rlx.sampler.sampling", "SamplingParams"),
    "PagedConfig": ("rlx.sampler.paged", "PagedConfig"),
    "ModelConfig": ("rlx.model.config", "ModelConfig"),
    "make_report": ("rlx.report", "make_report"),
}

__all__ = sorted(_EXPORTS) + ["load_config", "__version__"]


def load_config(path: str, arg: str = ""):
  """`get_config(arg)` of an experiment (what --config=path:arg gives the CLI).

  path: a config file, or the name of a shipped experiment ("arith", "hf_rl"), which works
  from a pip install too (experiments/ is installed as rlx.experiments); found by the rule
  --config follows (rlx.config_file.find). A missing one is a FileNotFoundError.
  """
  from rlx import config_file  # pylint: disable=g-import-not-at-top
  return config_file.load(path, arg)


def __getattr__(name: str):
  if name in _EXPORTS:
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'rlx' has no attribute {name!r}")
