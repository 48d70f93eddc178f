"""Paged-KV sampler with continuous batching: the fast path behind `sampler_impl="paged"`.

    ro = generate(graphdef, params, prompts_BxP, prompt_lens_B, keys_B, sp=sp, pc=pc,
                  group_size=G, mesh=mesh)         # same Rollout as rlx.sampler.dense

Everything runs on device in one jitted call over a single state pytree (KV pool, page
allocator, slots, outputs) carried through `lax.while_loop`s and updated in place; the host
is not involved until the rollout is complete. One iteration:

  1. admit   (only when a slot is empty and a sequence waits): the next waiting sequences,
             in order, take the empty slots while the pool can hold their worst case. The
             first child admitted from a GRPO group allocates the group's prompt pages and
             prefills the prompt once (dense attention over the prompt, K/V written into
             the pages, groups batched `prefill_chunk` at a time); every child then shares
             the prompt's full pages (refcount += 1) and gets a copy of the partial last
             page -- the group's last child takes the group's own pages over instead.
  2. decode  one token for every slot: a fresh child samples token 0 from its prompt's
             last hidden state; the others feed their last token through the model, which
             writes its K/V into the slot's pages (a new page is popped when a page fills)
             and attends over them with `rlx.kernels.paged_attention`.
  3. release finished slots (stop token or max_new_tokens): their page references drop,
             pages that reach refcount 0 go back on the free stack, and the slot is empty
             for the next iteration's admission.

Once the queue is empty and the active sequences fit half the slots, the loop packs them to
the front and continues in a loop compiled for that narrower width (S/2, S/4, ...,
`slot_buckets` widths): the tail of a long-tailed batch does not pay for idle slots. These
are consecutive loops rather than a `lax.switch`, so the pool is never an operand of a
conditional (XLA would copy it).

Admission reserves each sequence's worst-case page count without allocating it: a sequence
is admitted only if `free pages - pages reserved by running sequences` covers its own
worst case, so a running sequence never finds the pool empty (no preemption, no deadlock,
never a write into a page it does not own); sequences that do not fit wait. If one
sequence (with its group's prompt) can never fit, `generate_unjitted` raises before
generating and names the minimum `num_pages`.

Token t of sequence b is drawn with `fold_in(keys_B[b], t)` and depends on nothing else,
so a sequence's result is the same in whatever slot, batch position or shard it runs, and
the same as the dense sampler's.

With a mesh whose batch axes ("data", "fsdp") hold more than one device, the whole loop
runs per device under `jax.shard_map`: each shard owns its slots, page pool (local page
ids) and allocator, and the contiguous block of sequences the batch sharding gives it.
Parameters enter replicated (P()): a data-parallel trainer's arrays are read as they are
(FSDP-sharded ones are all-gathered once per call, not per token).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec as P

from rlx import sharding as shd
from rlx.model import transformer
from rlx.sampler import allocator as alloc_lib
from rlx.sampler.paged_kv import Attention, DecodeContext, Groups, PrefillContext, layer_pages
from rlx.sampler.sampling import (Rollout, SamplingParams, is_stop, prompt_positions,
                                  sample_tokens)

ATTENTION_IMPLS = ("reference", "pallas", "interpret")
INTERPRET_FLAVOURS = ("auto", "tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  """Static settings of the paged sampler (hashable: a jit static argument).

  page_size: tokens per KV page.
  num_pages: pages per shard, including the reserved page 0; 0 = enough for every slot
    at its worst case (sequences then never wait for pages, only for slots).
  max_slots: sequences decoded at once per shard; 0 = one slot per local sequence. Fewer
    slots than sequences is continuous batching: finished sequences hand their slot to
    the next waiting one, which keeps a long-tailed batch busy with less work per step.
  attention_impl: "reference" (kernels' jnp reference, every backend), "pallas" (the
    Pallas kernel of this backend; the reference on CPU) or "interpret" (the Pallas
    kernel in interpret mode, for CPU tests).
  interpret_flavour: which Pallas kernel "interpret" runs: "auto" = the GPU flavour on
    GPUs, the TPU flavour elsewhere (it has no shape constraints).
  prefill_chunk: prompts prefilled per forward pass when groups start.
  slot_buckets: decode widths compiled: S, S/2, S/4, ... (this many). Once no sequence
    waits, the active ones are packed into the narrowest width that holds them, so the
    tail of a long-tailed batch (few sequences left) does not pay for idle slots.
  context_buckets: the "reference" attention reads page-table prefixes of 1/n, 2/n, ... of
    its width, the shortest that covers every slot's length (the Pallas kernels already
    stop at each sequence's length).
  cascade: GRPO groups attend to their prompt's shared full pages once per group in
    flight: the group's slots are folded into the query-head axis for the prefix
    (`rlx.kernels.cascade_attention`), each slot's own pages are attended per slot, and
    the two merge by log-sum-exp. Each shared prompt page is then read once per group and
    decode step instead of once per slot: a gain for the Pallas kernels on an accelerator
    with long prompts; with the "reference" attention on CPU it costs more than it saves
    (it gathers pages per row either way). Sliding-window layers keep plain attention.
  """

  page_size: int = 16
  num_pages: int = 0
  max_slots: int = 0
  attention_impl: str = "reference"
  interpret_flavour: str = "auto"
  prefill_chunk: int = 8
  slot_buckets: int = 4
  context_buckets: int = 4
  cascade: bool = False

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"PagedConfig: {msg}")

    need(isinstance(self.page_size, int) and self.page_size >= 1,
         f"page_size={self.page_size!r}, expected a positive int.")
    need(isinstance(self.num_pages, int) and (self.num_pages == 0 or self.num_pages >= 2),
         f"num_pages={self.num_pages!r}, expected 0 (auto) or >= 2 (page 0 is reserved).")
    need(isinstance(self.max_slots, int) and self.max_slots >= 0,
         f"max_slots={self.max_slots!r}, expected 0 (auto) or a positive int.")
    need(self.attention_impl in ATTENTION_IMPLS,
         f"attention_impl={self.attention_impl!r}, expected one of {ATTENTION_IMPLS}.")
    need(self.interpret_flavour in INTERPRET_FLAVOURS,
         f"interpret_flavour={self.interpret_flavour!r}, expected one of "
         f"{INTERPRET_FLAVOURS}.")
    for name in ("prefill_chunk", "slot_buckets", "context_buckets"):
      value = getattr(self, name)
      need(isinstance(value, int) and value >= 1, f"{name}={value!r}, expected a positive int.")
    need(isinstance(self.cascade, bool), f"cascade={self.cascade!r}, expected a bool.")


def _cdiv(a, b):
  return -(-a // b)


def pages_needed(prompt_len: int, max_new_tokens: int, page_size: int, group_size: int) -> int:
  """Pages (excluding page 0) that admitting one sequence may take, for a prompt length.

  A sequence stores K/V for prompt_len + max_new_tokens - 1 positions (its last token is
  never fed back). A child that is not its group's last also needs the group's prompt
  pages to exist, plus its own copy of a partial last prompt page.
  """
  total = _cdiv(prompt_len + max_new_tokens - 1, page_size)
  if group_size == 1:
    return total
  return _cdiv(prompt_len, page_size) + total - prompt_len // page_size


def min_num_pages(prompt_width: int, max_new_tokens: int, page_size: int,
                  group_size: int) -> int:
  """Smallest num_pages (with page 0) that can run any prompt of up to prompt_width tokens."""
  return 1 + max(pages_needed(n, max_new_tokens, page_size, group_size)
                 for n in range(1, prompt_width + 1))


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static sizes of one shard's sampler state."""

  num_seqs: int
  group: int
  prompt_width: int
  max_new: int
  page_size: int
  num_pages: int
  slots: int
  prefill_chunk: int
  widths: tuple[int, ...]  # decode widths, widest (= slots) first

  @property
  def num_groups(self) -> int:
    return self.num_seqs // self.group

  @property
  def pages_per_seq(self) -> int:  # page-table columns of a slot
    return _cdiv(self.prompt_width + self.max_new - 1, self.page_size)

  @property
  def prompt_pages(self) -> int:  # page-table columns of a group's prompt record
    return _cdiv(self.prompt_width, self.page_size)

  @classmethod
  def make(cls, num_seqs: int, group: int, prompt_width: int, sp: SamplingParams,
           pc: PagedConfig) -> "_Layout":
    t, p = sp.max_new_tokens, pc.page_size
    slots = min(pc.max_slots or num_seqs, num_seqs)
    minimum = min_num_pages(prompt_width, t, p, group)
    num_pages = pc.num_pages
    if num_pages == 0:
      per_slot = _cdiv(prompt_width + t - 1, p) + (1 if group > 1 else 0)
      num_pages = max(minimum, 1 + _cdiv(prompt_width, p) + slots * per_slot)
    elif num_pages < minimum:
      raise ValueError(
          f"PagedConfig.num_pages={num_pages} is too small: one sequence with a prompt of "
          f"up to {prompt_width} tokens and max_new_tokens={t} (page_size={p}"
          + (f", plus its group's shared prompt pages, group_size={group}" if group > 1
             else "")
          + f") needs {minimum - 1} pages besides the reserved page 0; set num_pages >= "
          f"{minimum} per shard.")
    widths = [slots]
    while len(widths) < pc.slot_buckets and widths[-1] > 1:
      widths.append(_cdiv(widths[-1], 2))
    return cls(num_seqs=num_seqs, group=group, prompt_width=prompt_width, max_new=t,
               page_size=p, num_pages=num_pages, slots=slots,
               prefill_chunk=min(pc.prefill_chunk, num_seqs // group), widths=tuple(widths))


# ----------------------------------------------------------------------------- state


@struct.dataclass
class SamplerStats:
  """Counters of one shard's run (leading axis = shard when sharded)."""

  iterations: jax.Array  # decode iterations (model forwards over all slots)
  slot_steps: jax.Array  # (slot, iteration) pairs that produced a token
  width_steps: jax.Array  # slot rows the decode forwards ran (sum of widths)
  prefill_chunks: jax.Array  # prompt prefill forward passes
  prompts_prefilled: jax.Array  # prompts prefilled (once per group)
  peak_pages: jax.Array  # most pages in use at once
  page_iters: jax.Array  # sum over iterations of pages in use
  stored_iters: jax.Array  # sum over iterations of K/V tokens stored (prompts once/group)
  alloc_failures: jax.Array  # page pops that found the pool empty (0 by construction)
  pages_at_end: jax.Array  # pages still referenced after the last sequence (0: no leak)
  num_slots: jax.Array
  page_size: jax.Array

  @classmethod
  def zeros(cls, slots: int, page_size: int) -> "SamplerStats":
    z = jnp.zeros((), jnp.int32)
    return cls(iterations=z, slot_steps=z, width_steps=z, prefill_chunks=z,
               prompts_prefilled=z, peak_pages=z,
               page_iters=jnp.zeros((), jnp.float32), stored_iters=jnp.zeros((), jnp.float32),
               alloc_failures=z, pages_at_end=z, num_slots=jnp.asarray(slots, jnp.int32),
               page_size=jnp.asarray(page_size, jnp.int32))

  def summary(self) -> dict[str, float]:
    """Host-side totals over shards: slot utilisation and KV held / KV stored."""
    s = jax.tree.map(lambda x: np.asarray(x, np.float64).reshape(-1), self)
    return {
        "iterations": float(s.iterations.max()),
        # Tokens per slot row computed (the decode width shrinks in the tail), and per slot
        # row of a fixed-width loop.
        "slot_utilisation": float(s.slot_steps.sum() / s.width_steps.sum()),
        "fixed_slot_utilisation": float(s.slot_steps.sum() / (s.iterations * s.num_slots).sum()),
        "peak_pages": float(s.peak_pages.sum()),
        "peak_kv_tokens": float((s.peak_pages * s.page_size).sum()),
        "kv_held_over_stored": float((s.page_iters * s.page_size).sum() / s.stored_iters.sum()),
        "prefill_chunks": float(s.prefill_chunks.sum()),
        "prompts_prefilled": float(s.prompts_prefilled.sum()),
        "alloc_failures": float(s.alloc_failures.sum()),
        "pages_at_end": float(s.pages_at_end.sum()),
    }


@struct.dataclass
class PagedState:
  """Everything the decode loop carries (one shard): KV pool, allocator, slots, outputs.

  The pool is one [Hkv, L * N, P, D] array: every layer's N pages on the page axis (layer
  l's page i at l * N + i; rlx.sampler.paged_kv.layer_pages). A layer is then an offset
  into one whole buffer that the kernels read and the scatters update in place -- nothing
  is sliced out per layer and step, and a traced layer index works, so the layers can run
  as one scan (model.scan_layers). Page tables and the allocator hold layer-local ids.
  """

  k: jax.Array  # [Hkv, L * N, P, D]; each layer's page 0 stays zero
  v: jax.Array
  alloc: alloc_lib.PageAllocator
  page_table: jax.Array  # i32[S, pages_per_seq]
  num_pages_row: jax.Array  # i32[S] page-table entries in use
  slot_seq: jax.Array  # i32[S] sequence in the slot
  slot_t: jax.Array  # i32[S] tokens sampled so far by that sequence
  active: jax.Array  # bool[S]
  fresh: jax.Array  # bool[S] admitted this iteration: samples token 0 from the prompt
  slot_reserve: jax.Array  # i32[S] pages the slot may still pop (worst case)
  cur_tok: jax.Array  # i32[S] last sampled token
  next_seq: jax.Array  # i32[] sequences [0, next_seq) have been admitted
  group_pages: jax.Array  # i32[num_groups, prompt_pages] a group's prompt pages
  group_hidden: jax.Array  # [num_groups, d_model] prompt's last hidden state
  group_live: jax.Array  # i32[num_groups] children holding a slot
  tokens: jax.Array  # i32[B, T]
  logprobs: jax.Array  # f32[B, T]
  lengths: jax.Array  # i32[B]
  stopped: jax.Array  # bool[B] ended with a stop token
  stats: SamplerStats

  @classmethod
  def init(cls, cfg, lay: _Layout, sp: SamplingParams) -> "PagedState":
    s, b = lay.slots, lay.num_seqs
    pool_shape = (cfg.num_kv_heads, cfg.num_layers * lay.num_pages, lay.page_size,
                  cfg.head_dim)
    zeros_i = functools.partial(jnp.zeros, dtype=jnp.int32)
    return cls(
        k=jnp.zeros(pool_shape, cfg.compute_dtype), v=jnp.zeros(pool_shape, cfg.compute_dtype),
        alloc=alloc_lib.PageAllocator.init(lay.num_pages),
        page_table=zeros_i((s, lay.pages_per_seq)), num_pages_row=zeros_i((s,)),
        slot_seq=zeros_i((s,)), slot_t=zeros_i((s,)), active=jnp.zeros((s,), bool),
        fresh=jnp.zeros((s,), bool), slot_reserve=zeros_i((s,)), cur_tok=zeros_i((s,)),
        next_seq=zeros_i(()), group_pages=zeros_i((lay.num_groups, lay.prompt_pages)),
        group_hidden=jnp.zeros((lay.num_groups, cfg.d_model), cfg.compute_dtype),
        group_live=zeros_i((lay.num_groups,)),
        tokens=jnp.full((b, lay.max_new), sp.pad_id, jnp.int32),
        logprobs=jnp.zeros((b, lay.max_new), jnp.float32), lengths=zeros_i((b,)),
        stopped=jnp.zeros((b,), bool), stats=SamplerStats.zeros(s, lay.page_size))


@struct.dataclass
class _Inputs:
  group_prompts: jax.Array  # i32[num_groups, Pw] left-padded
  group_lens: jax.Array  # i32[num_groups]
  keys: jax.Array  # key[B]
  forced_lengths: jax.Array | None  # i32[B] (debug) stop exactly after this many tokens


# ----------------------------------------------------------------------------- sampling


# ----------------------------------------------------------------------------- loop phases


def _prefill(model, st: PagedState, inp: _Inputs, lay: _Layout, first_group, count):
  """Prefills groups [first_group, first_group + count), prefill_chunk at a time."""
  c = lay.prefill_chunk

  def chunk(i, st: PagedState):
    groups = first_group + i * c + jnp.arange(c)
    ok = groups < first_group + count
    g = jnp.minimum(groups, lay.num_groups - 1)
    pos, valid = prompt_positions(inp.group_lens[g], lay.prompt_width)
    valid &= ok[:, None]
    ctx = PrefillContext(k=st.k, v=st.v, pages_CxM=st.group_pages[g], valid_CxT=valid,
                         per_layer=lay.num_pages)
    h, ctx = model.hidden(inp.group_prompts[g], pos, valid, ctx)
    hidden = st.group_hidden.at[jnp.where(ok, groups, lay.num_groups)].set(
        h[:, -1].astype(st.group_hidden.dtype), mode="drop")
    stats = st.stats.replace(prefill_chunks=st.stats.prefill_chunks + 1)
    return st.replace(k=ctx.k, v=ctx.v, group_hidden=hidden, stats=stats)

  return jax.lax.fori_loop(0, _cdiv(count, c), chunk, st)


def _admit(model, st: PagedState, inp: _Inputs, lay: _Layout) -> PagedState:
  """Moves waiting sequences, in order, into empty slots while their worst case fits."""
  s, g_size, p, t_max = lay.slots, lay.group, lay.page_size, lay.max_new
  n, ng = lay.num_pages, lay.num_groups
  empty = ~st.active
  i = jnp.arange(s, dtype=jnp.int32)
  cand = st.next_seq + i
  valid = (i < empty.sum()) & (cand < lay.num_seqs)
  seq = jnp.minimum(cand, lay.num_seqs - 1)
  g, j = seq // g_size, seq % g_size
  plen = inp.group_lens[g]
  first, last = j == 0, j == g_size - 1
  full = plen // p  # prompt pages shared as they are
  partial = (plen % p) > 0  # a partial last prompt page, copied per child
  own = _cdiv(plen + t_max - 1, p) - full  # worst-case pages of the child itself
  now = jnp.where(first, _cdiv(plen, p), 0) + (partial & ~last)
  future = own - partial
  need = jnp.where(valid, now + future, 0)
  budget = st.alloc.num_free - st.slot_reserve.sum()
  admitted = valid & (jnp.cumsum(need) <= budget)  # a prefix of the queue

  # New groups: allocate the prompt pages, prefill. They are a contiguous range of ids.
  new_group = admitted & first
  alloc, pages, _ = alloc_lib.allocate(st.alloc, jnp.where(new_group, _cdiv(plen, p), 0),
                                       lay.prompt_pages)
  group_pages = st.group_pages.at[jnp.where(new_group, g, ng)].set(pages, mode="drop")
  num_new = new_group.sum(dtype=jnp.int32)
  stats = st.stats.replace(prompts_prefilled=st.stats.prompts_prefilled + num_new)
  st = st.replace(alloc=alloc, group_pages=group_pages, stats=stats)
  st = _prefill(model, st, inp, lay, _cdiv(st.next_seq, g_size), num_new)

  # Forks: share the full prompt pages, copy the partial one (the last child takes the
  # group's own references over instead).
  prompt_row = st.group_pages[g]  # [S, prompt_pages]
  copy = admitted & partial & ~last
  alloc, copies, _ = alloc_lib.allocate(st.alloc, copy, 1)
  src = jnp.take_along_axis(prompt_row, jnp.minimum(full, lay.prompt_pages - 1)[:, None],
                            axis=1)[:, 0]
  dst = jnp.where(copy, copies[:, 0], n)

  # The same page copy in every layer: one gather and one scatter over [L * S] page ids.
  layers = jnp.arange(st.k.shape[1] // n)[:, None]
  src_all = layer_pages(src[None], layers, n).reshape(-1)
  dst_all = jnp.where(dst[None] < n, layer_pages(dst[None], layers, n),
                      st.k.shape[1]).reshape(-1)

  def copy_page(pool):
    return pool.at[:, dst_all].set(pool[:, src_all], mode="drop")

  k, v = copy_page(st.k), copy_page(st.v)
  cols_prompt = jnp.arange(lay.prompt_pages)[None, :]
  alloc = alloc_lib.share(alloc, prompt_row,
                          (admitted & ~last)[:, None] & (cols_prompt < full[:, None]))
  first_own = jnp.where(last, src, copies[:, 0])
  cols = jnp.arange(lay.pages_per_seq)[None, :]
  prompt_wide = jnp.pad(prompt_row, ((0, 0), (0, lay.pages_per_seq - lay.prompt_pages)))
  row = jnp.where(cols < full[:, None], prompt_wide,
                  jnp.where((cols == full[:, None]) & partial[:, None], first_own[:, None], 0))

  # The r-th admitted sequence takes the r-th empty slot.
  rank = jnp.cumsum(empty) - 1
  slot_of_rank = jnp.zeros((s,), jnp.int32).at[jnp.where(empty, rank, s)].set(i, mode="drop")
  dst_slot = jnp.where(admitted, slot_of_rank, s)

  def put(x, value):
    return x.at[dst_slot].set(value, mode="drop")

  return st.replace(
      k=k, v=v, alloc=alloc, page_table=put(st.page_table, row),
      num_pages_row=put(st.num_pages_row, full + partial), slot_seq=put(st.slot_seq, seq),
      slot_t=put(st.slot_t, 0), active=put(st.active, True), fresh=put(st.fresh, True),
      slot_reserve=put(st.slot_reserve, future),
      group_live=st.group_live.at[jnp.where(admitted, g, ng)].add(1, mode="drop"),
      next_seq=st.next_seq + admitted.sum(dtype=jnp.int32))


def _force_lengths(logits_SxV, t_S, forced_S, sp: SamplingParams):
  """Debug: forbid stop tokens before the forced length, force EOS at it."""
  ids = jnp.arange(logits_SxV.shape[-1])
  at_end = (t_S + 1 >= forced_S)[:, None]
  eos_only = jnp.where(ids == sp.eos_id, 0.0, -jnp.inf)
  return jnp.where(at_end, eos_only, jnp.where(is_stop(ids, sp)[None], -jnp.inf, logits_SxV))


def _decode(model, st: PagedState, inp: _Inputs, lay: _Layout, sp: SamplingParams,
            attention: Attention) -> PagedState:
  """One token for every active slot, then release the slots that finished."""
  s, p, n = st.active.shape[0], lay.page_size, lay.num_pages  # s: this decode's width
  rows = jnp.arange(s)
  seq, t = st.slot_seq, st.slot_t
  g = seq // lay.group
  decoding = st.active & ~st.fresh
  # Feed token t-1 at position plen + t - 1; its K/V goes to that position.
  pos = jnp.where(decoding, inp.group_lens[g] + t - 1, 0)
  col = pos // p
  grow = decoding & (col >= st.num_pages_row)
  alloc, new_pages, granted = alloc_lib.allocate(st.alloc, grow, 1)
  stall = grow & ~granted  # cannot happen (pages are reserved); wait rather than corrupt
  page_table = st.page_table.at[jnp.where(grow, rows, s), col].set(new_pages[:, 0],
                                                                    mode="drop")
  got = (grow & granted).astype(jnp.int32)
  writing = decoding & ~stall
  ctx = DecodeContext(
      k=st.k, v=st.v, page_table_SxM=page_table,
      lengths_S=jnp.where(writing, pos + 1, 0),
      write_page_S=jnp.where(writing, page_table[rows, col], n),
      write_slot_S=pos % p, max_pages=jnp.max(jnp.where(writing, col + 1, 1)),
      groups=(Groups(group_S=g, child_S=seq % lay.group, full_S=inp.group_lens[g] // p,
                      pages=st.group_pages, size=lay.group)
              if attention.cascade and lay.group > 1 else None),
      attention=attention, per_layer=n)
  h, ctx = model.hidden(st.cur_tok[:, None], pos[:, None], writing[:, None], ctx)
  h = jnp.where(st.fresh[:, None, None], st.group_hidden[g][:, None].astype(h.dtype), h)
  logits = model.logits(h)[:, 0]
  if inp.forced_lengths is not None:
    logits = _force_lengths(logits, t, inp.forced_lengths[seq], sp)
  keys = jax.vmap(jax.random.fold_in)(inp.keys[seq], t)
  tok, logp = sample_tokens(logits, keys, sp)

  sampled = st.active & ~stall
  out_row = jnp.where(sampled, seq, lay.num_seqs)
  tokens = st.tokens.at[out_row, t].set(tok, mode="drop")
  logprobs = st.logprobs.at[out_row, t].set(logp, mode="drop")
  stop = is_stop(tok, sp)
  finished = sampled & (stop | (t + 1 >= lay.max_new))
  fin_row = jnp.where(finished, seq, lay.num_seqs)
  lengths = st.lengths.at[fin_row].set(t + 1, mode="drop")
  stopped = st.stopped.at[fin_row].set(stop, mode="drop")
  slot_t = t + sampled
  num_pages_row = st.num_pages_row + got

  # Counters, taken before releasing (the moment this iteration holds the most).
  head_group = st.next_seq // lay.group
  forking = (jnp.arange(lay.num_groups) == head_group) & (st.next_seq % lay.group != 0)
  live = (st.group_live > 0) | forking
  stored = (jnp.where(live, inp.group_lens, 0).sum()
            + jnp.where(st.active, jnp.maximum(slot_t - 1, 0), 0).sum())
  used = lay.num_pages - 1 - alloc.num_free
  stats = st.stats
  stats = stats.replace(
      iterations=stats.iterations + 1, slot_steps=stats.slot_steps + sampled.sum(),
      width_steps=stats.width_steps + s,
      peak_pages=jnp.maximum(stats.peak_pages, used),
      page_iters=stats.page_iters + used, stored_iters=stats.stored_iters + stored,
      alloc_failures=stats.alloc_failures + stall.sum())

  # Release finished slots.
  held = finished[:, None] & (jnp.arange(lay.pages_per_seq)[None] < num_pages_row[:, None])
  alloc = alloc_lib.release(alloc, page_table, held)
  return st.replace(
      k=ctx.k, v=ctx.v, alloc=alloc,
      page_table=jnp.where(finished[:, None], 0, page_table),
      num_pages_row=jnp.where(finished, 0, num_pages_row),
      slot_t=slot_t, active=st.active & ~finished, fresh=jnp.zeros_like(st.fresh),
      slot_reserve=jnp.where(finished, 0, st.slot_reserve - got),
      cur_tok=jnp.where(sampled, tok, st.cur_tok),
      group_live=st.group_live.at[jnp.where(finished, g, lay.num_groups)].add(-1, mode="drop"),
      tokens=tokens, logprobs=logprobs, lengths=lengths, stopped=stopped, stats=stats)


_SLOT_FIELDS = ("page_table", "num_pages_row", "slot_seq", "slot_t", "active", "fresh",
                "slot_reserve", "cur_tok")


def _pack(st: PagedState, width: int) -> PagedState:
  """Moves the active slots to the front (stable) and keeps the first `width` slots."""
  active = st.active
  rank = jnp.where(active, jnp.cumsum(active) - 1, active.sum() + jnp.cumsum(~active) - 1)
  order = jnp.zeros_like(rank).at[rank].set(jnp.arange(rank.shape[0]))
  return st.replace(**{f: getattr(st, f)[order[:width]] for f in _SLOT_FIELDS})


def _generate_local(graphdef, params, prompts_BxP, prompt_lens_B, keys_B, forced_B, *,
                    lay: _Layout, sp: SamplingParams, attention: Attention):
  """One shard's sequences, start to finish: a full-width loop, then the narrower tails."""
  # q/k/v and gate/up as one matmul each: fewer kernels per decoded token, for one copy of
  # those matrices per call (transformer.fuse_projections).
  model = transformer.bind(graphdef, transformer.fuse_projections(params))
  inp = _Inputs(group_prompts=prompts_BxP[::lay.group].astype(jnp.int32),
                group_lens=prompt_lens_B[::lay.group].astype(jnp.int32), keys=keys_B,
                forced_lengths=None if forced_B is None else forced_B.astype(jnp.int32))
  max_iterations = lay.num_seqs * (lay.max_new + 1) + 1  # a guard; each iteration samples
  decode = functools.partial(_decode, model, inp=inp, lay=lay, sp=sp, attention=attention)
  narrower = lay.widths[1:] + (0,)

  # Phase 0, all slots: admission + decode until the queue is empty and the active
  # sequences fit the next narrower width.
  def cond(st: PagedState):
    busy = (st.next_seq < lay.num_seqs) | (st.active.sum() > narrower[0])
    return busy & (st.stats.iterations < max_iterations)

  def body(st: PagedState):
    can_admit = (~st.active).any() & (st.next_seq < lay.num_seqs)
    st = jax.lax.cond(can_admit, lambda x: _admit(model, x, inp, lay), lambda x: x, st)
    return decode(st)

  st = jax.lax.while_loop(cond, body, PagedState.init(model.cfg, lay, sp))
  # The tail: nobody waits any more; decode the remaining sequences at narrower widths
  # (separate loops, so the pool is never an operand of a conditional and stays in place).
  for width, next_width in zip(lay.widths[1:], narrower[1:]):
    st = jax.lax.while_loop(
        lambda st, w=next_width: (st.active.sum() > w) & (st.stats.iterations < max_iterations),
        decode, _pack(st, width))
  leaked = jnp.maximum(st.alloc.num_used, (st.alloc.refcount != 0).sum())
  st = st.replace(stats=st.stats.replace(pages_at_end=leaked))
  ro = Rollout(tokens=st.tokens, logprobs=st.logprobs, lengths=st.lengths,
               truncated=~st.stopped)
  return ro, st.stats


# ----------------------------------------------------------------------------- entry points


def _batch_axes(mesh: Mesh | None) -> tuple[str, ...]:
  if mesh is None:
    return ()
  return tuple(a for a in shd.BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)


def _check_concrete(prompts_BxP, prompt_lens_B, group_size: int) -> None:
  """Value checks, only on concrete (eager) inputs."""
  if isinstance(prompts_BxP, jax.core.Tracer) or isinstance(prompt_lens_B, jax.core.Tracer):
    return
  prompts, lens = np.asarray(prompts_BxP), np.asarray(prompt_lens_B)
  bad = np.flatnonzero((lens < 1) | (lens > prompts.shape[1]))
  if bad.size:
    raise ValueError(f"prompt_lens[{bad[0]}]={lens[bad[0]]}; expected 1 <= length <= prompt "
                     f"width {prompts.shape[1]}.")
  grouped = prompts.reshape(-1, group_size, prompts.shape[1])
  lens_g = lens.reshape(-1, group_size)
  bad = np.flatnonzero(np.any(grouped != grouped[:, :1], axis=(1, 2))
                       | np.any(lens_g != lens_g[:, :1], axis=1))
  if bad.size:
    raise ValueError(f"group_size={group_size}: rows {bad[0] * group_size}.."
                     f"{bad[0] * group_size + group_size - 1} do not share one prompt; "
                     "rollouts must be group-major (rows i*G..i*G+G-1 = prompt i).")


def generate_unjitted(graphdef, params, prompts_BxP, prompt_lens_B, keys_B,
                      sp: SamplingParams, pc: PagedConfig, *, group_size: int,
                      mesh: Mesh | None = None, forced_lengths_B=None,
                      return_stats: bool = False):
  """Samples up to sp.max_new_tokens per prompt with the paged sampler. Pure; jit it.

  Args:
    prompts_BxP, prompt_lens_B: left-padded prompts, group-major: rows i*G..i*G+G-1
      share prompt i (each prompt is prefilled once per shard).
    keys_B: one typed PRNG key per row; row b's t-th token uses fold_in(keys_B[b], t).
    sp, pc: sampling and paged-cache settings (static).
    group_size: G (static); 1 = no sharing.
    mesh: with more than one device on the batch axes, each shard samples its rows with
      its own slots and pages under shard_map; None = one shard.
    forced_lengths_B: debug/benchmark only: row b stops after exactly this many tokens
      (stop tokens are masked before, EOS forced at the end; log-probs then describe the
      forced distribution).
    return_stats: also return SamplerStats.

  Returns:
    Rollout (as rlx.sampler.dense), and SamplerStats with return_stats.
  """
  b, pw = prompts_BxP.shape
  if not isinstance(group_size, int) or group_size < 1 or b % group_size:
    raise ValueError(f"group_size={group_size!r} must be a positive int dividing the batch "
                     f"{b}.")
  axes = _batch_axes(mesh)
  shards = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if b % shards:
    raise ValueError(f"batch {b} must be a multiple of the {shards} batch shards of the mesh "
                     f"{dict(mesh.shape)}.")
  local = b // shards
  # Shard boundaries fall on multiples of `local`, groups on multiples of G: gcd-sized
  # runs of rows share a prompt and never straddle a shard.
  group = math.gcd(group_size, local)
  _check_concrete(prompts_BxP, prompt_lens_B, group_size)
  lay = _Layout.make(local, group, pw, sp, pc)
  fn = functools.partial(_generate_local, graphdef, lay=lay, sp=sp,
                         attention=Attention.make(pc))
  args = (params, prompts_BxP, prompt_lens_B, keys_B, forced_lengths_B)
  if shards == 1:
    ro, stats = fn(*args)
  else:
    spec = P(axes)
    per_shard = jax.shard_map(
        lambda *a: (lambda r, s: (r, jax.tree.map(lambda x: x[None], s)))(*fn(*a)),
        mesh=mesh, in_specs=(P(), spec, spec, spec, None if forced_lengths_B is None else spec),
        out_specs=(spec, spec), check_vma=False)
    ro, stats = per_shard(*args)
  return (ro, stats) if return_stats else ro


generate = jax.jit(generate_unjitted,
                   static_argnames=("graphdef", "sp", "pc", "group_size", "mesh",
                                    "return_stats"))
