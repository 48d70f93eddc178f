"""Page allocator for the paged KV cache: refcounts plus a free stack, fully vectorised.

Pages are integer ids in [0, N). Page 0 is reserved: it is never on the free stack, never
handed out and its refcount stays 0, so page-table entries of 0 mean "no page" and reads
through them (clipped by the attention kernels) see finite zeros.

    alloc = PageAllocator.init(N)
    alloc, pages_RxM, granted_R = allocate(alloc, counts_R, max_count=M)   # pop pages
    alloc = share(alloc, pages, mask)                                      # refcount += 1
    alloc = release(alloc, pages, mask)                                    # refcount -= 1

Every operation serves a whole batch of requests at once: allocation pops from the top of
the stack at offsets given by an exclusive cumsum of the request sizes, release scatter-adds
-1 per reference (duplicates count) and pushes the pages that reached 0 with a cumsum over
the pool. Nothing loops over sequences or pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class PageAllocator:
  refcount: jax.Array  # i32[N] references held (page tables and prompt records)
  free_stack: jax.Array  # i32[N]; free_stack[:num_free] are the free page ids, top last
  num_free: jax.Array  # i32[]

  @classmethod
  def init(cls, num_pages: int) -> "PageAllocator":
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages}; expected >= 2 (page 0 is reserved).")
    # Top of the stack is the end: pops hand out 1, 2, 3, ... first.
    stack = jnp.zeros((num_pages,), jnp.int32).at[:num_pages - 1].set(
        jnp.arange(num_pages - 1, 0, -1, dtype=jnp.int32))
    return cls(refcount=jnp.zeros((num_pages,), jnp.int32), free_stack=stack,
               num_free=jnp.asarray(num_pages - 1, jnp.int32))

  @property
  def num_pages(self) -> int:
    return self.refcount.shape[0]

  @property
  def num_used(self):
    return self.num_pages - 1 - self.num_free


def allocate(alloc: PageAllocator, counts_R, max_count: int):
  """Pops counts_R[r] fresh pages (refcount 1) for every request r, in request order.

  Requests are granted in order while they fit; the first one that does not fit and all
  after it get nothing (never a partial or duplicated page). Returns
  (alloc, pages i32[R, max_count] with 0 in unused entries, granted bool[R]).
  """
  n = alloc.num_pages
  counts = jnp.minimum(jnp.asarray(counts_R, jnp.int32), max_count)
  ends = jnp.cumsum(counts)
  granted = ends <= alloc.num_free
  counts = jnp.where(granted, counts, 0)
  starts = jnp.cumsum(counts) - counts  # exclusive: pages already popped before r
  j = jnp.arange(max_count, dtype=jnp.int32)[None, :]
  take = j < counts[:, None]
  stack_pos = alloc.num_free - 1 - (starts[:, None] + j)
  pages = jnp.where(take, alloc.free_stack[jnp.clip(stack_pos, 0, n - 1)], 0)
  refcount = alloc.refcount.at[jnp.where(take, pages, n)].add(1, mode="drop")
  return (alloc.replace(refcount=refcount, num_free=alloc.num_free - counts.sum()), pages,
          granted)


def share(alloc: PageAllocator, pages, mask) -> PageAllocator:
  """Adds one reference to every pages[mask] entry (any shape; page 0 entries ignored)."""
  n = alloc.num_pages
  idx = jnp.where(mask & (pages > 0), pages, n).reshape(-1)
  return alloc.replace(refcount=alloc.refcount.at[idx].add(1, mode="drop"))


def release(alloc: PageAllocator, pages, mask) -> PageAllocator:
  """Drops one reference per pages[mask] entry; pages reaching 0 go back on the stack."""
  n = alloc.num_pages
  idx = jnp.where(mask & (pages > 0), pages, n).reshape(-1)
  refcount = alloc.refcount.at[idx].add(-1, mode="drop")
  freed = (alloc.refcount > 0) & (refcount == 0)
  slot = alloc.num_free + jnp.cumsum(freed) - 1
  stack = alloc.free_stack.at[jnp.where(freed, slot, n)].set(
      jnp.arange(n, dtype=jnp.int32), mode="drop")
  return alloc.replace(refcount=refcount, free_stack=stack,
                       num_free=alloc.num_free + freed.sum(dtype=jnp.int32))
