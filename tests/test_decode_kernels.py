"""Kernels per decode iteration: the HLO counting of experiments/benchmarks/decode_kernels.py
on a hand-written module, and the fused q/k/v and gate/up projections the samplers decode
with (rlx.model.transformer.fuse_projections) against the unfused model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import decode_kernels as dk
from rlx.model import ModelConfig, init_params, lora, transformer
from rlx.sampler import dense, paged
from rlx.sampler.sampling import SamplingParams

# A decode loop (a dot outside a fusion, one inside, a nested 5-trip loop, a conditional)
# next to a loop without a matmul (what the CPU's threefry hash compiles to).
HLO = """HloModule jit_demo, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_dot (p0: f32[2,8], p1: f32[8,8]) -> f32[2,8] {
  %p0 = f32[2,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[2,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0: f32[2,8]) -> f32[2,8] {
  %p0 = f32[2,8]{1,0} parameter(0)
  ROOT %add.1 = f32[2,8]{1,0} add(%p0, %p0)
}

%inner_body (t: (s32[], u32[4])) -> (s32[], u32[4]) {
  %t = (s32[], u32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = u32[4]{0} get-tuple-element(%t), index=1
  %copy.7 = u32[4]{0} copy(%x)
  %fusion.9 = u32[4]{0} fusion(%copy.7), kind=kLoop, calls=%fused_add
  ROOT %tuple.2 = (s32[], u32[4]{0}) tuple(%i, %fusion.9)
}

%inner_cond (t: (s32[], u32[4])) -> pred[] {
  %t = (s32[], u32[4]{0}) parameter(0)
  ROOT %constant.3 = pred[] constant(true)
}

%branch_big (p: f32[2,8]) -> f32[2,8] {
  %p = f32[2,8]{1,0} parameter(0)
  %fusion.20 = f32[2,8]{1,0} fusion(%p), kind=kLoop, calls=%fused_add
  %fusion.21 = f32[2,8]{1,0} fusion(%fusion.20), kind=kLoop, calls=%fused_add
  ROOT %fusion.22 = f32[2,8]{1,0} fusion(%fusion.21), kind=kLoop, calls=%fused_add
}

%branch_small (p: f32[2,8]) -> f32[2,8] {
  %p = f32[2,8]{1,0} parameter(0)
  ROOT %copy.23 = f32[2,8]{1,0} copy(%p)
}

%decode_body (t: (s32[], f32[2,8], f32[8,8])) -> (s32[], f32[2,8], f32[8,8]) {
  %t = (s32[], f32[2,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %h = f32[2,8]{1,0} get-tuple-element(%t), index=1
  %w = f32[8,8]{1,0} get-tuple-element(%t), index=2
  %c = s32[] constant(1)
  %b = f32[16]{0} bitcast(%h)
  %dot.5 = f32[2,8]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %fusion.1 = f32[2,8]{1,0} fusion(%dot.5, %w), kind=kOutput, calls=%fused_dot
  %fusion.2 = f32[2,8]{1,0} fusion(%fusion.1), kind=kLoop, calls=%fused_add
  %custom-call.3 = f32[2,8]{1,0} custom-call(%fusion.2), custom_call_target="__onednn$softmax"
  %dynamic-update-slice.4 = f32[2,8]{1,0} dynamic-update-slice(%custom-call.3, %h, %i, %i)
  %copy.5 = f32[8,8]{1,0} copy(%w)
  %init = (s32[], u32[4]{0}) tuple(%i, %i)
  %while.6 = (s32[], u32[4]{0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %conditional.8 = f32[2,8]{1,0} conditional(%i, %h, %h), branch_computations={%branch_big, %branch_small}
  %next = s32[] add(%i, %c)
  ROOT %tuple.9 = (s32[], f32[2,8]{1,0}, f32[8,8]{1,0}) tuple(%next, %conditional.8, %copy.5)
}

%decode_cond (t: (s32[], f32[2,8], f32[8,8])) -> pred[] {
  %t = (s32[], f32[2,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %fusion.30 = pred[] fusion(%i), kind=kLoop, calls=%fused_add
}

ENTRY %main.1 (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %init = (s32[], u32[4]{0}) tuple(%a, %a)
  %while.40 = (s32[], u32[4]{0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %init2 = (s32[], f32[2,8]{1,0}, f32[8,8]{1,0}) tuple(%a, %a, %a)
  ROOT %while.41 = (s32[], f32[2,8]{1,0}, f32[8,8]{1,0}) while(%init2), condition=%decode_cond, body=%decode_body
}
"""


def test_parse_hlo_reads_computations_opcodes_and_tuple_shapes():
  comps, entry = dk.parse_hlo(HLO)
  assert entry == "main.1"
  assert set(comps) >= {"fused_dot", "inner_body", "decode_body", "decode_cond", "main.1"}
  ops = [i.opcode for i in comps["decode_body"]]
  assert ops[:6] == ["parameter", "get-tuple-element", "get-tuple-element",
                     "get-tuple-element", "constant", "bitcast"]
  assert "while" in ops and "conditional" in ops and ops[-1] == "tuple"
  w = next(i for i in comps["decode_body"] if i.opcode == "while")
  assert dk.trip_count(w) == 5
  cond = next(i for i in comps["decode_body"] if i.opcode == "conditional")
  assert dk.branches(cond) == ["branch_big", "branch_small"]


def test_decode_loops_are_the_outer_loops_that_run_a_matmul():
  comps, entry = dk.parse_hlo(HLO)
  assert [w.name for w in dk.decode_loops(comps, entry)] == ["while.41"]


def test_count_launches_of_one_iteration():
  (c,) = dk.loop_counts(HLO)
  # Body: dot, 2 fusions, custom-call, DUS, copy, add, conditional (+ its cheaper branch: a
  # copy) = 9; the inner loop 5 x (copy + fusion) = 10; the condition's fusion = 1.
  assert c["launches"] == 9 + 10 + 1
  assert c["in_nested_loops"] == 10
  assert c["fusion"] == 2 + 5 + 1
  assert c["custom-call"] == 1
  assert c["dot"] == 1  # outside a fusion
  assert c["matmuls"] == 2  # and the one inside fusion.1
  assert c["copy"] == 1 + 5 + 1
  assert c["dynamic-update-slice"] == 1
  assert c["nested_loops"] == 1 and c["unknown_trip"] == 0


def test_count_launches_on_a_compiled_sampler():
  """On real compiled HLO: the dense sampler's one decode loop runs each projection matmul."""
  cfg = ModelConfig(vocab_size=32, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1,
                    head_dim=8, mlp_dim=32)
  g, p = init_params(cfg, 0)
  sp = SamplingParams(max_new_tokens=4, eos_id=1)
  keys = jax.random.split(jax.random.key(0), 2)
  text = dense.generate.lower(g, p, jnp.zeros((2, 3), jnp.int32), jnp.full((2,), 3, jnp.int32),
                              keys, params_cfg=sp).compile().as_text()
  (c,) = dk.loop_counts(text)
  # Fused q|k|v, o, gate|up, down, the two attention products, the vocabulary projection.
  assert c["matmuls"] == 7
  assert c["launches"] > c["fusion"] >= c["matmuls"]


# ----------------------------------------------------------------------------- fused path

CFGS = {
    "llama": ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64),
    "qwen": ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64, qkv_bias=True, qk_norm=True),
}


def _random_biases(params, seed=3):
  """Non-zero biases (they start at zero), so the fused path's bias handling is exercised."""
  key = jax.random.key(seed)
  out = jax.tree.map(lambda x: x, params)
  for name, layer in params.items():
    if name.startswith("layer_"):
      for b in ("q_bias", "k_bias", "v_bias"):
        if b in layer["attn"]:
          key, sub = jax.random.split(key)
          out[name]["attn"][b] = 0.1 * jax.random.normal(sub, layer["attn"][b].shape)
  return out


def _paths(tree, prefix=""):
  """Paths to the non-dict values of a nested dict."""
  return sorted(q for k, v in tree.items()
                for q in (_paths(v, f"{prefix}/{k}") if isinstance(v, dict) else [f"{prefix}/{k}"]))


@pytest.mark.parametrize("arch", sorted(CFGS))
def test_fused_forward_equals_unfused(arch):
  cfg = CFGS[arch]
  _, p = init_params(cfg, 1)
  p = _random_biases(p)
  g = transformer.graphdef_for(cfg)
  tok = jax.random.randint(jax.random.key(1), (3, 7), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(7), (3, 7))
  fused = transformer.fuse_projections(p)
  attn, mlp = fused["layer_0"]["attn"], fused["layer_0"]["mlp"]
  assert isinstance(attn["q_proj"], transformer.FusedProjection)
  assert attn["q_proj"].sizes == (32, 16, 16)
  assert isinstance(attn["k_proj"], transformer.FusedElsewhere)
  assert isinstance(mlp["gate_proj"], transformer.FusedProjection)
  assert isinstance(mlp["up_proj"], transformer.FusedElsewhere)
  # The input is left as it was, and the tree keeps its paths.
  assert isinstance(p["layer_0"]["attn"]["q_proj"], jax.Array)
  assert _paths(fused) == _paths(p)
  want, _ = transformer.apply(g, p, tok, pos)
  got = jax.jit(lambda q: transformer.apply(g, transformer.fuse_projections(q), tok, pos)[0])(p)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_unmerged_lora_groups_are_left_unfused_and_equal():
  cfg = CFGS["llama"]
  g, base = init_params(cfg, 1)
  lc = lora.LoRAConfig(rank=2, alpha=4.0, targets=(r"(q|gate)_proj$",))
  ad = lora.init_adapters(base, lc, seed=1)
  ad = jax.tree.map(lambda x: x + 0.05, ad)  # B != 0: the adapters change the outputs
  attached = lora.attach(base, ad, lc)
  fused = transformer.fuse_projections(attached)
  assert isinstance(fused["layer_0"]["attn"]["q_proj"], lora.LoRAWeight)
  assert isinstance(fused["layer_0"]["mlp"]["gate_proj"], lora.LoRAWeight)
  tok = jax.random.randint(jax.random.key(2), (2, 5), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  want, _ = transformer.apply(g, attached, tok, pos)
  got, _ = transformer.apply(g, fused, tok, pos)
  np.testing.assert_array_equal(got, want)
  # Merged adapters are plain matrices again: those fuse.
  merged = transformer.fuse_projections(lora.merge(base, ad, lc))
  assert isinstance(merged["layer_0"]["attn"]["q_proj"], transformer.FusedProjection)
  np.testing.assert_allclose(transformer.apply(g, merged, tok, pos)[0], want, rtol=1e-5,
                             atol=1e-5)


def test_fused_elsewhere_refuses_to_be_read():
  with pytest.raises(TypeError, match="fused"):
    transformer.FusedElsewhere()[...]  # pylint: disable=expression-not-assigned


def _run_samplers(monkeypatch, fuse: bool):
  if not fuse:
    monkeypatch.setattr(transformer, "fuse_projections", lambda p: p)
  cfg = CFGS["qwen"]
  _, p = init_params(cfg, 2)
  p = _random_biases(p)
  g = transformer.graphdef_for(cfg)
  sp = SamplingParams(max_new_tokens=12, eos_id=1, temperature=1.0)
  b, width = 8, 6
  prompts = jax.random.randint(jax.random.key(3), (b // 2, width), 2, cfg.vocab_size)
  prompts = jnp.repeat(prompts, 2, axis=0)  # groups of 2 for the paged sampler
  lens = jnp.repeat(jnp.array([6, 3, 5, 1]), 2)
  keys = jax.random.split(jax.random.key(4), b)
  # Fresh jits: the monkeypatched model must be traced anew.
  ro_d = jax.jit(functools.partial(dense.generate_unjitted, g, sp=sp))(p, prompts, lens, keys)
  ro_p = jax.jit(functools.partial(paged.generate_unjitted, g, sp=sp,
                                   pc=paged.PagedConfig(page_size=4, max_slots=4, slot_buckets=2),
                                   group_size=2))(p, prompts, lens, keys)
  return jax.device_get((ro_d, ro_p))


def test_samplers_draw_the_same_tokens_fused_and_unfused(monkeypatch):
  fused = _run_samplers(monkeypatch, fuse=True)
  unfused = _run_samplers(monkeypatch, fuse=False)
  for f, u in zip(fused, unfused):
    np.testing.assert_array_equal(f.tokens, u.tokens)
    np.testing.assert_array_equal(f.lengths, u.lengths)
    np.testing.assert_allclose(f.logprobs, u.logprobs, rtol=1e-5, atol=1e-5)
