"""Multi-process (multi-host) runs: jax.distributed set-up and small coordination helpers.

Every process runs the same program on its own devices; `jax.devices()` lists the devices of
all processes, so a Mesh built from it spans the whole job. Files are written by process 0
(`main_first`), logs come from process 0, and orbax writes checkpoints cooperatively.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

import jax
import numpy as np

T = TypeVar("T")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               timeout_s: int = 300) -> None:
  """Starts jax.distributed from explicit values, RLX_* environment variables, or (auto=True)
  JAX's cluster auto-detection (TPU pods, SLURM, ...). A no-op for one process."""
  coordinator_address = coordinator_address or os.environ.get("RLX_COORDINATOR_ADDRESS")
  if num_processes is None and "RLX_NUM_PROCESSES" in os.environ:
    num_processes = int(os.environ["RLX_NUM_PROCESSES"])
  if process_id is None and "RLX_PROCESS_ID" in os.environ:
    process_id = int(os.environ["RLX_PROCESS_ID"])
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise ValueError(f"coordinator_address={coordinator_address!r} needs num_processes and "
                       f"process_id (flags or RLX_NUM_PROCESSES / RLX_PROCESS_ID).")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must be in [0, num_processes="
                       f"{num_processes}).")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s)
  elif auto:
    jax.distributed.initialize()


def is_main() -> bool:
  return jax.process_index() == 0


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def main_first(fn: Callable[[], T], name: str) -> T:
  """Runs fn on process 0, then (after a barrier) on the others: for work that writes
  files the others then read from cache (data preparation, tokenizer, warm start)."""
  if jax.process_count() == 1:
    return fn()
  if is_main():
    out = fn()
    barrier(name)
    return out
  barrier(name)
  return fn()


def to_host(x) -> np.ndarray:
  """A global array as one numpy array on every process."""
  if jax.process_count() > 1 and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
