"""From an experiment's ml_collections config to the typed, validated objects rlx runs on.

Every check here runs before anything is compiled or written, so a mistake in a config costs
seconds: each failure is one sentence naming the config key, the bad value and what was
expected. Each section is read and checked by its spec's `from_config` (rlx.specs, and beside
the code that owns it: rlx.rl.*, rlx.model.lora); `resolve` composes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections as mlc

from rlx import config_checks as chk
from rlx.errors import ConfigError
from rlx.model.config import ModelConfig
from rlx.model.lora import LoRAConfig
from rlx.rl.adaptive import AdaptiveConfig
from rlx.rl.length import LengthConfig
from rlx.rl.replay import ReplayConfig
from rlx.rl.selection import SelectionConfig
from rlx.sampler.sampling import SamplingParams
# The specs are rlx.configs' vocabulary too (configs.RunSpec, configs.TaskSpec, ...).
# pylint: disable-next=unused-import
from rlx.specs import (PIPELINE_MODES, SAMPLER_IMPLS, CheckpointSpec, GuardSpec,
                       MemorySpec, MeshSpec, ModelSpec, OptimSpec, PipelineSpec, RLSpec,
                       SamplerSpec, SFTSpec, TaskSpec, TokenizerSpec, paged_config)

MAX_TOKENS = chk.MAX_TOKENS

# Keys that moved: a config or override that still sets one is refused, naming the new key.
MOVED_KEYS = {
    "rl.update_buckets": "update_shape.width_buckets",
    "rl.update_parts": "update_shape.length_parts",
    "rl.update_micro_rows": "update_shape.micro_rows",
    "rl.cpu_micro_tokens": "update_shape.cpu_micro_tokens",
    "rl.drop_zero_adv_rows": "",  # always on where it gives the same step
}


def moved_key_error(key: str) -> ConfigError | None:
  """The one-line error for a key that moved ("rl.update_buckets"), or None."""
  key = key.removeprefix("config.")
  if key not in MOVED_KEYS:
    return None
  if MOVED_KEYS[key]:
    return ConfigError(f"config.{key} is now config.{MOVED_KEYS[key]}; set that instead.")
  return ConfigError(f"config.{key} is no longer a key: rows without signal are left out "
                     f"wherever that gives the same step (one minibatch, no KL term); remove it.")


def _refuse_moved_keys(config) -> None:
  for key in MOVED_KEYS:
    section, _, leaf = key.partition(".")
    if section in config and leaf in config[section]:
      raise moved_key_error(key)


@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  """One experiment config, validated and typed (`resolve`)."""

  seed: int
  total_steps: int
  eval_every: int
  fused_step: bool
  checkpoint: CheckpointSpec
  task: TaskSpec
  tokenizer: TokenizerSpec
  model: ModelSpec
  warm_start_dir: str
  sft: SFTSpec
  rl: RLSpec
  selection: SelectionConfig
  replay: ReplayConfig | None
  length: LengthConfig
  sampler: SamplerSpec
  optim: OptimSpec
  guard: GuardSpec
  memory: MemorySpec
  mesh: MeshSpec
  record: dict[str, Any]  # the ConfigDict as JSON (config.json, checkpoint metadata)
  lora: LoRAConfig | None = None  # None: full-parameter training
  pipeline: PipelineSpec = PipelineSpec()
  adaptive: AdaptiveConfig | None = None  # None: every group gets rl.group_size samples


def validate(config: mlc.ConfigDict, num_batch_devices: int = 1) -> None:
  """Semantic checks that ml_collections' type checks do not cover (see `resolve`)."""
  resolve(config, num_batch_devices)


def resolve(config: mlc.ConfigDict | RunSpec, num_batch_devices: int = 1) -> RunSpec:
  """Checks `config` and returns it as a RunSpec; every failure is one ConfigError naming the
  key, its value and what was expected. `num_batch_devices`: the data-parallel devices (mesh
  data x fsdp) the batches are split over."""
  if isinstance(config, RunSpec):
    return config
  _refuse_moved_keys(config)
  for key in ("total_steps", "eval_every"):
    chk.integer(config, key)
  checkpoint = CheckpointSpec.from_config(config)
  replay = ReplayConfig.from_config(config, num_batch_devices)
  rl = RLSpec.from_config(config, replay.num_samples if replay else 0, num_batch_devices)
  model = ModelSpec.from_config(config)
  return RunSpec(
      # jax.random.key keeps 32 bits of the seed: 2**32 would run as seed 0.
      seed=chk.integer(config, "seed", 0, 2 ** 32 - 1), total_steps=config.total_steps,
      eval_every=config.eval_every, fused_step=bool(config.fused_step), checkpoint=checkpoint,
      rl=rl, replay=replay, selection=SelectionConfig.from_config(config),
      adaptive=AdaptiveConfig.from_config(config, num_batch_devices),
      length=LengthConfig.from_config(config),
      sampler=SamplerSpec.from_config(config, num_batch_devices),
      optim=OptimSpec.from_config(config), sft=SFTSpec.from_config(config),
      guard=GuardSpec.from_config(config), memory=MemorySpec.from_config(config),
      mesh=MeshSpec.from_config(config), lora=LoRAConfig.from_config(config),
      pipeline=PipelineSpec.from_config(config), task=TaskSpec.from_config(config),
      tokenizer=TokenizerSpec.from_config(config), model=model,
      warm_start_dir=config.warm_start.dir or "", record=_record(config, model))


def _record(config: mlc.ConfigDict, model: ModelSpec) -> dict[str, Any]:
  """The config as JSON with model.dtype resolved ("auto" -> what this backend computes in):
  config.json and the checkpoints say what the run computed with, and a resume on another
  backend names the change."""
  record = to_plain(config)
  record["model"]["dtype"] = model.dtype
  return record


def replay_config(config: mlc.ConfigDict) -> ReplayConfig | None:
  return ReplayConfig.from_config(config)


def sampling_params(config: mlc.ConfigDict, *, eos_id: int, pad_id: int,
                    stop_ids: tuple[int, ...] = (), greedy: bool = False) -> SamplingParams:
  return resolve(config).sampler.sampling(eos_id=eos_id, pad_id=pad_id, stop_ids=stop_ids,
                                          greedy=greedy)


def model_config(config: mlc.ConfigDict, vocab_size: int) -> ModelConfig:
  """The tiny-model architecture from config.model (HF checkpoints bring their own)."""
  return ModelSpec.from_config(config).tiny(vocab_size)


def to_plain(config: mlc.ConfigDict) -> dict[str, Any]:
  """JSON-able dict (tuples become lists)."""
  return config.to_dict()


def defaults() -> mlc.ConfigDict:
  """Every config key rlx reads, at its default; experiment files override what they need.

  An override of a key that is not here is an error ("Did you mean ..."), so the names below
  are the complete vocabulary of a config.
  """
  c = mlc.ConfigDict()
  c.seed = 0
  c.total_steps = 200
  c.eval_every = 25
  c.checkpoint_every = 50
  c.keep_checkpoints = 2  # newest checkpoints kept (>= 1); 0 keeps every checkpoint
  c.fused_step = False  # True: one jitted step (no generation/update time split)

  c.task = mlc.ConfigDict()
  # arithmetic | column_add | gsm8k | math, or a task an experiment registered
  # (rlx.data.registry.register_task)
  c.task.name = "arithmetic"
  c.task.ops = ("add",)  # arithmetic: ("add", "mul")
  c.task.levels = (2, 3, 4, 5)  # arithmetic: numbers of digits
  c.task.num_train_per_level = 5000
  c.task.num_eval_per_level = 200
  c.task.reverse_answer = False  # arithmetic: answers lowest digit first
  c.task.teacher_error_levels = ()  # arithmetic: warm-start answers drop a carry here ...
  c.task.teacher_error_rate = 0.0  # ... with this probability
  c.task.teacher_verbose_levels = ()  # column_add: warm-start solutions padded here ...
  c.task.teacher_verbose_rate = 0.0  # ... with this probability
  c.task.seed = 0
  c.task.manual_dir = ""  # gsm8k / math: the directory holding the JSONL files
  c.task.num_eval = 0  # gsm8k / math: cap on held-out examples (0: all)
  c.task.rl_levels = ()  # difficulty levels RL trains on (empty: all)
  # Share of each level in the RL prompt pool, {"level": weight} (empty: every train example of
  # rl_levels once); the pool keeps its size, levels short of examples repeat them.
  c.task.rl_level_weights = {}
  c.task.band = ()  # levels whose accuracy is the headline (empty: all)
  c.task.eval_levels = ()  # levels of the held-out set to evaluate (empty: all)
  c.task.data_dir = ""  # where TFDS prepares the data (empty: WORKDIR/data)
  c.task.instruction = "{prompt}"  # prompt template; {prompt} is the problem text
  # "exact_match": the task's jnp verifier inside the jitted step (exact match, or the final
  # answer after a marker). A registered Python reward ("math", "exact") or
  # "package.module:function" runs on the host between the halves. Empty: the task's default
  # (exact_match for arithmetic / column_add, math for gsm8k / math).
  c.task.reward = ""
  # A host reward that has not returned after this many seconds stops the run (one line);
  # SIGTERM while it runs still checkpoints the last finished step and exits 75.
  c.task.reward_timeout_s = 600.0

  c.tokenizer = mlc.ConfigDict()
  c.tokenizer.vocab_size = 64  # for a sentencepiece model trained on the task text
  c.tokenizer.path = ""  # a .model / tokenizer.json / HF directory (empty: model.path or train)
  c.tokenizer.chat_template = False  # render prompts with the tokenizer's chat template
  c.tokenizer.system_prompt = ""

  c.model = mlc.ConfigDict()
  c.model.path = ""  # a Hugging Face checkpoint directory (empty: the tiny model below)
  c.model.num_layers = 4
  c.model.d_model = 128
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 32
  c.model.mlp_dim = 384
  c.model.rope_theta = 10_000.0
  c.model.tie_embeddings = True
  c.model.dtype = "auto"  # compute: auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  c.model.param_dtype = "float32"  # master params and optimizer state
  # Run the layers as one lax.scan over their stacked weights (compile time flat in depth;
  # same numbers and the same params tree): the update, evaluation and the dense sampler;
  # the paged sampler and models whose layers differ (Gemma's sliding/global) run unrolled.
  c.model.scan_layers = False

  c.warm_start = mlc.ConfigDict()
  # A base model directory written by an earlier run (WORKDIR/base); empty: look in this
  # workdir, else run the supervised warm start (config.sft).
  c.warm_start.dir = ""

  c.sft = mlc.ConfigDict()
  c.sft.steps = 1000
  c.sft.batch_size = 128
  c.sft.lr = 2e-3
  c.sft.warmup_steps = 100
  c.sft.max_len = 20
  c.sft.level_weights = {"2": 1.0, "3": 1.0, "4": 1.0}  # sampling weight per level
  # Each batch from one level (drawn by level_weights), cut to that level's longest example:
  # with long worked solutions most of a mixed batch would be padding.
  c.sft.batch_by_level = False

  c.rl = mlc.ConfigDict()
  c.rl.prompts_per_step = 16
  c.rl.group_size = 8
  c.rl.advantage = "grpo"  # grpo | dr_grpo | rloo
  c.rl.num_updates = 1  # passes over each batch
  c.rl.num_minibatches = 1  # optimizer steps per pass
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28  # DAPO clip-higher
  c.rl.aggregation = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  c.rl.kl_coef = 0.0  # > 0 allocates reference params
  c.rl.kl_estimator = "k3"
  c.rl.is_cap = 2.0  # C of the decoupled correction pi_old / mu
  c.rl.is_mode = "truncate"  # truncate | mask
  c.rl.ratio_level = "token"  # token | sequence (GSPO)
  # PPO trust region around pi_old = the recomputed proximal policy (decoupled PPO, with the
  # correction above) or the behaviour policy that sampled the data (off-policy PPO-clip).
  c.rl.anchor = "proximal"
  # Update cost and memory (rlx.train.update). Log-probs over `logprob_chunk` completion
  # positions at a time (0: all at once; long completions x large vocabularies want 128-512:
  # [rows, chunk, V] f32 logits live instead of [rows, T, V]); per-layer rematerialisation;
  # pi_old taken from the first minibatch's gradient pass (no separate forward).
  c.rl.logprob_chunk = 0
  c.rl.remat = False
  c.rl.fuse_pi_old = True

  # The update's static shape (rlx.update_plan): what it computes on, not what it computes
  # (every setting gives the same step, up to float summation order). It compiles for `width_buckets` completion widths and
  # cuts the padding columns; rows without signal are left out where at most half carry any
  # (one minibatch, no KL term: they add nothing to the gradient).
  c.update_shape = mlc.ConfigDict()
  c.update_shape.width_buckets = 4
  # With one minibatch, the rows are sorted by length and split into `length_parts` equal
  # micro-batches, each cut to its own width (gradients summed: one optimizer step, same
  # result); short rows stop paying for the longest row's width. 1 = off.
  c.update_shape.length_parts = 2
  # Gradient accumulation: > 0 splits the update (one minibatch) into micro-batches of at most
  # this many rows, run as a scan (one part's activations live at a time), also when their
  # widths are equal; the gradients are summed (same step). A memory knob, and on CPU a speed
  # one: 8 at 100M cut XLA's temporary buffer 5.05 -> 1.05 GB and the update 36.5 -> 24.6 s
  # (`experiments/benchmarks/bench_faults.py --micro_rows=8`). 0 = off (`length_parts` alone).
  c.update_shape.micro_rows = 0
  # On the CPU backend, where micro_rows is 0 and there is one minibatch: micro-batches
  # of at most this many padded tokens (rows x (max_prompt_len + max_new_tokens)). There the
  # whole batch's temporaries cost page faults and cache misses more than the smaller GEMMs
  # lose: at 2048 tokens, update 0.89x on the default experiment (2 parts) and on the
  # reasoning one (8 parts), 0.67x at 100M (4 parts; README "Gradient accumulation"); 1024
  # against 2048: 0.85-0.88x at 100M (8 parts of 4 rows), 0.95x / 0.98x on the default /
  # reasoning experiments; 512 no better than 1024 at 100M. Accelerators keep the whole
  # batch (not measured there). 0 = off.
  c.update_shape.cpu_micro_tokens = 1024

  # Sample efficiency (rlx.rl.selection / replay / length); off = plain GRPO.
  c.selection = mlc.ConfigDict()
  c.selection.mode = "uniform"  # uniform | band | history | skip | oracle | probe
  c.selection.ema = 0.5
  c.selection.floor = 0.05
  c.selection.history_cooldown = 50
  c.selection.history_wrong_weight = 0.25
  # history / skip: probe this many uniform prompts' true pass rates every shadow_every steps
  # and log how often the rule's excluded ones would have given a mixed group (exact-match
  # tasks and tasks naming their correct completions, TaskDef.probe_references;
  # rlx.train.shadow_probe). 0: off.
  c.selection.shadow_probe = 0
  c.selection.shadow_every = 10
  c.selection.skip_keep_base = 0.25
  c.selection.dynamic_filter = False  # DAPO dynamic sampling
  c.selection.oversample = 2
  # band mode, unvisited prompts: "mean" (4 p(1-p) at the bucket's mean pass rate) or
  # "spread" (4 E[p(1-p)] over the bucket's groups; see rlx.rl.selection).
  c.selection.bucket_score = "mean"
  # oracle (exact-match tasks, or with probe references): this many prompts drawn uniformly
  # are probed by a teacher-forced forward each step and the n most likely to give a mixed
  # group sampled.
  # 256 (or 0: the whole pool) measures the headroom; 4x prompts_per_step is the cheap lever
  # (experiments/results/efficiency_chains.md).
  c.selection.oracle_candidates = 256
  # probe (exact-match tasks, or with probe references): the oracle's probe as a lever, on
  # probe_factor x the prompts sampled per step (x oversample with dynamic_filter). At 8:
  # 4.78x fewer tokens to target on op-chains at 2.12x less compute, but 1.85x the compute
  # on arithmetic; reasoning 0.87x at 2 prompts per step, 1.09x at 1 (rlx.rl.selection).
  c.selection.probe_factor = 8
  # oracle / probe: rank the candidates by the chance of a mixed group ("mixed") or by that
  # chance per expected generated token ("mixed_per_token": where uncertain prompts are the
  # long ones; experiments/results/efficiency_probe_reasoning.md).
  c.selection.probe_score = "mixed"

  c.replay = mlc.ConfigDict()
  c.replay.enabled = False
  c.replay.capacity = 1024
  c.replay.num_samples = 64
  c.replay.max_staleness = 4
  c.replay.max_reuse = 2
  c.replay.priority = "abs_adv"  # abs_adv | recency | uniform

  # Adaptive rollout budgets (rlx.rl.adaptive): `first` samples per prompt, then
  # rl.group_size - first more for `extend_groups` groups chosen by `priority` from the first
  # round's rewards. first = 0: off (every group gets rl.group_size samples).
  c.adaptive = mlc.ConfigDict()
  c.adaptive.first = 0
  c.adaptive.extend_groups = 0
  c.adaptive.priority = "uncertain"  # uncertain | unsolved

  c.length = mlc.ConfigDict()
  c.length.overlong_shaping = False
  c.length.overlong_buffer = 2
  c.length.overlong_penalty = 1.0
  c.length.overlong_filter = False
  # Kimi k1.5 group-relative length reward (rlx.rl.length): shorter correct answers in a group
  # gain up to +0.5 x this, longer ones lose up to -0.5 x this; wrong answers never gain.
  c.length.length_reward = 0.0
  # Where it enters: "advantage" adds it after GRPO's std normalisation (its push bounded by
  # the weight; rlx.rl.length says why), "reward" to the task reward as Kimi k1.5 writes it.
  c.length.length_mode = "advantage"
  # How a group's lengths are compared: "range" (Kimi k1.5: always +-0.5 over the group's
  # shortest..longest), "relative" (the difference from the group's midrange relative to it,
  # so the push fades as lengths converge; rlx.rl.length).
  c.length.length_scale = "range"
  # Steps over which the length weight ramps linearly from 0 to length_reward (0: full weight
  # from the first step), as Kimi k1.5 warms its length penalty up.
  c.length.length_warmup_steps = 0
  # Per-level guard (rlx.rl.length.LengthGuard): over the first guard_steps RL steps the term
  # is off and each difficulty level's sampled accuracy is measured; afterwards a level's term
  # fades to off as its moving-average accuracy (decay guard_decay) falls guard_margin below
  # that reference. 0: no guard. Measured on experiments/reasoning.py: it holds a level against
  # its own length push, not against a style switch the other levels cause
  # (experiments/results/reasoning_levels.md).
  c.length.guard_margin = 0.0
  c.length.guard_steps = 10
  c.length.guard_decay = 0.9

  c.sampler = mlc.ConfigDict()
  c.sampler.impl = "paged"  # paged (default) | dense (the reference oracle)
  c.sampler.page_size = 16  # paged: tokens per KV page
  c.sampler.num_pages = 0  # paged: pages per data shard (0: enough for every slot)
  c.sampler.max_slots = 0  # paged: sequences decoded at once per shard (0: all of them)
  c.sampler.attention = "reference"  # paged: reference | pallas | interpret
  c.sampler.cascade = False  # paged: GRPO prompt pages attended once per group (accelerators)
  c.sampler.max_prompt_len = 16
  c.sampler.max_new_tokens = 8
  c.sampler.temperature = 1.0
  c.sampler.top_k = 0
  c.sampler.top_p = 1.0
  c.sampler.eval_batch_size = 256

  c.optim = mlc.ConfigDict()
  c.optim.lr = 3e-4
  c.optim.schedule = "cosine"  # constant | cosine
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.optim.grad_clip = 1.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999

  c.guard = mlc.ConfigDict()
  c.guard.max_consecutive_skips = 3  # steps with non-finite loss/grads before stopping
  c.guard.reward_range = (-10.0, 10.0)  # a reward outside stops the run, naming the example

  c.memory = mlc.ConfigDict()
  c.memory.device_bytes = 0  # per-device memory for the plan (0: ask the device / host RAM)
  c.memory.activation_margin = 1.2
  c.memory.check = True  # refuse to start a run whose plan does not fit

  # LoRA (rlx.model.lora): adapters on the projections, the base frozen (and the KL reference
  # for free). rank 0 = full-parameter training.
  c.lora = mlc.ConfigDict()
  c.lora.rank = 0
  c.lora.alpha = 32.0  # the update is scaled by alpha / rank
  c.lora.targets = r"(q|k|v|o|gate|up|down)_proj$"  # regex over paths like layer_0/attn/q_proj
  c.lora.dropout = 0.0  # only 0 is supported
  c.lora.base_dtype = ""  # frozen base dtype: "" (the model's) | float32 | bfloat16
  c.lora.merge_for_sampling = True  # the sampler decodes with W + scale*A@B merged per step

  # Generation and training on two sub-meshes at once (rlx.pipeline). config.mesh then shapes
  # the learner's sub-mesh; the generator's is data-parallel (x generator_tensor).
  c.pipeline = mlc.ConfigDict()
  c.pipeline.mode = "sync"  # sync | overlap
  c.pipeline.generator_devices = 0  # overlap: devices that generate (0: half)
  c.pipeline.generator_tensor = 1
  c.pipeline.max_staleness = 1  # overlap: the generator runs this many steps ahead

  c.mesh = mlc.ConfigDict()
  c.mesh.data = -1  # -1: the devices left over
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  return c


def with_overrides(config: mlc.ConfigDict, overrides: dict[str, Any]) -> mlc.ConfigDict:
  """A copy of `config` with dotted-key overrides applied ({"rl.group_size": 8}); the keys
  must exist (as on the command line)."""
  out = mlc.ConfigDict(config.to_dict())
  for key, value in overrides.items():
    if moved_key_error(key):
      raise moved_key_error(key)
    node = out
    *parents, leaf = key.split(".")
    for p in parents:
      if p not in node:
        raise ConfigError(f"override {key!r}: config has no section {p!r}.")
      node = node[p]
    if leaf not in node:
      raise ConfigError(f"override {key!r}: config has no key {leaf!r}.")
    node[leaf] = value
  return out
