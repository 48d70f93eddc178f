"""rlx.memory: the plan's exact lines against real arrays on real (fake CPU) meshes."""

import math
import importlib.util
import os

import jax
import ml_collections as mlc
import numpy as np
import pytest

from rlx import configs
from rlx import memory
from rlx import memory_overlap
from rlx import sharding as shd
from rlx import train
from rlx.model import hf
from rlx.model import transformer
from rlx.rl import replay as replay_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**overrides) -> mlc.ConfigDict:
  spec = importlib.util.spec_from_file_location(
      "arith_cfg", os.path.join(ROOT, "experiments", "arith.py"))
  arith = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(arith)
  c = arith.get_config("runlocal")  # 2 layers, d_model 32: every dim divisible by 2 and 4
  return configs.with_overrides(c, overrides)


def _abstract_rollouts(rows: int, p: int, t: int) -> "train.Rollouts":
  """Shapes of one step's rollouts (rows x prompt p + completion t), for compiling the update."""
  sds = jax.ShapeDtypeStruct
  i32, f32 = jax.numpy.int32, jax.numpy.float32
  batch = train.Batch(
      prompts=sds((rows, p), i32), prompt_lens=sds((rows,), i32),
      completions=sds((rows, t), i32), behaviour_logp=sds((rows, t), f32),
      lengths=sds((rows,), i32), truncated=sds((rows,), bool), rewards=sds((rows,), f32),
      advantages=sds((rows,), f32), prompt_ids=sds((rows,), i32), difficulty=sds((rows,), i32),
      policy_version=sds((rows,), i32))
  return train.Rollouts(batch, {"ledger/tokens_discarded": sds((), f32)})


def _model(config):
  return configs.model_config(config, config.tokenizer.vocab_size)


def _bytes_on_first_device(tree) -> int:
  dev = jax.devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    total += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
  return total


def test_params_line_is_the_real_byte_count_on_one_device():
  config = _config()
  cfg = _model(config)
  _, params = transformer.init_params(cfg)
  real = sum(x.nbytes for x in jax.tree.leaves(params))
  p = memory.plan(config, cfg, {"data": 1})
  assert p.item("params").bytes == real
  assert p.item("gradients").bytes == real


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 2}, {"data": 2, "fsdp": 4}])
def test_state_lines_match_init_state_on_a_real_mesh(mesh_shape):
  config = _config(**{"replay.enabled": True, "replay.capacity": 64, "replay.num_samples": 8})
  cfg = _model(config)
  _, params = transformer.init_params(cfg)
  sizes = {a: mesh_shape.get(a, 1) for a in shd.AXES}
  mesh = shd.make_mesh(**sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
  tx = train.make_optimizer(1e-3, 10)
  rep = configs.replay_config(config)
  state = train.init_state(params, tx, 0, mesh, num_prompts=100, replay=rep,
                           prompt_width=config.sampler.max_prompt_len,
                           max_new_tokens=config.sampler.max_new_tokens)
  p = memory.plan(config, cfg, mesh_shape, num_prompts=100, num_groups=1)
  assert p.item("params").bytes == _bytes_on_first_device(state.params)
  assert p.item("optimizer (adamw mu, nu)").bytes == _bytes_on_first_device(state.opt_state)
  assert p.item("replay ring").bytes == _bytes_on_first_device(state.replay)
  assert p.item("selector").bytes == _bytes_on_first_device(state.selector)


def test_fsdp_halves_the_sharded_params():
  config = _config()
  cfg = _model(config)
  one = memory.plan(config, cfg, {"fsdp": 1}).item("params").bytes
  two = memory.plan(config, cfg, {"fsdp": 2}).item("params").bytes
  _, params = transformer.abstract_params(cfg)
  mesh = jax.sharding.AbstractMesh((1, 2, 1), shd.AXES)
  replicated = sum(x.size * x.dtype.itemsize
                   for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
                   if not any(shd.spec_for(shd.path_str(path), x.shape, mesh)))
  assert replicated > 0  # norms stay whole
  assert two == replicated + (one - replicated) // 2


def test_replay_ring_is_its_real_bytes_over_the_batch_devices():
  config = _config(**{"replay.enabled": True, "replay.capacity": 1024,
                      "replay.num_samples": 64})
  cfg = _model(config)
  ring = replay_lib.ReplayState.init(1024, config.sampler.max_prompt_len,
                                     config.sampler.max_new_tokens)
  leaves = jax.tree.leaves(ring)
  per_row = sum(x.nbytes for x in leaves if x.ndim)
  scalars = sum(x.nbytes for x in leaves if not x.ndim)
  for shape, devices in (({"data": 1}, 1), ({"data": 2, "fsdp": 4, "tensor": 2}, 8)):
    got = memory.plan(config, cfg, shape).item("replay ring").bytes
    assert got == per_row // devices + scalars


def test_kl_adds_reference_params_and_paged_adds_a_pool():
  config = _config(**{"rl.kl_coef": 0.1, "sampler.impl": "paged"})
  p = memory.plan(config, _model(config), {"data": 2, "fsdp": 2})
  assert p.item("reference params (kl_coef > 0)").bytes == p.item("params").bytes
  assert p.item("sampler KV pool (paged)").bytes > 0
  assert p.item("sampler params (all-gathered)").bytes > p.item("params").bytes
  names = {it.name for it in memory.plan(_config(), _model(_config()), {"data": 1}).items}
  assert "reference params (kl_coef > 0)" not in names


def test_the_pass_rate_probe_is_a_rollout_line_linear_in_its_candidates():
  """selection.mode probe / oracle: one no-grad forward over every candidate before sampling
  (rlx.train.true_pass_rate); probe_factor x the prompts sampled, the oracle's count, or the
  pool."""
  def probe_line(**sel):
    config = _config(**{f"selection.{k}": v for k, v in sel.items()})
    items = [it for it in memory.plan(config, _model(config), {"data": 1}).items
             if it.name.startswith("pass-rate probe forward")]
    return items[0] if items else None

  assert probe_line() is None  # uniform selection probes nothing
  at8, at16 = probe_line(mode="probe"), probe_line(mode="probe", probe_factor=16)
  assert at8.name == "pass-rate probe forward (32 candidates, no grad)"  # 4 prompts x 8
  assert at8.phase == "rollout" and at16.bytes == 2 * at8.bytes
  filtered = probe_line(mode="probe", dynamic_filter=True, oversample=2)
  assert filtered.name == at16.name  # 2 x 4 prompts sampled, x 8: 64
  assert probe_line(mode="oracle", oracle_candidates=0).name.startswith(
      "pass-rate probe forward (900 candidates")  # the whole pool: 3 levels x 300


def test_an_impossible_capacity_raises_with_the_numbers():
  config = _config(**{"memory.device_bytes": 1024})
  p = memory.plan(config, _model(config), {"data": 1})
  assert p.capacity_bytes == 1024 and not p.fits
  with pytest.raises(configs.ConfigError) as e:
    memory.check_fits(p)
  msg = str(e.value)
  assert f"needs {memory.human(p.total_bytes)} per device" in msg
  assert "1.00 KiB (config.memory.device_bytes)" in msg
  assert "largest:" in msg and "num_minibatches" in msg and "fsdp" in msg
  memory.check_fits(memory.plan(_config(), _model(_config()), {"data": 1}))  # host RAM: fits


def test_format_plan_lists_every_item_and_the_verdict():
  config = _config(**{"replay.enabled": True, "rl.kl_coef": 0.1})
  p = memory.plan(config, _model(config), {"data": 2})
  text = memory.format_plan(p)
  for it in p.items:
    assert it.name in text and memory.human(it.bytes) in text
  assert "FITS" in text and "capacity" in text and "headroom" in text
  assert p.total_bytes == max(p.phase_bytes().values())


def test_mesh_shape_is_validated():
  config = _config()
  with pytest.raises(configs.ConfigError, match="fsdp"):
    memory.plan(config, _model(config), {"fsdp": -1})
  with pytest.raises(configs.ConfigError, match="model"):
    memory.plan(config, _model(config), {"model": 2})


def test_qwen25_15b_shape_file():
  cfg = hf.config_from_hf(hf.read_config(os.path.join(ROOT, "experiments", "shapes",
                                                       "qwen2.5-1.5b")))
  assert cfg.qkv_bias and cfg.tie_embeddings and cfg.num_kv_heads == 2
  assert 1.53e9 < cfg.num_params() < 1.55e9


def test_the_kv_pool_line_follows_the_sampler_settings():
  # The plan once read a config section that does not exist and sized the pool from defaults.
  cfg = _model(_config())
  small = memory.plan(_config(**{"sampler.num_pages": 40}), cfg, {"data": 1})
  large = memory.plan(_config(**{"sampler.num_pages": 400}), cfg, {"data": 1})
  assert large.item("sampler KV pool (paged)").bytes == 10 * small.item(
      "sampler KV pool (paged)").bytes
  page32 = memory.plan(_config(**{"sampler.num_pages": 40, "sampler.page_size": 32}), cfg,
                       {"data": 1})
  assert page32.item("sampler KV pool (paged)").bytes == 2 * small.item(
      "sampler KV pool (paged)").bytes
  assert "config.sampler.num_pages" in small.item("sampler KV pool (paged)").hint


def _update_xla_and_plan(chunk: int = 0, micro: int = 0, model=None, t: int = 1024
                         ) -> tuple[int, int]:
  """XLA's memory analysis (temp + arguments) of the compiled update on 8 rows of T = 1024
  completion tokens, vocabulary 32k (CPU), and the plan's grad phase (no safety margin);
  or on `model` and `t`."""
  import functools
  from rlx.model import ModelConfig
  from rlx.sampler.sampling import SamplingParams
  p, rows = 16, 8
  model = model or ModelConfig(vocab_size=32000, num_layers=2, d_model=64, num_heads=2,
                               num_kv_heads=1, head_dim=16, mlp_dim=128)
  graphdef, abstract = transformer.abstract_params(model)
  tx = train.make_optimizer(1e-3, 10)
  i32 = jax.numpy.int32
  ro = _abstract_rollouts(rows, p, t)
  state = jax.eval_shape(lambda params: train.TrainState(
      params=params, opt_state=tx.init(params), rng=jax.numpy.zeros((2,), jax.numpy.uint32),
      step=jax.numpy.zeros((), i32), policy_version=jax.numpy.zeros((), i32)), abstract)
  cfg = train.StepConfig(prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1,
                         num_minibatches=1, loss=train.LossConfig(),
                         sampling=SamplingParams(max_new_tokens=t), logprob_chunk=chunk,
                         update_micro_rows=micro)
  parts = (t,) * (rows // micro) if micro else None
  fn = jax.jit(functools.partial(train.update, graphdef=graphdef, cfg=cfg, tx=tx, parts=parts),
               donate_argnums=0)
  ma = fn.lower(state, ro).compile().memory_analysis()
  config = _config(**{"rl.prompts_per_step": 2, "rl.group_size": 4,
                      "sampler.max_new_tokens": t, "sampler.max_prompt_len": p,
                      "rl.logprob_chunk": chunk, "update_shape.micro_rows": micro,
                      # micro=0: the whole batch, as compiled
                      "update_shape.cpu_micro_tokens": 0,
                      "memory.activation_margin": 1.0})
  planned = memory.plan(config, model, {"data": 1}, num_prompts=8).phase_bytes()["grad"]
  return ma.temp_size_in_bytes + ma.argument_size_in_bytes, planned


def test_chunked_logprobs_cut_the_compiled_update_peak_and_the_plan_follows():
  """Chunked log-probs vs not: XLA's figure for each, and the plan's."""
  full_xla, full_plan = _update_xla_and_plan()
  chunk_xla, chunk_plan = _update_xla_and_plan(chunk=128)
  assert full_xla >= 3 * chunk_xla, (full_xla, chunk_xla)
  for xla, planned in ((full_xla, full_plan), (chunk_xla, chunk_plan)):
    assert abs(planned - xla) <= 0.15 * xla, (planned, xla)


def test_gradient_accumulation_cuts_the_compiled_update_peak_and_the_plan_follows():
  """update_shape.micro_rows=2 on 8 rows: four micro-batches one after the other. XLA's memory
  analysis shows one part's activations live at a time (the scan over parts), and the plan
  follows."""
  full_xla, full_plan = _update_xla_and_plan()
  micro_xla, micro_plan = _update_xla_and_plan(micro=2)
  assert full_xla >= 2.5 * micro_xla, (full_xla, micro_xla)
  for xla, planned in ((full_xla, full_plan), (micro_xla, micro_plan)):
    assert abs(planned - xla) <= 0.15 * xla, (planned, xla)


def test_scanned_layers_add_their_stacked_weights_and_the_plan_follows():
  """model.scan_layers on a model whose weights weigh in the update (6 layers, d 256,
  completions of 128): XLA's compiled update holds over 2x the layer weights more than
  unrolled (the stack for the forward and backward, the stacked gradient), and the plan
  follows both within 15%."""
  import dataclasses
  from rlx.model import ModelConfig
  model = ModelConfig(vocab_size=512, num_layers=6, d_model=256, num_heads=4, num_kv_heads=2,
                      head_dim=64, mlp_dim=1024)
  layer_bytes = 4 * (model.num_params() - 512 * 256 - 256)
  unrolled_xla, unrolled_plan = _update_xla_and_plan(model=model, t=128)
  scanned_xla, scanned_plan = _update_xla_and_plan(
      model=dataclasses.replace(model, scan_layers=True), t=128)
  assert scanned_xla - unrolled_xla >= 2 * layer_bytes, (scanned_xla, unrolled_xla)
  for xla, planned in ((unrolled_xla, unrolled_plan), (scanned_xla, scanned_plan)):
    assert abs(planned - xla) <= 0.15 * xla, (planned, xla)


def test_cpu_micro_tokens_sets_the_micro_rows_on_cpu_only_where_nothing_else_does():
  """update_shape.cpu_micro_tokens: on the CPU backend (these tests) with micro_rows=0 and one
  minibatch, micro-batches of tokens // (max_prompt_len + max_new_tokens) rows; an explicit
  micro_rows wins; several minibatches or 0 tokens turn it off; the plan follows."""
  assert jax.default_backend() == "cpu"
  base = {"sampler.max_prompt_len": 16, "sampler.max_new_tokens": 48, "rl.prompts_per_step": 8,
          "rl.group_size": 8, "update_shape.cpu_micro_tokens": 1024}
  micro = lambda **o: configs.resolve(_config(**{**base, **o})).rl.update_micro_rows
  assert micro() == 1024 // 64
  # fewer tokens than one row: one row
  assert micro(**{"update_shape.cpu_micro_tokens": 100}) == 1
  assert micro(**{"update_shape.micro_rows": 4}) == 4
  assert micro(**{"update_shape.cpu_micro_tokens": 0}) == 0
  assert micro(**{"rl.num_minibatches": 2}) == 0
  model = _model(_config(**base))
  grad = lambda **o: memory.plan(_config(**{**base, **o}), model, {"data": 1}).phase_bytes()[
      "grad"]
  assert grad() == grad(**{"update_shape.cpu_micro_tokens": 0,
                           "update_shape.micro_rows": 16})
  assert grad() < grad(**{"update_shape.cpu_micro_tokens": 0})


# ----------------------------------------------------------------------------- LoRA

# arith "runlocal": d=32, Hq*D=32, Hkv*D=16, F=64, 2 layers. r x (in + out) per adapted matrix:
# q 32+32, k 32+16, v 32+16, o 32+32, gate 32+64, up 32+64, down 64+32 = 512 per layer.
_LORA_ALL_PER_LAYER = 512
_LORA_QV_PER_LAYER = (32 + 32) + (32 + 16)


def _lora(rank=4, **overrides):
  return _config(**{"lora.rank": rank, "lora.alpha": 8.0, **overrides})


@pytest.mark.parametrize("targets,per_layer,rank", [
    (r"(q|k|v|o|gate|up|down)_proj$", _LORA_ALL_PER_LAYER, 4),
    (r"(q|v)_proj$", _LORA_QV_PER_LAYER, 8)])
def test_lora_state_lines_are_hand_computed_adapter_bytes(targets, per_layer, rank):
  config = _lora(rank, **{"lora.targets": targets, "lora.base_dtype": "bfloat16"})
  cfg = _model(config)
  adapter_bytes = 2 * per_layer * rank * 4  # 2 layers, f32, replicated on every mesh
  tx = train.make_optimizer(1e-3, 10)
  counts = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(tx.init, {})))
  full = memory.plan(_config(), cfg, {"fsdp": 2})
  for mesh_shape in ({"data": 1}, {"fsdp": 2}, {"data": 2, "fsdp": 2}):
    p = memory.plan(config, cfg, mesh_shape)
    assert p.item(f"params: LoRA adapters (r={rank})").bytes == adapter_bytes
    assert p.item("optimizer (adamw mu, nu)").bytes == 2 * adapter_bytes + counts  # mu, nu
    assert p.item("gradients (adapters)").bytes == adapter_bytes
    names = {it.name for it in p.items}
    assert "params" not in names and "gradients" not in names
  # The frozen base: every parameter in bf16, split like the f32 params.
  one = memory.plan(config, cfg, {"data": 1}).item("frozen base (bfloat16, LoRA)").bytes
  assert one == cfg.num_params() * 2
  two = memory.plan(config, cfg, {"fsdp": 2}).item("frozen base (bfloat16, LoRA)").bytes
  assert two == full.item("params").bytes // 2


def test_lora_has_no_reference_copy_with_kl_and_merging_is_a_rollout_line():
  config = _lora(**{"rl.kl_coef": 0.1})
  p = memory.plan(config, _model(config), {"data": 1, "fsdp": 2})
  names = {it.name for it in p.items}
  assert "reference params (kl_coef > 0)" not in names
  assert "reference forward (one minibatch, no grad)" in names  # the base, adapters off
  merged = p.item("merged adapted weights (rollout)")
  assert merged.phase == "rollout" and merged.bytes > 0
  # Base in the param dtype (f32 here): the merged copy is every projection once, split like
  # the base (plus one matrix's f32 A@B).
  cfg = _model(config)
  proj = 2 * (32 * 32 * 2 + 32 * 16 * 2 + 32 * 64 * 3) * 4 // 2
  assert proj < merged.bytes <= proj + 64 * 32 * 4
  off = memory.plan(_lora(**{"rl.kl_coef": 0.1, "lora.merge_for_sampling": False}), cfg,
                    {"data": 1, "fsdp": 2})
  assert not any(it.name.startswith("merged") for it in off.items)
  # No full-size gradient, optimizer state or reference copy (at this toy size the
  # activations, which LoRA does not shrink, still dominate the grad phase).
  full = memory.plan(_config(**{"rl.kl_coef": 0.1}), cfg, {"data": 1, "fsdp": 2})
  state = [sum(it.bytes for it in q.items if it.phase == "state") for q in (p, full)]
  assert state[0] < state[1] - full.item("reference params (kl_coef > 0)").bytes
  assert p.item("gradients (adapters)").bytes < full.item("gradients").bytes


def test_lora_targets_that_match_nothing_are_a_config_error():
  config = _lora(**{"lora.targets": r"nothing_proj$"})
  with pytest.raises(configs.ConfigError, match="lora"):
    memory.plan(config, _model(config), {"data": 1})


def test_remat_counts_layer_inputs_only_where_it_is_realised():
  config = _config(**{"rl.remat": True})
  cfg = _model(config)
  on_cpu = memory.plan(config, cfg, {"data": 1}).item("saved activations (backward)").bytes
  off = memory.plan(_config(), cfg, {"data": 1}).item("saved activations (backward)").bytes
  assert on_cpu == off  # XLA:CPU: measured to realise almost none of it
  real = memory.plan(config, cfg, {"data": 1}, remat_realised=True)
  assert real.item("saved activations (backward)").bytes < off


def test_lora_state_lines_match_init_state_on_a_real_mesh():
  lc = {"lora.targets": r"(q|v|down)_proj$", "lora.base_dtype": "bfloat16"}
  config = _lora(8, **lc, **{"rl.kl_coef": 0.1})
  cfg = _model(config)
  _, params = transformer.init_params(cfg)
  mesh = shd.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
  tx = train.make_optimizer(1e-3, 10)
  state = train.init_state(params, tx, 0, mesh, with_ref=True,
                           lora=configs.resolve(config).lora)
  assert state.ref_params is None
  p = memory.plan(config, cfg, {"data": 2, "fsdp": 2})
  assert p.item("params: LoRA adapters (r=8)").bytes == _bytes_on_first_device(state.params)
  assert p.item("optimizer (adamw mu, nu)").bytes == _bytes_on_first_device(state.opt_state)
  assert p.item("frozen base (bfloat16, LoRA)").bytes == _bytes_on_first_device(state.base)


def test_a_lora_update_with_kl_compiles_to_what_the_plan_says():
  """XLA's memory analysis of rlx.train.update for a LoRA state (adapters on all 7
  projections, bf16 frozen base, kl_coef > 0: the reference is the base, adapters off),
  against the plan's peak (no safety margin). Activations dominate here (d=128, F=512)."""
  import functools
  from rlx.model import ModelConfig
  from rlx.model import lora as lora_lib
  from rlx.sampler.sampling import SamplingParams
  v, t, p, rows = 4096, 512, 16, 8
  model = ModelConfig(vocab_size=v, num_layers=2, d_model=128, num_heads=4, num_kv_heads=2,
                      head_dim=32, mlp_dim=512)
  config = _config(**{"rl.prompts_per_step": 2, "rl.group_size": 4, "rl.kl_coef": 0.1,
                      "sampler.max_new_tokens": t, "sampler.max_prompt_len": p,
                      "rl.logprob_chunk": 128, "memory.activation_margin": 1.0,
                      "lora.rank": 8, "lora.alpha": 16.0, "lora.base_dtype": "bfloat16",
                      "update_shape.cpu_micro_tokens": 0})  # the whole batch, as compiled below
  lc = configs.resolve(config).lora
  graphdef, abstract = transformer.abstract_params(model)
  tx = train.make_optimizer(1e-3, 10)
  sds = jax.ShapeDtypeStruct
  i32, f32 = jax.numpy.int32, jax.numpy.float32
  ro = _abstract_rollouts(rows, p, t)

  def make(params):
    adapters = lora_lib.init_adapters(params, lc)
    return train.TrainState(
        params=adapters, opt_state=tx.init(adapters),
        rng=jax.numpy.zeros((2,), jax.numpy.uint32), step=jax.numpy.zeros((), i32),
        policy_version=jax.numpy.zeros((), i32), base=lora_lib.cast_base(params, lc))

  state = jax.eval_shape(make, abstract)
  cfg = train.StepConfig(prompts_per_step=2, group_size=4, advantage="grpo", num_updates=1,
                         num_minibatches=1, loss=train.LossConfig(kl_coef=0.1),
                         sampling=SamplingParams(max_new_tokens=t), logprob_chunk=128, lora=lc)
  fn = jax.jit(functools.partial(train.update, graphdef=graphdef, cfg=cfg, tx=tx),
               donate_argnums=0)
  ma = fn.lower(state, ro).compile().memory_analysis()
  xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes
  planned = memory.plan(config, model, {"data": 1}, num_prompts=8)
  assert planned.peak_phase == "grad"
  assert abs(planned.total_bytes - xla) <= 0.1 * xla, (planned.total_bytes, xla)


# ----------------------------------------------------------------------------- evaluation


def _layer0_matrices(cfg):
  _, abstract = transformer.abstract_params(cfg)
  layer = abstract["layer_0"]
  return {**layer["attn"], **layer["mlp"]}


def test_eval_phase_models_the_run_sampler():
  """The Evaluator decodes with config.sampler.impl: paged (group_size=1, its own pool per
  batch shard, params all-gathered under FSDP) or dense; LoRA's merged copy is live in both."""
  cfg = _model(_config())
  paged_plan = memory.plan(_config(**{"sampler.impl": "paged"}), cfg, {"data": 2, "fsdp": 2})
  eval_names = {it.name for it in paged_plan.items if it.phase == "eval"}
  # All-gathered params: the gather writes q/k/v and gate/up into their concatenation.
  assert eval_names == {"eval sampler KV pool (paged)", "eval sampler params (all-gathered)",
                        "eval sampler temporaries (paged)"}
  # Replicated params: the paged sampler's fused copy of q/k/v and gate/up, every layer, whole.
  replicated = memory.plan(_config(**{"sampler.impl": "paged"}), cfg, {"data": 2})
  per_layer = sum(math.prod(leaf.shape) for name, leaf in _layer0_matrices(cfg).items()
                  if name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
  assert replicated.item("fused q/k/v, gate/up (eval)").bytes == per_layer * cfg.num_layers * 4
  assert (paged_plan.item("eval sampler params (all-gathered)").bytes
          == paged_plan.item("sampler params (all-gathered)").bytes)
  # eval_batch_size=256 over 4 batch shards: 64 prompts per shard, one slot each, no sharing.
  assert "(64 seqs, group 1, 64 slots)" in paged_plan.item("eval sampler KV pool (paged)").formula
  dense_plan = memory.plan(_config(**{"sampler.impl": "dense"}), cfg, {"data": 2, "fsdp": 2})
  assert {it.name for it in dense_plan.items if it.phase == "eval"} == {
      "eval sampler KV cache (dense)", "eval sampler temporaries (dense)",
      "fused q/k/v, gate/up (eval)"}
  lora = memory.plan(_lora(**{"sampler.impl": "paged"}), cfg, {"data": 1, "fsdp": 2})
  assert lora.item("merged adapted weights (eval)").phase == "eval"
  # Unmerged adapters on every projection: nothing is fused.
  unmerged = memory.plan(_lora(**{"sampler.impl": "paged", "lora.merge_for_sampling": False}),
                         cfg, {"data": 2})
  assert not [it for it in unmerged.items if it.name.startswith("fused")]
  assert lora.item("eval sampler KV pool (paged)").bytes > 0


@pytest.mark.parametrize("mesh_shape,layers,bs,t", [
    ({"fsdp": 2}, 2, 32, 64),  # decode attention's page gather dominates; params all-gathered
    ({"data": 1}, 4, 64, 8),  # short completions: admission's per-layer page reads dominate
])
def test_a_paged_evaluation_compiles_to_what_the_plan_says(mesh_shape, layers, bs, t):
  """XLA's memory analysis of the Evaluator's jitted batch (rlx.evaluate: the paged sampler,
  group_size=1, per batch shard under shard_map, which all-gathers FSDP params) against the
  plan's eval phase (no safety margin), less the state the evaluation does not take (the
  optimizer, selector and prompt pool). f32: XLA:CPU upcasts a bf16 pool (see rlx.memory)."""
  import dataclasses
  from rlx import evaluate
  from rlx.data.tasks import PromptPool
  from rlx.model import ModelConfig
  p = 16
  model = ModelConfig(vocab_size=512, num_layers=layers, d_model=128, num_heads=4,
                      num_kv_heads=2, head_dim=32, mlp_dim=512)
  config = _config(**{"sampler.impl": "paged", "sampler.eval_batch_size": bs,
                      "sampler.max_prompt_len": p, "sampler.max_new_tokens": t,
                      "memory.activation_margin": 1.0})
  spec = configs.resolve(config)
  sizes = {a: mesh_shape.get(a, 1) for a in shd.AXES}
  mesh = shd.make_mesh(**sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
  graphdef, abstract = transformer.abstract_params(model)
  pool = PromptPool(prompts=np.ones((bs, p), np.int32), prompt_lens=np.full((bs,), p, np.int32),
                    answers=np.ones((bs, 4), np.int32), answer_lens=np.full((bs,), 4, np.int32),
                    difficulty=np.zeros((bs,), np.int32))
  # One decode width and one context width: the widest of each sets the peak (checked: the
  # default 4 + 4 compile to within 0.1% of this), and compiling is 3x faster.
  pc = dataclasses.replace(spec.sampler.paged, slot_buckets=1, context_buckets=1)
  ev = evaluate.Evaluator(graphdef, pool, spec.sampler.sampling(eos_id=1, pad_id=0, greedy=True),
                          bs, mesh, sampler_impl="paged", paged=pc)
  sds = jax.ShapeDtypeStruct
  params = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, sharding=s), abstract,
                        shd.param_shardings(abstract, mesh))
  batch = [sds(x.shape, x.dtype, sharding=shd.batch_sharding(mesh, x.ndim))
           for x in (pool.prompts, pool.prompt_lens, pool.answers, pool.answer_lens)]
  ma = ev._run.lower(params, *batch).compile().memory_analysis()  # pylint: disable=protected-access
  xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes
  planned = memory.plan(config, model, mesh_shape, num_prompts=8)
  not_taken = sum(it.bytes for it in planned.items
                  if it.phase == "state" and it.name != "params")
  got = planned.phase_bytes()["eval"] - not_taken
  gathered = "eval sampler params (all-gathered)" in {it.name for it in planned.items}
  assert gathered == ("fsdp" in mesh_shape)
  assert abs(got - xla) <= 0.1 * xla, (got, xla)


def test_bf16_compute_plans_the_samplers_weight_copy():
  """model.dtype="bfloat16" over f32 masters: rollout and eval each hold the sampler's bf16
  copy of the weight matrices (rlx.step_state.sampling_copy), its real bytes on a device of
  an FSDP mesh; f32 compute makes no copy; an overlap generator holds the copy (and its f32
  vectors) instead of the params."""
  config = _config(**{"model.dtype": "bfloat16"})
  cfg = _model(config)
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
  _, params = transformer.init_params(cfg)
  mesh = shd.make_mesh(1, 2, devices=jax.devices()[:2])
  state = train.init_state(params, train.make_optimizer(1e-3, 10), 0, mesh)
  copy = jax.jit(lambda p: train.sampling_copy(p, "bfloat16"))(state.params)
  matrices = [x for x in jax.tree.leaves(copy) if x.ndim >= 2]
  assert {x.dtype for x in matrices} == {jax.numpy.dtype("bfloat16")}
  p = memory.plan(config, cfg, {"fsdp": 2})
  for phase in ("rollout", "eval"):
    line = p.item(f"sampling weights (bfloat16 copy, {phase})")
    assert line.phase == phase and line.bytes == _bytes_on_first_device(matrices)
  assert p.item("params").bytes == _bytes_on_first_device(state.params)  # f32 masters
  f32 = _config()
  assert not [it for it in memory.plan(f32, _model(f32), {"fsdp": 2}).items
              if it.name.startswith("sampling weights")]
  gen, _ = memory_overlap.plan_overlap(config, cfg, {"data": 2}, {"fsdp": 2})
  assert gen.item("policy copy (params)").bytes == sum(
      x.nbytes for x in jax.tree.leaves(train.sampling_copy(params, "bfloat16")))
  assert not [it for it in gen.items if it.name.startswith("sampling weights")]
