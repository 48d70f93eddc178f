"""experiments/benchmarks/roofline.py (what bench_step.py reports against): the update's GEMM floor
counts the matmuls the update computes (their FLOPs equal XLA's count of the forward +
backward within the elementwise remainder), and times them. No flags: importable next to the
experiment scripts that define theirs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.experiments.benchmarks import roofline
from rlx import train
from rlx.model import ModelConfig, init_params


def _xla_flops_of_update(cfg: ModelConfig, rows: int, prompt: int, width: int) -> float:
  g, params = init_params(cfg, 0)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(4, cfg.vocab_size, (rows, prompt)), jnp.int32)
  prompt_lens = jnp.full((rows,), prompt, jnp.int32)
  completions = jnp.asarray(rng.integers(4, cfg.vocab_size, (rows, width)), jnp.int32)
  lengths = jnp.full((rows,), width, jnp.int32)

  def loss(p):
    lp, mask = train.completion_logprobs(g, p, prompts, prompt_lens, completions, lengths, 1.0)
    return jnp.sum(lp * mask)

  return roofline.xla_flops(jax.jit(jax.value_and_grad(loss)), params)


# (model dims, rows, prompt, width, lower bound on ours / XLA's). XLA's count adds the
# elementwise work (softmax, norms, activations) to the matmuls. Every entry of the set is
# caught in one case: the projection-heavy ones measure 0.985 with each projection or
# vocabulary entry >= 2.1% of the total (attention's are 0.5% there); the attention-heavy one
# (256-token rows, head_dim 64) measures 0.975 with each attention entry ~9.5%.
@pytest.mark.parametrize("dims,rows,prompt,width,low", [
    ((128, 4, 2, 32, 256, 2048), 8, 6, 24, 0.97),
    ((128, 4, 4, 32, 256, 512), 8, 6, 24, 0.97),
    ((64, 4, 4, 64, 128, 64), 2, 6, 250, 0.93),
])
def test_update_gemms_count_what_xla_counts(dims, rows, prompt, width, low):
  d, heads, kv_heads, head_dim, mlp, vocab = dims
  cfg = ModelConfig(vocab_size=vocab, num_layers=2, d_model=d, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=head_dim, mlp_dim=mlp)
  gemms = roofline.update_gemms(cfg, rows, prompt + width, width)
  ours = sum(2.0 * b * m * k * n * c for b, m, k, n, c in gemms)
  xla = _xla_flops_of_update(cfg, rows, prompt, width)
  assert low * xla <= ours <= xla, (ours, xla)


def test_gemm_floor_times_every_shape_and_counts_its_flops():
  gemms = [(1, 16, 8, 4, 3), (2, 4, 4, 4, 1)]
  seconds, flops = roofline.gemm_floor(gemms, jnp.float32, reps=1)
  assert flops == 3 * 2 * 16 * 8 * 4 + 2 * 2 * 4 * 4 * 4
  assert seconds > 0
