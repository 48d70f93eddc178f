"""Page allocator: invariants under random fork / append / release sequences.

A host-side model keeps every sequence's page list; after each (batched, jitted) operation
the device allocator must agree with it: refcounts equal the page-table references, the
free stack holds exactly the unreferenced pages, free + used = pages - 1, page 0 is never
handed out, and releasing everything returns every page.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.sampler import allocator as al

NUM_PAGES = 24
REQUESTS = 4  # requests per batched call
MAX_PAGES = 3  # pages per allocation request
ROW = 12  # page-list width in share / release calls

allocate = jax.jit(functools.partial(al.allocate, max_count=MAX_PAGES))
share = jax.jit(al.share)
release = jax.jit(al.release)


def padded(lists):
  """Page lists -> ([REQUESTS, ROW] pages, mask)."""
  pages = np.zeros((REQUESTS, ROW), np.int32)
  for r, lst in enumerate(lists):
    pages[r, :len(lst)] = lst
  return jnp.asarray(pages), jnp.asarray(pages > 0)


def check(alloc, seqs):
  refcount = np.asarray(alloc.refcount)
  num_free = int(alloc.num_free)
  stack = np.asarray(alloc.free_stack)[:num_free]
  expected = np.zeros(NUM_PAGES, np.int64)
  for pages in seqs.values():
    np.add.at(expected, pages, 1)
  np.testing.assert_array_equal(refcount, expected)
  assert expected[0] == 0 and refcount[0] == 0, "page 0 was handed out"
  assert len(set(stack.tolist())) == num_free, f"duplicate free pages {sorted(stack)}"
  assert 0 not in stack
  assert set(stack.tolist()) == set(np.flatnonzero(refcount == 0)) - {0}
  assert num_free + int((refcount > 0).sum()) == NUM_PAGES - 1
  assert int(alloc.num_used) == NUM_PAGES - 1 - num_free


def run_random_ops(seed: int, steps: int):
  rng = np.random.default_rng(seed)
  alloc = al.PageAllocator.init(NUM_PAGES)
  seqs: dict[int, list[int]] = {}
  next_id = 0
  for _ in range(steps):
    op = rng.choice(["new", "fork", "append", "release"], p=[0.3, 0.25, 0.25, 0.2])
    live = list(seqs)
    if op == "new" or not live:
      counts = rng.integers(0, MAX_PAGES + 1, REQUESTS)
      free_before = int(alloc.num_free)
      alloc, pages, granted = allocate(alloc, jnp.asarray(counts, jnp.int32))
      pages, granted = np.asarray(pages), np.asarray(granted)
      expect_granted = np.cumsum(counts) <= free_before
      np.testing.assert_array_equal(granted, expect_granted)
      for r in range(REQUESTS):
        got = pages[r][pages[r] > 0].tolist()
        assert len(got) == (counts[r] if granted[r] else 0)
        if got:
          seqs[next_id] = got
          next_id += 1
    elif op == "fork":
      # Children share the parent's full pages and get one fresh page for the copied
      # partial page (as a GRPO fork does).
      parents = rng.choice(live, size=min(len(live), REQUESTS), replace=True)
      shared = [seqs[p][:-1] for p in parents]
      copies = np.ones(len(parents), np.int32)
      counts = np.zeros(REQUESTS, np.int32)
      counts[:len(parents)] = copies
      alloc, pages, granted = allocate(alloc, jnp.asarray(counts))
      pages, granted = np.asarray(pages), np.asarray(granted)
      granted_lists = [shared[r] for r in range(len(parents)) if granted[r]]
      alloc = share(alloc, *padded(granted_lists))
      for r in range(len(parents)):
        if granted[r]:
          seqs[next_id] = shared[r] + [int(pages[r, 0])]
          next_id += 1
    elif op == "append":
      targets = rng.choice(live, size=min(len(live), REQUESTS), replace=False)
      counts = np.zeros(REQUESTS, np.int32)
      counts[:len(targets)] = 1
      alloc, pages, granted = allocate(alloc, jnp.asarray(counts))
      pages, granted = np.asarray(pages), np.asarray(granted)
      for r, s in enumerate(targets):
        if granted[r] and len(seqs[s]) < ROW:
          seqs[s].append(int(pages[r, 0]))
        elif granted[r]:  # row full: give the page straight back
          alloc = release(alloc, *padded([[int(pages[r, 0])]]))
    else:
      # Several sequences at once, often siblings: shared pages drop several refs in one
      # call and must be freed exactly once.
      victims = rng.choice(live, size=min(len(live), int(rng.integers(1, REQUESTS + 1))),
                           replace=False)
      alloc = release(alloc, *padded([seqs[v] for v in victims]))
      for v in victims:
        del seqs[v]
    check(alloc, seqs)
  # Everything finishes: no page may leak.
  while seqs:
    batch = list(seqs)[:REQUESTS]
    alloc = release(alloc, *padded([seqs[v] for v in batch]))
    for v in batch:
      del seqs[v]
    check(alloc, seqs)
  assert int(alloc.num_free) == NUM_PAGES - 1
  assert not np.asarray(alloc.refcount).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_fork_append_release(seed):
  run_random_ops(seed, steps=120)


def test_allocation_is_all_or_nothing_in_order():
  alloc = al.PageAllocator.init(6)  # pages 1..5 free
  alloc, pages, granted = allocate(alloc, jnp.asarray([2, 0, 3, 1], jnp.int32))
  np.testing.assert_array_equal(np.asarray(granted), [True, True, True, False])
  pages = np.asarray(pages)
  handed = sorted(pages[pages > 0].tolist())
  assert handed == [1, 2, 3, 4, 5]
  assert int(alloc.num_free) == 0
  # Nothing left: a request waits (not granted), nothing changes.
  alloc2, pages2, granted2 = allocate(alloc, jnp.asarray([1, 0, 0, 0], jnp.int32))
  assert not bool(granted2[0]) and not np.asarray(pages2).any()
  np.testing.assert_array_equal(np.asarray(alloc2.refcount), np.asarray(alloc.refcount))


def test_init_rejects_pool_without_usable_pages():
  with pytest.raises(ValueError, match="num_pages=1"):
    al.PageAllocator.init(1)
