"""Pallas kernels for rlx (installed as ``rlx.kernels``).

Public API:
  paged_attention            decode attention over a paged KV cache (impl switch)
  paged_attention_reference  the plain-jnp reference, returns (out, lse)
  cascade_paged_attention    shared-prefix (GRPO group) paged attention
  group_prefix_attention     its prefix half: a group's queries over its prompt pages, once
  merge_attention_states     log-sum-exp merge of two partial attentions
"""

import sys as _sys

if __name__ == "kernels":
  # Imported as a top-level `kernels`: the repository root is on sys.path (`python -m pytest`,
  # a notebook or `python -m` started there) and something asked for another project's
  # `kernels`, e.g. transformers >= 5.25 importing Hugging Face's `kernels` package. This
  # directory is rlx.kernels only, so hand the import to the next `kernels` on sys.path.
  import importlib.machinery as _machinery
  import importlib.util as _util
  import os as _os

  _root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
  _rest = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
  _spec = _machinery.PathFinder.find_spec("kernels", _rest)
  if _spec is None or _spec.loader is None:
    raise ModuleNotFoundError(
        "No module named 'kernels' outside this repository: its kernels/ directory is the "
        "package rlx.kernels (import rlx.kernels).", name="kernels")
  _module = _util.module_from_spec(_spec)
  _sys.modules[__name__] = _module  # the import statement returns what is here after this
  _spec.loader.exec_module(_module)
else:
  from .cascade_attention import cascade_paged_attention
  from .cascade_attention import group_prefix_attention
  from .cascade_attention import merge_attention_states
  from .paged_attention import IMPLS
  from .paged_attention import paged_attention
  from .paged_attention import paged_attention_reference

  __all__ = [
      "IMPLS",
      "cascade_paged_attention",
      "group_prefix_attention",
      "merge_attention_states",
      "paged_attention",
      "paged_attention_reference",
  ]
