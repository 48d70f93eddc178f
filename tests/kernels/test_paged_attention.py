"""Paged decode attention: reference vs a numpy loop, Pallas kernels vs reference.

The Pallas kernels run in interpret mode on CPU (TPU flavour also under the
strict ``pltpu.InterpretParams`` interpreter in a few cases). The case table
covers every value of each axis (page size 8/16/32, head_dim 64/128, GQA ratio
1/4/7, f32/bf16/mixed, soft cap, sliding window, block and split sizes)
without the cartesian product. Every case uses a poisoned pool: page 0, unused
slots, unused pages and unused page-table entries (some out of range) hold NaN
or garbage, and the batch always has lengths 0, 1, a page multiple and the max.
"""

import dataclasses

import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.kernels import paged_attention
from rlx.kernels import paged_attention_reference

# (output atol/rtol, lse atol) per q dtype: bf16 outputs are rounded to bf16
# (2**-8 relative) and the kernels feed bf16 probabilities to the P @ V matmul.
# f32 holds on every backend because f32 inputs get full-f32 matmuls
# (Precision.HIGHEST) in the reference and the kernels -- without it XLA and
# Triton use TF32 on NVIDIA GPUs (errors ~1e-3).
TOLERANCES = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 1e-4)}
# Compiled kernels on real hardware: a different summation order (splits,
# blocks) than the reference; f32 must still be f32-accurate (TF32 would be
# ~1e-3), bf16 as above plus bf16 MMA inputs.
COMPILED_TOLERANCES = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  page_size: int
  head_dim: int
  num_kv_heads: int
  group: int  # Hq // Hkv
  pages_per_seq: int
  dtype: type = jnp.float32  # q dtype
  kv_dtype: type | None = None  # defaults to dtype
  soft_cap: float | None = None
  sliding_window: int | None = None
  q_scale: float = 1.0  # > 1 makes logits large enough for the cap to matter
  tpu_pages_per_block: int | None = None
  gpu_pages_per_block: int | None = None
  gpu_num_splits: int | None = None


CASES = [
    Case("p8_d64_mha_f32", 8, 64, 2, 1, 4, tpu_pages_per_block=1,
         gpu_pages_per_block=2, gpu_num_splits=2),
    Case("p16_d128_gqa4_bf16", 16, 128, 2, 4, 3, dtype=jnp.bfloat16),
    Case("p32_d64_gqa7_f32", 32, 64, 1, 7, 3, tpu_pages_per_block=2,
         gpu_pages_per_block=1, gpu_num_splits=3),
    Case("p16_d64_gqa4_softcap", 16, 64, 2, 4, 4, soft_cap=5.0, q_scale=4.0,
         tpu_pages_per_block=2, gpu_pages_per_block=1, gpu_num_splits=2),
    Case("p8_d128_gqa7_window_bf16", 8, 128, 1, 7, 5, dtype=jnp.bfloat16,
         sliding_window=13, tpu_pages_per_block=1, gpu_pages_per_block=2,
         gpu_num_splits=2),
    Case("p32_d128_mha_mixed_cap_window", 32, 128, 2, 1, 2,
         kv_dtype=jnp.bfloat16, soft_cap=30.0, sliding_window=40, q_scale=3.0),
]


def make_inputs(case: Case, seed: int = 0, lengths=None):
  """Builds a poisoned page pool and returns (inputs, dense per-sequence K/V)."""
  rng = np.random.default_rng(seed)
  P, pps = case.page_size, case.pages_per_seq
  max_len = P * pps
  if lengths is None:
    lengths = [0, 1, P * max(1, pps - 1), max_len, int(rng.integers(2, max_len))]
  lengths = np.asarray(lengths, np.int32)
  batch, num_kv, D = len(lengths), case.num_kv_heads, case.head_dim
  num_q = num_kv * case.group
  kv_dtype = case.kv_dtype or case.dtype

  # Page 0 is never used (poisoned); sequences 2 and 3 share their first page,
  # which is full for both.
  page_table = np.zeros((batch, pps), np.int32)
  next_page = 1
  for b, length in enumerate(lengths):
    for j in range(-(-int(length) // P)):
      if b == 3 and j == 0 and lengths[2] >= P:
        page_table[b, j] = page_table[2, 0]
      else:
        page_table[b, j] = next_page
        next_page += 1
  num_pages = next_page + 2  # two spare, never-used pages
  k_pool = np.full((num_kv, num_pages, P, D), np.nan, np.float32)
  v_pool = np.full((num_kv, num_pages, P, D), np.nan, np.float32)
  dense_k, dense_v = [], []
  for b, length in enumerate(lengths):
    k_seq = rng.standard_normal((num_kv, max(int(length), 0), D)).astype(np.float32)
    v_seq = rng.standard_normal((num_kv, max(int(length), 0), D)).astype(np.float32)
    if b == 3 and lengths[2] >= P:  # shared first page: same tokens as seq 2
      k_seq[:, :P], v_seq[:, :P] = dense_k[2][:, :P], dense_v[2][:, :P]
    for t in range(int(length)):
      k_pool[:, page_table[b, t // P], t % P] = k_seq[:, t]
      v_pool[:, page_table[b, t // P], t % P] = v_seq[:, t]
    dense_k.append(k_seq)
    dense_v.append(v_seq)
  # Unused page-table entries: NaN pages (0, spares) and out-of-range garbage.
  garbage = np.array([0, num_pages - 1, -3, num_pages + 7], np.int32)
  for b, length in enumerate(lengths):
    used = -(-int(length) // P)
    page_table[b, used:] = garbage[(np.arange(pps - used) + b) % len(garbage)]
  # Infinities as well as NaN in the spare pages.
  k_pool[:, num_pages - 1] = np.inf
  v_pool[:, num_pages - 2] = -np.inf

  q = case.q_scale * rng.standard_normal((batch, num_q, D)).astype(np.float32)
  q = jnp.asarray(q, case.dtype)
  k_pages = jnp.asarray(k_pool, kv_dtype)
  v_pages = jnp.asarray(v_pool, kv_dtype)
  # The dense copies carry the same rounding as the pools.
  dense_k = [np.asarray(jnp.asarray(x, kv_dtype), np.float64) for x in dense_k]
  dense_v = [np.asarray(jnp.asarray(x, kv_dtype), np.float64) for x in dense_v]
  inputs = (q, k_pages, v_pages, jnp.asarray(lengths), jnp.asarray(page_table))
  return inputs, (dense_k, dense_v)


def naive_attention(q, dense_k, dense_v, lengths, *, sm_scale, soft_cap=None,
                    sliding_window=None):
  """Per-sequence, per-head float64 numpy loop. Returns (out, lse)."""
  q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
  batch, num_q, D = q.shape
  out = np.zeros((batch, num_q, D))
  lse = np.full((batch, num_q), -np.inf)
  for b in range(batch):
    length = int(lengths[b])
    start = 0 if sliding_window is None else max(0, length - sliding_window)
    num_kv = dense_k[b].shape[0]
    for h in range(num_q):
      kv = h // (num_q // num_kv)
      k = dense_k[b][kv, start:length]
      v = dense_v[b][kv, start:length]
      if not len(k):
        continue
      logits = k @ q[b, h] * sm_scale
      if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
      m = logits.max()
      w = np.exp(logits - m)
      out[b, h] = w @ v / w.sum()
      lse[b, h] = m + np.log(w.sum())
  return out, lse


def case_kwargs(case: Case):
  return dict(sm_scale=case.head_dim ** -0.5, soft_cap=case.soft_cap,
              sliding_window=case.sliding_window)


def assert_matches(out, lse, want_out, want_lse, dtype, lengths):
  atol, lse_atol = TOLERANCES[dtype]
  out = np.asarray(jnp.asarray(out, jnp.float32))
  lse = np.asarray(lse)
  assert np.isfinite(out).all(), "NaN/Inf reached the output"
  np.testing.assert_allclose(out, np.asarray(want_out, np.float32), atol=atol, rtol=atol)
  empty = np.asarray(lengths) == 0
  assert np.all(lse[empty] == -np.inf), "length-0 sequences must have lse -inf"
  assert np.all(out[empty] == 0), "length-0 sequences must output 0"
  assert np.isfinite(lse[~empty]).all()
  np.testing.assert_allclose(lse[~empty], np.asarray(want_lse)[~empty], atol=lse_atol,
                             rtol=lse_atol)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def case_data(request):
  case = request.param
  inputs, dense = make_inputs(case)
  want = paged_attention_reference(*inputs, **case_kwargs(case))
  return case, inputs, dense, want


def test_reference_matches_numpy_loop(case_data):
  case, inputs, (dense_k, dense_v), (out, lse) = case_data
  want_out, want_lse = naive_attention(inputs[0], dense_k, dense_v, inputs[3],
                                       **case_kwargs(case))
  # Against float64: only the output rounding to q.dtype remains.
  assert_matches(out, lse, want_out, want_lse, case.dtype, inputs[3])


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernel_matches_reference(case_data, impl):
  case, inputs, _, (want_out, want_lse) = case_data
  tuning = (dict(pages_per_block=case.tpu_pages_per_block) if impl == "tpu" else
            dict(pages_per_block=case.gpu_pages_per_block,
                 num_splits=case.gpu_num_splits))
  out, lse = paged_attention(*inputs, **case_kwargs(case), impl=impl,
                             interpret=True, return_lse=True, **tuning)
  assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
  assert lse.shape == inputs[0].shape[:2] and lse.dtype == jnp.float32
  assert_matches(out, lse, want_out, want_lse, case.dtype, inputs[3])


COMPILED_IMPL = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(
    jax.default_backend())


@pytest.mark.skipif(COMPILED_IMPL is None, reason="needs a GPU or TPU backend")
def test_compiled_kernel_matches_reference(case_data):
  """The compiled kernel on real hardware (default tuning: splits, blocks)."""
  case, inputs, _, (want_out, want_lse) = case_data
  out, lse = paged_attention(*inputs, **case_kwargs(case), impl=COMPILED_IMPL,
                             return_lse=True)
  out = np.asarray(jnp.asarray(out, jnp.float32))
  assert np.isfinite(out).all(), "NaN/Inf reached the output"
  tol = COMPILED_TOLERANCES[case.dtype]
  np.testing.assert_allclose(out, np.asarray(want_out, np.float32), atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=tol, rtol=tol)


STRICT_CASES = [(CASES[0], pltpu.InterpretParams(detect_races=True)),
                (CASES[4], pltpu.InterpretParams()),
                (CASES[3], pltpu.InterpretParams(dma_execution_mode="eager"))]


@pytest.mark.parametrize("case,params", STRICT_CASES,
                         ids=[c.name for c, _ in STRICT_CASES])
def test_tpu_kernel_strict_interpreter(case, params):
  """Catches out-of-bounds DMAs, missing waits and races interpret=True hides."""
  inputs, _ = make_inputs(case, seed=1)
  want_out, want_lse = paged_attention_reference(*inputs, **case_kwargs(case))
  out, lse = paged_attention(*inputs, **case_kwargs(case), impl="tpu",
                             interpret=params, return_lse=True,
                             pages_per_block=case.tpu_pages_per_block or 1)
  assert_matches(out, lse, want_out, want_lse, case.dtype, inputs[3])


def test_kernels_under_jit_with_traced_lengths():
  case = CASES[1]
  inputs, _ = make_inputs(case, seed=2)
  want = paged_attention_reference(*inputs, **case_kwargs(case))[0]

  @jax.jit
  def step(*args):
    return [paged_attention(*args, **case_kwargs(case), impl=impl, interpret=True)
            for impl in ("tpu", "gpu")]

  for out in step(*inputs):
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)


def test_auto_and_return_lse_flag():
  case = CASES[0]
  inputs, _ = make_inputs(case, seed=3)
  # auto -> the reference on CPU, the compiled kernel on GPU/TPU.
  out = paged_attention(*inputs, **case_kwargs(case))
  want_out, _ = paged_attention_reference(*inputs, **case_kwargs(case))
  assert isinstance(out, jax.Array)  # no lse unless return_lse=True
  if COMPILED_IMPL is None:
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  else:
    tol = COMPILED_TOLERANCES[case.dtype]
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=tol, rtol=tol)


def test_all_lengths_zero():
  case = CASES[2]
  inputs, _ = make_inputs(case, lengths=[0, 0])
  for impl in ("reference", "tpu", "gpu"):
    out, lse = paged_attention(*inputs, **case_kwargs(case), impl=impl,
                               interpret=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    np.testing.assert_array_equal(np.asarray(lse), -np.inf)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=lambda c: c.name)
def test_kernels_lower_for_their_hardware(case):
  """Pallas -> Triton / Mosaic lowering runs on CPU: catches unsupported ops and
  shapes before a GPU/TPU ever sees the kernel (the backend compile does not)."""
  from rlx.kernels import paged_attention_gpu, paged_attention_tpu
  inputs, _ = make_inputs(case)
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
  kw = case_kwargs(case)
  for fn, platform in ((paged_attention_gpu.paged_attention_gpu, "cuda"),
                       (paged_attention_tpu.paged_attention_tpu, "tpu")):
    lowered = fn.trace(*shapes, **kw).lower(lowering_platforms=(platform,))
    assert "rlx_paged_attention" in lowered.as_text()


# --- validation -------------------------------------------------------------

def _valid_inputs():
  return make_inputs(CASES[0])[0]


def _replace(inputs, i, value):
  inputs = list(inputs)
  inputs[i] = value
  return inputs


@pytest.mark.parametrize("mutate,match", [
    (lambda x: _replace(x, 0, x[0][0]), r"q must have rank 3"),
    (lambda x: _replace(x, 1, x[1][0]), r"k_pages must have rank 4"),
    (lambda x: _replace(x, 2, x[2][:, :-1]), r"v_pages shape .* must equal k_pages"),
    (lambda x: _replace(x, 0, x[0][..., :32]), r"k_pages head_dim 64 must equal q head_dim 32"),
    (lambda x: _replace(x, 0, jnp.concatenate([x[0], x[0][:, :1]], 1)),
     r"num_q_heads=3 must be a multiple of num_kv_heads=2"),
    (lambda x: _replace(x, 3, x[3][:-1]), r"lengths shape \(4,\) must be \(5,\)"),
    (lambda x: _replace(x, 4, x[4][:-1]), r"page_indices shape \(4, 4\) must be \(5,"),
    (lambda x: _replace(x, 3, x[3].astype(jnp.float32)), r"lengths must be an integer"),
    (lambda x: _replace(x, 0, x[0].astype(jnp.int32)), r"q must be floating point"),
    (lambda x: _replace(x, 2, x[2].astype(jnp.bfloat16)), r"k_pages dtype float32 must equal v_pages dtype bfloat16"),
    (lambda x: _replace(x, 3, x[3].at[1].set(33)), r"lengths\[1\]=33 must be in \[0, .* = 32\]"),
    (lambda x: _replace(x, 4, x[4].at[4, 0].set(99)), r"page_indices\[4, 0\]=99 is used"),
])
def test_validation_errors(mutate, match):
  with pytest.raises(ValueError, match=match):
    paged_attention(*mutate(_valid_inputs()), sm_scale=0.125, impl="reference")


@pytest.mark.parametrize("kwargs,match", [
    (dict(impl="cuda"), r"impl must be one of"),
    # These two cannot raise where the hardware is present.
    pytest.param(dict(impl="tpu"), r"impl='tpu' needs a TPU backend .* interpret=True",
                 marks=pytest.mark.skipif(COMPILED_IMPL == "tpu",
                                          reason="a TPU backend is present")),
    pytest.param(dict(impl="gpu"), r"impl='gpu' needs a GPU backend",
                 marks=pytest.mark.skipif(COMPILED_IMPL == "gpu",
                                          reason="a GPU backend is present")),
    (dict(soft_cap=-1.0), r"soft_cap must be None or a positive float, got -1.0"),
    (dict(sliding_window=0), r"sliding_window must be None or a positive int, got 0"),
    (dict(sm_scale=jnp.float32(0.1) + jnp.zeros(())), r"sm_scale must be a Python float"),
    (dict(impl="tpu", interpret=True, num_splits=2), r"num_splits=2 is supported by impl='gpu' only"),
])
def test_validation_errors_options(kwargs, match):
  kwargs = {"sm_scale": 0.125, **kwargs}
  with pytest.raises(ValueError, match=match):
    paged_attention(*_valid_inputs(), **kwargs)


def test_gpu_rejects_non_power_of_two_shapes():
  inputs, _ = make_inputs(Case("d48", 8, 48, 1, 2, 2))
  with pytest.raises(NotImplementedError, match=r"head_dim to be a power of two .* got 48"):
    paged_attention(*inputs, sm_scale=0.1, impl="gpu", interpret=True)
  inputs, _ = make_inputs(Case("p12", 12, 64, 1, 2, 2))
  with pytest.raises(NotImplementedError, match=r"page_size to be a power of two, got 12"):
    paged_attention(*inputs, sm_scale=0.1, impl="gpu", interpret=True)


def test_unused_page_table_garbage_is_accepted():
  inputs = _valid_inputs()
  pages, num_pages = np.asarray(inputs[4]), inputs[1].shape[1]
  assert (pages < 0).any() and (pages >= num_pages).any()  # only in unused entries
  paged_attention(*inputs, sm_scale=0.125, impl="reference")  # no error
