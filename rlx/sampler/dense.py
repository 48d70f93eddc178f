"""Dense-KV-cache sampler: the reference (oracle) that the paged sampler is tested against.

Prompts are left-padded to a common length P, so every sequence writes its t-th new token at
cache index P + t: one scalar write index for the whole batch. Prefill runs once; decode runs
inside one `lax.while_loop` until every sequence stopped or max_new_tokens were drawn.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from rlx.model import transformer
from rlx.model.config import ModelConfig
from rlx.sampler.sampling import (Rollout, SamplingParams, is_stop, prompt_positions,
                                  sample_tokens, step_keys)


@struct.dataclass
class DenseKVCache:
  k: jax.Array  # [L, B, S, Hkv, D]
  v: jax.Array  # [L, B, S, Hkv, D]
  key_pos: jax.Array  # i32[B, S]; -1 marks an empty slot
  write_index: jax.Array  # i32[] where the current forward's tokens go

  scannable = True  # layer_attend takes a traced layer index (transformer.scans_layers)

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, length: int) -> "DenseKVCache":
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return cls(k=jnp.zeros(shape, cfg.compute_dtype), v=jnp.zeros(shape, cfg.compute_dtype),
               key_pos=jnp.full((batch, length), -1, jnp.int32),
               write_index=jnp.zeros((), jnp.int32))

  def begin(self, pos_BxT, valid_BxT) -> "DenseKVCache":
    """Records the positions of the tokens about to be written at write_index."""
    key_pos = jax.lax.dynamic_update_slice(
        self.key_pos, jnp.where(valid_BxT, pos_BxT, -1).astype(jnp.int32),
        (0, self.write_index))
    return self.replace(key_pos=key_pos)

  def end(self, num_tokens: int) -> "DenseKVCache":
    return self.replace(write_index=self.write_index + num_tokens)

  def layer_attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, q_pos_BxT, spec):
    start = (layer, 0, self.write_index, 0, 0)
    k_all = jax.lax.dynamic_update_slice(self.k, k_BxTxKxD[None].astype(self.k.dtype), start)
    v_all = jax.lax.dynamic_update_slice(self.v, v_BxTxKxD[None].astype(self.v.dtype), start)
    allowed = transformer.attention_mask(q_pos_BxT, self.key_pos, spec.window)
    out = transformer.dot_attention(q_BxTxHxD, k_all[layer], v_all[layer], allowed, spec)
    return out, self.replace(k=k_all, v=v_all)


@functools.partial(jax.jit, static_argnames=("graphdef", "params_cfg"))
def generate(graphdef, params, prompts_BxP, prompt_lens_B, keys_B, *,
             params_cfg: SamplingParams) -> Rollout:
  return generate_unjitted(graphdef, params, prompts_BxP, prompt_lens_B, keys_B, params_cfg)


def generate_unjitted(graphdef, params, prompts_BxP, prompt_lens_B, keys_B,
                      sp: SamplingParams) -> Rollout:
  """Samples up to sp.max_new_tokens per prompt. Pure; call inside jit."""
  # q/k/v and gate/up as one matmul each: fewer kernels per decoded token, for one copy of
  # those matrices per call (transformer.fuse_projections).
  model = transformer.bind(graphdef, transformer.fuse_projections(params))
  cfg = model.cfg
  b, p = prompts_BxP.shape
  t_max = sp.max_new_tokens
  pos, valid = prompt_positions(prompt_lens_B, p)
  cache = DenseKVCache.init(cfg, b, p + t_max).begin(pos, valid)
  logits, cache = model(prompts_BxP, pos, valid, cache)
  cache = cache.end(p)
  tok, logp = sample_tokens(logits[:, -1], step_keys(keys_B, 0), sp)

  tokens = jnp.full((b, t_max), sp.pad_id, jnp.int32).at[:, 0].set(tok)
  logprobs = jnp.zeros((b, t_max), jnp.float32).at[:, 0].set(logp)
  done = is_stop(tok, sp)
  lengths = jnp.ones((b,), jnp.int32)

  def cond(carry):
    t, _, _, _, done, _, _ = carry
    return (t < t_max) & ~jnp.all(done)

  def body(carry):
    t, tok, tokens, logprobs, done, lengths, cache = carry
    step_pos = (prompt_lens_B + t - 1)[:, None]
    step_valid = ~done[:, None]
    c = cache.begin(step_pos, step_valid)
    logits, c = model(tok[:, None], step_pos, step_valid, c)
    c = c.end(1)
    new_tok, new_logp = sample_tokens(logits[:, 0], step_keys(keys_B, t), sp)
    new_tok = jnp.where(done, sp.pad_id, new_tok)
    new_logp = jnp.where(done, 0.0, new_logp)
    tokens = jax.lax.dynamic_update_slice(tokens, new_tok[:, None], (0, t))
    logprobs = jax.lax.dynamic_update_slice(logprobs, new_logp[:, None], (0, t))
    lengths = lengths + (~done).astype(jnp.int32)
    done = done | is_stop(new_tok, sp)
    return t + 1, new_tok, tokens, logprobs, done, lengths, c

  carry = (jnp.ones((), jnp.int32), tok, tokens, logprobs, done, lengths, cache)
  _, _, tokens, logprobs, done, lengths, _ = jax.lax.while_loop(cond, body, carry)
  return Rollout(tokens=tokens, logprobs=logprobs, lengths=lengths, truncated=~done)
