r"""Training-step time against peers: rlx vs TRL's `GRPOTrainer` and Tunix's `GRPOLearner`,
same workload, one run.

  python experiments/benchmarks/bench_peers.py --size=3m --steps=6 --out=/tmp/peers_3m.md
  python experiments/benchmarks/bench_peers.py --size=100m --steps=5
  python experiments/benchmarks/bench_peers.py --size=tiny --steps=2          # seconds: a smoke run
  python experiments/benchmarks/bench_peers.py --size=3m --rlx_only           # rlx alone (no torch)
  python experiments/benchmarks/bench_peers.py --size=3m --peers=trl,tunix \
      --tunix_python=/tmp/tx/bin/python

Tunix (google-tunix 0.1.7) pins safetensors<0.8, which holds transformers at 5.12, older than
TRL 1.16 needs; so it lives in a venv of its own (python -m venv /tmp/tx && /tmp/tx/bin/pip
install -e ".[tunix]") and --tunix_python points its worker there. Its side is what a Tunix
user writes: tunix.models.llama3 loaded from the same safetensors directory, RLCluster with the
vanilla rollout colocated with the actor on one device (one mesh, so no weight sync and no
async rollout), GRPOConfig(num_generations=8, num_iterations=1, beta=0, epsilon=0.2,
epsilon_high=0.28, loss_agg_mode="token-mean"), the same optax chain (clip 1.0, AdamW without
decay), reference model None. Its step is `_run_global_step` (rollout + reward + advantages +
update); its generation is `_generate_and_compute_advantage`. Tunix's completion mask drops
any sampled pad id (a handful per step here), so its token count can fall a little short of
4096 while the compute is the same.

The workload is TRL's / Tunix's GRPO smoke run: 4 prompts x G=8 samples, 128 new tokens at
temperature 1, one optimizer step per training step (one minibatch, num_iterations=1), no KL
(beta=0), f32, constant learning rate, on CPU (TRL on the GPU when torch sees one:
--trl_device). Both trainers start from the same random-init Llama directory written here
(rlx.save_hf; transformers loads it unchanged), tokenize the same 4 prompts with the same
tokenizer.json (both must give the same ids: checked) and score with the same Python reward
(`even_reward`). Hyper-parameters match: lr, Adam b1/b2, grad clip 1.0, clip eps 0.2 / 0.28,
token-mean loss (TRL's "dapo"), group-std advantages; TRL without gradient checkpointing (rlx
does not remat by default).

Equal work: the tokenizer's EOS id is one past the model's vocabulary, so neither sampler can
emit it and every completion is exactly 128 tokens on both sides (--eos_in_vocab puts EOS
inside, then each side stops where it samples it); generated tokens per step are reported.

Each trainer runs in its own worker process (a worker waits for the parent's go before each
step and reports when it is done), as a user runs either: one framework per process.
--schedule=turns (default) interleaves the steps (rlx, TRL, rlx, ...), so both see the same
machine load; --schedule=blocks runs all of rlx's steps, then all of each peer's, each
trainer alone: its process starts for its block and has exited before the next one starts
(an idle peer's memory would still be in the way: Tunix's process holds ~12 GB at 100M).
--same_process runs both in this process (each rlx step in a TRL
callback before TRL's step starts, outside its timing), the method this benchmark first used.
The two trainers are not independent on this machine even in separate processes: XLA maps
and unmaps its temporary buffer (~5 GB at 100M) in every update, 1.4M page faults, and what a
fault costs depends on what the rest of the VM just did with its memory (~2.3 us each with
rlx alone, 3.3 s of a 15 s update; ~18 us right after TRL's step freed its own). So rlx's
update measured 15-18 s alone in a fresh process, 21-23 s in blocks and 31-38 s interleaved
with TRL, while TRL's step changed less (50-71 s either way); the README reports all three
schedules. The first
--warmup steps of each (compilation, lazy init) are dropped; the table shows medians of the
--steps that follow. rlx: generation = sampling + decode + reward, update = the jitted
score + update half. TRL: on_step_begin -> on_step_end of a TrainerCallback; its generation
(`_generate_and_score_completions`) is timed inside. torch runs with 2 threads and
OMP_WAIT_POLICY=PASSIVE, so its idle OpenMP threads do not spin while JAX works.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch's OpenMP starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import rlx  # noqa: E402
from rlx import train, trainer  # noqa: E402
from rlx.experiments.benchmarks.timing import median  # noqa: E402
from rlx.model.config import ModelConfig  # noqa: E402

# Llama-shaped (silu MLP, GQA, RoPE, RMSNorm, tied embeddings); 3m and 100m are the shapes of
# experiments/benchmarks/bench_sampler.py.
MODELS = {
    "tiny": ModelConfig(vocab_size=512, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                        head_dim=16, mlp_dim=128),
    "3m": ModelConfig(vocab_size=4096, num_layers=4, d_model=192, num_heads=6, num_kv_heads=2,
                      head_dim=32, mlp_dim=640),
    "100m": ModelConfig(vocab_size=32000, num_layers=12, d_model=768, num_heads=12,
                        num_kv_heads=4, head_dim=64, mlp_dim=2048),
}
PROMPTS = ("what is 12 + 7 ?", "what is 3 * 9 ?", "what is 40 - 8 ?", "what is 5 + 66 ?")
ANSWERS = ("19", "27", "32", "71")
SPECIALS = ("<pad>", "<unk>", "<s>")  # ids 0, 1, 2; EOS "</s>" is added last
WORDS = ("what", "is", "+", "-", "*", "=", "?")


def even_reward(prompts, completions, **unused) -> list[float]:
  """Fraction of the completion's words that are even numbers (a toy reward with spread, so
  GRPO groups have non-zero advantages); the same function scores both trainers."""
  del prompts, unused
  out = []
  for text in completions:
    words = text.split()
    out.append(sum(w.isdigit() and int(w) % 2 == 0 for w in words) / max(len(words), 1))
  return out


# ============================================================================= shared inputs


def write_tokenizer(directory: str, model_vocab: int, eos_in_vocab: bool = False) -> int:
  """A WordLevel tokenizer.json (+ tokenizer_config.json) over words and the numbers 0..N.

  Returns the EOS id: model_vocab (outside the model: never sampled) or model_vocab - 1.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  n_numbers = model_vocab - len(SPECIALS) - len(WORDS) - int(eos_in_vocab)
  pieces = list(SPECIALS) + list(WORDS) + [str(i) for i in range(n_numbers)] + ["</s>"]
  vocab = {p: i for i, p in enumerate(pieces)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
  tok.add_special_tokens(list(SPECIALS) + ["</s>"])
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return vocab["</s>"]


def make_model_dir(directory: str, model_cfg: ModelConfig, *, seed: int = 0,
                   eos_in_vocab: bool = False) -> None:
  """Random-init Llama weights (rlx.save_hf) + the tokenizer, loadable by rlx and transformers."""
  os.makedirs(directory, exist_ok=True)
  _, params = rlx.init_params(model_cfg, seed)
  rlx.save_hf(model_cfg, params, directory, architecture="LlamaForCausalLM")
  eos = write_tokenizer(directory, model_cfg.vocab_size, eos_in_vocab)
  ids = {"bos_token_id": 2, "pad_token_id": 0}
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    config = json.load(f)
  with open(path, "w") as f:  # eos null: transformers warns about one outside the vocabulary
    json.dump({**config, **ids, "eos_token_id": None}, f, indent=2, sort_keys=True)
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump({**ids, "eos_token_id": eos}, f, indent=2)


def check_tokenizers(directory: str) -> list[list[int]]:
  """The prompts' ids, after checking that rlx and transformers give the same ones."""
  import transformers  # pylint: disable=g-import-not-at-top
  ours = rlx.load_tokenizer(directory)
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  ids = [ours.encode(p, add_special_tokens=True) for p in PROMPTS]
  ref = [theirs(p)["input_ids"] for p in PROMPTS]
  same = (ids == ref and ours.eos_id == theirs.eos_token_id
          and ours.pad_id == theirs.pad_token_id and ours.bos_id == theirs.bos_token_id)
  if not same:
    raise RuntimeError(f"rlx and transformers tokenize differently: {ids} (eos {ours.eos_id}, "
                       f"pad {ours.pad_id}) vs {ref} (eos {theirs.eos_token_id}, pad "
                       f"{theirs.pad_token_id}).")
  return ids


def write_prompts(directory: str) -> None:
  """The 4 prompts as GSM8K-style JSONL (train and test), rlx's local-file task format."""
  os.makedirs(directory, exist_ok=True)
  for name in ("train.jsonl", "test.jsonl"):
    with open(os.path.join(directory, name), "w") as f:
      for q, a in zip(PROMPTS, ANSWERS):
        f.write(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n")


@dataclasses.dataclass(frozen=True)
class Workload:
  prompts: int = 4
  group_size: int = 8
  max_new_tokens: int = 128
  lr: float = 1e-6
  b1: float = 0.9
  b2: float = 0.999
  grad_clip: float = 1.0
  eps_low: float = 0.2
  eps_high: float = 0.28
  temperature: float = 1.0
  seed: int = 0


# ============================================================================= rlx side


def rlx_config(w: Workload, model_dir: str, data_dir: str, prompt_len: int, total_steps: int,
               sampler: str, extra: tuple[str, ...] = ()):
  """rlx's config for the workload (defaults otherwise: grpo advantages, token-mean loss)."""
  return rlx.with_overrides(rlx.default_config(), {
      "seed": w.seed, "total_steps": total_steps, "eval_every": total_steps,
      "task.name": "gsm8k", "task.manual_dir": data_dir, "task.num_eval": len(PROMPTS),
      "task.reward": f"{__name__}:even_reward",
      "model.path": model_dir, "tokenizer.path": model_dir,
      "model.dtype": "float32", "model.param_dtype": "float32",
      "rl.prompts_per_step": w.prompts, "rl.group_size": w.group_size,
      "rl.num_updates": 1, "rl.num_minibatches": 1, "rl.kl_coef": 0.0,
      "rl.eps_low": w.eps_low, "rl.eps_high": w.eps_high,
      "sampler.impl": sampler, "sampler.max_prompt_len": prompt_len,
      "sampler.max_new_tokens": w.max_new_tokens, "sampler.temperature": w.temperature,
      "optim.lr": w.lr, "optim.schedule": "constant", "optim.warmup_steps": 0,
      "optim.weight_decay": 0.0, "optim.grad_clip": w.grad_clip, "optim.b1": w.b1,
      "optim.b2": w.b2, "mesh.data": 1,
  } | _overrides(extra))


def _overrides(extra) -> dict:
  """--rlx key=value pairs (values as Python literals where they parse) for rlx's config."""
  out = {}
  for item in extra:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise SystemExit(f"--rlx {item!r}: expected key=value, e.g. update_shape.micro_rows=8.")
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return out


class RlxStepper:
  """One rlx training step per call (host-Python reward path, as `rlx.run` takes it)."""

  def __init__(self, config, workdir: str):
    self.setup = trainer.build(config, workdir, log=lambda s: None, devices=jax.devices()[:1])
    self.reward = trainer.host_reward_fn(self.setup.spec)
    self.pool = jax.device_put(self.setup.exp.train_pool, self.setup.fns.pool_sharding)
    self.state = self.setup.state
    self.rows = []  # (generation s, update s, generated tokens, mean reward, load)

  def __call__(self) -> None:
    s, load = self.setup, os.getloadavg()[0]
    t0 = time.perf_counter()
    self.state, batch, _ = s.fns.generate(self.state, self.pool)
    rewards = trainer._host_rewards(  # pylint: disable=protected-access
        batch.batch, s.exp, self.reward, s.mesh)
    jax.block_until_ready(rewards)
    shape = train.update_shape(batch, s.step_cfg, scored=False)  # as rlx.run does
    t1 = time.perf_counter()
    self.state, m = s.fns.score_update(self.state, batch, rewards, **shape)
    m = jax.device_get(m)
    t2 = time.perf_counter()
    self.rows.append((t1 - t0, t2 - t1, float(m["ledger/tokens_generated"]),
                      float(np.mean(jax.device_get(rewards))), load))
    print(f"  rlx step {len(self.rows) - 1}: {t1 - t0:.2f} + {t2 - t1:.2f} s", flush=True)


# ============================================================================= TRL side


def trl_available() -> bool:
  return importlib.util.find_spec("trl") is not None


def trl_config(w: Workload, out_dir: str, total_steps: int, use_cpu: bool = True):
  """TRL's GRPOConfig for the workload: one generation of prompts x G per optimizer step
  (use_cpu=False: on the accelerator that torch sees)."""
  import trl  # pylint: disable=g-import-not-at-top
  return trl.GRPOConfig(
      output_dir=out_dir, max_steps=total_steps, seed=w.seed,
      per_device_train_batch_size=w.prompts * w.group_size, gradient_accumulation_steps=1,
      num_generations=w.group_size, max_completion_length=w.max_new_tokens,
      num_iterations=1, beta=0.0, epsilon=w.eps_low, epsilon_high=w.eps_high,
      loss_type="dapo", scale_rewards="group", temperature=w.temperature, top_p=1.0, top_k=0,
      learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
      adam_beta1=w.b1, adam_beta2=w.b2, max_grad_norm=w.grad_clip,
      activation_checkpointing=False, bf16=False, fp16=False, use_cpu=use_cpu,
      logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
      dataloader_num_workers=0)


def trl_on_cpu(device: str) -> bool:
  """--trl_device: 'cpu', 'cuda' (an error without a GPU torch sees) or 'auto' (the GPU when
  torch sees one, else the CPU)."""
  import torch  # pylint: disable=g-import-not-at-top
  if device == "cuda" and not torch.cuda.is_available():
    raise SystemExit("--trl_device=cuda: torch sees no GPU here; use --trl_device=auto or cpu.")
  return device == "cpu" or not torch.cuda.is_available()


def run_trl(w: Workload, model_dir: str, out_dir: str, total_steps: int, before_step,
            device: str = "auto"):
  """Trains TRL's GRPOTrainer for total_steps; calls before_step() ahead of each (untimed).
  device: see trl_on_cpu.

  Returns rows (step s, generation s, generated tokens, mean reward, load) per step.
  """
  import datasets  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(2)
  torch.manual_seed(w.seed)
  # TRL 1.16 still reads transformers' deprecated gradient_checkpointing names.
  warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6.*")
  gen_rows = []

  class TimedGRPOTrainer(trl.GRPOTrainer):

    def _generate_and_score_completions(self, *args, **kwargs):
      t0 = time.perf_counter()
      out = super()._generate_and_score_completions(*args, **kwargs)
      gen_rows.append((time.perf_counter() - t0, int(out["completion_mask"].sum())))
      return out

  class StepTimer(transformers.TrainerCallback):

    def __init__(self):
      self.rows, self.t0, self.load = [], 0.0, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
      before_step()
      self.load = os.getloadavg()[0]
      self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      self.rows.append((time.perf_counter() - self.t0, self.load))
      print(f"  TRL step {len(self.rows) - 1}: {self.rows[-1][0]:.2f} s", flush=True)

  rewards = []

  class RewardLog(transformers.TrainerCallback):

    def on_log(self, args, state, control, logs=None, **kwargs):
      if logs and "reward" in logs:
        rewards.append(float(logs["reward"]))

  use_cpu = trl_on_cpu(device)
  args = trl_config(w, out_dir, total_steps, use_cpu=use_cpu)
  print(f"  TRL on {'the CPU' if use_cpu else torch.cuda.get_device_name(0)}", flush=True)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
  data = datasets.Dataset.from_dict({"prompt": list(PROMPTS), "answer": list(ANSWERS)})
  timer = StepTimer()
  grpo = TimedGRPOTrainer(model=model, reward_funcs=even_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer, RewardLog()])
  grpo.remove_callback(transformers.trainer_callback.PrinterCallback)
  grpo.train()
  if len(timer.rows) != total_steps or len(gen_rows) != total_steps:
    raise RuntimeError(f"TRL ran {len(timer.rows)} steps ({len(gen_rows)} generations); "
                       f"expected {total_steps}.")
  rewards += [float("nan")] * (total_steps - len(rewards))
  return [(t, g, n, r, load) for (t, load), (g, n), r in zip(timer.rows, gen_rows, rewards)]


# ============================================================================= Tunix side


def tunix_available(python: str = "") -> bool:
  """Whether Tunix imports here, or in the interpreter `python` (its own venv)."""
  if not python or os.path.abspath(python) == os.path.abspath(sys.executable):  # venvs share
    # one real interpreter: compare the paths, not what they link to
    return importlib.util.find_spec("tunix") is not None
  probe = subprocess.run([python, "-c", "import importlib.util as u; "
                          "raise SystemExit(u.find_spec('tunix') is None)"],
                         capture_output=True, check=False)
  return probe.returncode == 0


def run_tunix(w: Workload, model_cfg: ModelConfig, model_dir: str, prompt_len: int,
              total_steps: int, before_step):
  """Trains Tunix's GRPOLearner (vanilla rollout, colocated on one device) for total_steps.

  The model is Tunix's own Llama 3 (tunix.models.llama3) loaded from the same safetensors
  directory; the tokenizer is the same tokenizer.json through transformers. One global step =
  one batch of `w.prompts` prompts x G, one mini-batch, one optimizer step; before_step() is
  called ahead of each (untimed). Returns rows (step s, generation s, generated tokens, mean
  reward, load) per step, as run_trl does; generation = `_generate_and_compute_advantage`
  (rollout + reward + advantages), the rest is the update (+ weight sync if Tunix does one).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tunix.models.llama3 import model as llama_lib  # pylint: disable=g-import-not-at-top
  from tunix.models.llama3 import params as llama_params  # pylint: disable=g-import-not-at-top
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top

  m = model_cfg
  if m.rope_scaling != "none" or m.qkv_bias or m.qk_norm:
    raise ValueError(f"run_tunix: {m} is not a plain Llama (Tunix's llama3 has no rope "
                     "scaling, qkv bias or qk norm).")
  cfg = llama_lib.ModelConfig(
      num_layers=m.num_layers, vocab_size=m.vocab_size, embed_dim=m.d_model,
      hidden_dim=m.mlp_dim, num_heads=m.num_heads, head_dim=m.head_dim,
      num_kv_heads=m.num_kv_heads, rope_theta=int(m.rope_theta), norm_eps=m.norm_eps,
      weight_tying=m.tie_embeddings)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],  # Tunix shards
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)  # by name, not Explicit
  with mesh:
    model = llama_params.create_model_from_safe_tensors(model_dir, cfg, mesh,
                                                        dtype=jnp.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
  with open(os.path.join(model_dir, "generation_config.json")) as f:
    eos = json.load(f)["eos_token_id"]

  @dataclasses.dataclass(kw_only=True)
  class GRPOConfig(grpo_learner.GRPOConfig):
    epsilon_high: float = w.eps_high  # read by tunix.rl.algo_core when present

  rows, gen_rows, rewards = [], [], []

  def reward_fn(prompts, completions, **kwargs):
    out = even_reward(prompts, completions, **kwargs)
    rewards.append(float(np.mean(out)))
    return out

  class TimedGRPOLearner(grpo_learner.GRPOLearner):

    def _generate_and_compute_advantage(self, *args, **kwargs):
      t0 = time.perf_counter()
      out = super()._generate_and_compute_advantage(*args, **kwargs)
      jax.block_until_ready(out.advantages)
      gen_rows.append((time.perf_counter() - t0, int(np.sum(out.completion_mask))))
      return out

    def _run_global_step(self, *args, **kwargs):
      before_step()
      load, t0 = os.getloadavg()[0], time.perf_counter()
      super()._run_global_step(*args, **kwargs)
      jax.block_until_ready(nnx.state(self.rl_cluster.actor_trainer.model))
      rows.append((time.perf_counter() - t0, load))
      print(f"  Tunix step {len(rows) - 1}: {rows[-1][0]:.2f} s", flush=True)

  optimizer = optax.chain(optax.clip_by_global_norm(w.grad_clip),
                          optax.adamw(w.lr, b1=w.b1, b2=w.b2, weight_decay=0.0))
  training = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=total_steps,
      mini_batch_size=w.prompts, train_micro_batch_size=w.prompts)
  rollout = base_rollout.RolloutConfig(
      max_tokens_to_generate=w.max_new_tokens, max_prompt_length=prompt_len,
      kv_cache_size=prompt_len + w.max_new_tokens, temperature=w.temperature, top_p=1.0,
      top_k=None, eos_tokens=[eos], data_type=jnp.float32)
  roles = rl_cluster_lib.Role
  cluster = rl_cluster_lib.RLCluster(
      actor=model, reference=None, tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
          rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
          rollout_config=rollout))
  algo = GRPOConfig(num_generations=w.group_size, num_iterations=1, beta=0.0,
                    epsilon=w.eps_low, loss_agg_mode="token-mean")
  learner = TimedGRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward_fn)
  batch = {"prompts": np.array(PROMPTS), "answer": np.array(ANSWERS)}  # as a grain batch
  learner.train([dict(batch) for _ in range(total_steps)])
  if len(rows) != total_steps or len(gen_rows) != total_steps:
    raise RuntimeError(f"Tunix ran {len(rows)} steps ({len(gen_rows)} generations); "
                       f"expected {total_steps}.")
  rewards += [float("nan")] * (total_steps - len(rewards))
  return [(t, g, n, r, load) for (t, load), (g, n), r in zip(rows, gen_rows, rewards)]


# ============================================================================= taking turns

_MSG = "@@bench_peers "  # protocol lines on a worker's stdout; everything else is its log


def _send(kind: str, payload=None) -> None:
  print(_MSG + json.dumps([kind, payload]), flush=True)


def _wait_go() -> None:
  _send("ready")
  line = sys.stdin.readline()
  if line.strip() != "go":
    raise SystemExit(f"bench_peers worker: expected 'go' from the parent, got {line!r}.")


def worker(args) -> None:
  """One trainer in this process: before each step it reports ready and waits for go; at the
  end it sends its rows (the same tuples the one-process mode collects)."""
  w = Workload()
  total = args.steps + args.warmup
  model_dir, data_dir = (os.path.join(args.workdir, d) for d in ("model", "data"))
  if args._worker == "rlx":  # pylint: disable=protected-access
    config = rlx_config(w, model_dir, data_dir, args._prompt_len, total, args.sampler,  # pylint: disable=protected-access
                        tuple(args.rlx))
    step = RlxStepper(config, os.path.join(args.workdir, "rlx"))
    for _ in range(total):
      _wait_go()
      step()
    rows = step.rows
  elif args._worker == "tunix":  # pylint: disable=protected-access
    rows = run_tunix(w, MODELS[args.size], model_dir, args._prompt_len, total, _wait_go)  # pylint: disable=protected-access
  else:
    rows = run_trl(w, model_dir, os.path.join(args.workdir, "trl"), total, _wait_go,
                   args.trl_device)
  _send("rows", [list(r) for r in rows])


class _Worker:
  """A worker process and its protocol: `go()` starts one step and returns when it is done."""

  def __init__(self, name: str, args, root: str, prompt_len: int):
    python = (getattr(args, "tunix_python", "") if name == "tunix" else "") or sys.executable
    cmd = [python, os.path.abspath(__file__), f"--_worker={name}",
           f"--size={args.size}", f"--steps={args.steps}", f"--warmup={args.warmup}",
           f"--sampler={args.sampler}", f"--workdir={root}", f"--_prompt_len={prompt_len}"]
    cmd += [f"--rlx={kv}" for kv in getattr(args, "rlx", ())]
    cmd += [f"--trl_device={getattr(args, 'trl_device', 'auto')}"]
    # The worker imports rlx from where this process did (the folder above the rlx package),
    # not from above experiments/, which is rlx/ itself where experiments/ is rlx.experiments
    # (rlx/data, rlx/kernels, ... would then shadow top-level packages of those names).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(rlx.__file__))),
         os.environ.get("PYTHONPATH", "")]))
    self.name, self.rows = name, None
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, bufsize=1, env=env)
    self._next()  # ready for its first step (set-up done)

  def _next(self) -> str:
    for line in self.proc.stdout:
      if not line.startswith(_MSG):
        print(line, end="", flush=True)  # the worker's own log
        continue
      kind, payload = json.loads(line[len(_MSG):])
      if kind == "rows":
        self.rows = [tuple(r) for r in payload]
      return kind
    code = self.proc.wait()
    raise RuntimeError(f"bench_peers: the {self.name} worker exited (code {code}) mid-run.")

  def go(self) -> None:
    self.proc.stdin.write("go\n")
    self.proc.stdin.flush()
    self._next()  # "ready" for the next step, or its rows after the last

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()


def take_turns(names, args, root: str, prompt_len: int, total: int) -> dict:
  """Runs each trainer in its own process, one step at a time in turn; {name: rows}."""
  workers = []
  try:
    if args.schedule == "turns":
      for name in names:  # set up one after the other (compile and model loading not timed)
        workers.append(_Worker(name, args, root, prompt_len))
      for _ in range(total):
        for wk in workers:
          wk.go()
    else:  # "blocks": every step of one trainer, then the next; only one process alive, so
      for name in names:  # the others' memory (Tunix holds ~12 GB at 100M) is not in the way
        workers.append(_Worker(name, args, root, prompt_len))
        for _ in range(total):
          workers[-1].go()
        workers[-1].proc.wait()
    missing = [wk.name for wk in workers if wk.rows is None or len(wk.rows) != total]
    if missing:
      raise RuntimeError(f"bench_peers: no rows (or not {total}) from {missing}.")
    return {wk.name: wk.rows for wk in workers}
  finally:
    for wk in workers:
      wk.close()


# ============================================================================= report


PEER_NAMES = {"trl": "TRL", "tunix": "Tunix"}


def report(size: str, params: int, rlx_rows, peer_rows: dict, warmup: int, load_span,
           mode: str = "one process each, taking turns") -> str:
  """The markdown table: one row per peer (rlx's cells repeat), or rlx alone."""
  r = rlx_rows[warmup:]
  gen, upd = [x[0] for x in r], [x[1] for x in r]
  rlx_step = median([a + b for a, b in zip(gen, upd)])
  head = ("| model | params | rlx step s (gen + update) | rlx gen tok/step | rlx gen tok/s "
          "| peer | peer step s (gen + rest) | peer gen tok/step | peer gen tok/s "
          "| peer / rlx step | steps (each) | load rlx / peer |")
  sep = "|" + "---|" * 12
  rlx_cells = (f"| {size} | {params / 1e6:.2f}M | {rlx_step:.2f} ({median(gen):.2f} + "
               f"{median(upd):.2f}) | {median([x[2] for x in r]):.0f} | "
               f"{median([x[2] / x[0] for x in r]):.0f} |")
  rlx_load = f"{median([x[4] for x in r]):.1f}"
  rows = []
  for name, rows_ in (peer_rows or {}).items():
    t = rows_[warmup:]
    step = median([x[0] for x in t])
    rows.append(
        f"{rlx_cells} {PEER_NAMES.get(name, name)} | {step:.2f} ({median([x[1] for x in t]):.2f}"
        f" + {median([x[0] - x[1] for x in t]):.2f}) | {median([x[2] for x in t]):.0f} | "
        f"{median([x[2] / x[1] for x in t]):.0f} | **{step / rlx_step:.2f}x** | {len(r)} | "
        f"{rlx_load} / {median([x[4] for x in t]):.1f} |")
  if not rows:
    rows.append(f"{rlx_cells} - | - | - | - | - | {len(r)} | {rlx_load} / - |")
  note = (f"\nMedians of {len(r)} steady steps each ({warmup} warm-up step(s) dropped; "
          f"trainers: {mode}); "
          f"1-min load average {load_span[0]:.1f} before, {load_span[1]:.1f} after. "
          f"Ratio > 1: rlx's step is faster. Each part is its own median, so the parts need not "
          f"add up to the step.")
  return "\n".join([head, sep] + rows) + "\n" + note + "\n"


def _per_step(rlx_rows, peer_rows: dict) -> str:
  names = list(peer_rows or {})
  head = "step  rlx gen s  rlx upd s  rlx tok  rlx reward"
  for name in names:
    n = PEER_NAMES.get(name, name)
    head += f"  |  {n} step s  {n} gen s  {n} tok  {n} reward"
  lines = [head]
  for i, (g, u, n, rew, _) in enumerate(rlx_rows):
    line = f"{i:4d}  {g:9.2f}  {u:9.2f}  {n:7.0f}  {rew:10.3f}"
    for name in names:
      if i < len(peer_rows[name]):
        s_, tg, tn, trew, _ = peer_rows[name][i]
        line += f"  |  {s_:10.2f}  {tg:9.2f}  {tn:7.0f}  {trew:10.3f}"
    lines.append(line)
  return "\n".join(lines)


def define_flags() -> tuple:
  """The command line's flags, defined when this file runs as a script (not at import: a
  bench_peers_config.py run imports this module into rlx.main, whose --workdir is its own)."""
  return (
      flags.DEFINE_enum("size", "3m", sorted(MODELS), "Model shape."),
      flags.DEFINE_integer("steps", 6, "Timed steady steps of each trainer."),
      flags.DEFINE_integer("warmup", 1, "Steps dropped first (compile, init)."),
      flags.DEFINE_string("peers", ",".join(
          n for n, ok in (("trl", trl_available()), ("tunix", tunix_available())) if ok),
                          "Comma-separated peers among trl, tunix, or '' (default: each one "
                          "that is importable)."),
      flags.DEFINE_bool("rlx_only", False, "Time rlx alone."),
      flags.DEFINE_enum("sampler", "paged", ["paged", "dense"], "rlx sampler."),
      flags.DEFINE_bool("eos_in_vocab", False, "EOS the model can sample (completions may "
                        "stop early, unequal work)."),
      flags.DEFINE_string("workdir", "", "Scratch directory (default: a temp dir)."),
      flags.DEFINE_string("out", "", "Also write the table (markdown) here."),
      flags.DEFINE_multi_string("rlx", [], "An rlx config override KEY=VALUE for its side "
                                "(repeatable), e.g. --rlx=update_shape.micro_rows=8."),
      flags.DEFINE_string("tunix_python", "", "Interpreter for the Tunix worker (default: this "
                          "one). Tunix 0.1.7 pins safetensors<0.8, which holds transformers at "
                          "5.12, older than TRL 1.16 runs on: give Tunix a venv of its own "
                          "with rlx installed (pip install -e '.[tunix]') and point this at "
                          "its bin/python."),
      flags.DEFINE_enum("trl_device", "auto", ["auto", "cpu", "cuda"], "Where TRL's "
                        "GRPOTrainer runs: auto = the GPU when torch sees one, else the CPU; "
                        "cpu; cuda (an error without one)."),
      flags.DEFINE_bool("same_process", False, "Both trainers in this process (the first "
                        "method; see the docstring)."),
      flags.DEFINE_enum("schedule", "turns", ["turns", "blocks"], "Worker processes: one "
                        "step each in turn, or all of one trainer's steps then the other's "
                        "(see the docstring)."),
      flags.DEFINE_enum("_worker", "", ["", "rlx", "trl", "tunix"], "Internal: run as this "
                        "worker process."),
      flags.DEFINE_integer("_prompt_len", 0, "Internal: the workers' prompt length."),
  )


def main(argv, flag_holders) -> None:
  del argv
  args = types.SimpleNamespace(**{f.name: f.value for f in flag_holders})
  if args._worker:  # pylint: disable=protected-access
    worker(args)
    return
  peers = [] if args.rlx_only else [n for n in args.peers.split(",") if n]
  for name in peers:
    if name not in PEER_NAMES:
      raise SystemExit(f"--peers={args.peers!r}: {name!r} is not a peer; expected a "
                       f"comma-separated list of {sorted(PEER_NAMES)}, or ''.")
    if not (trl_available() if name == "trl" else tunix_available(args.tunix_python)):
      where = f" in {args.tunix_python}" if name == "tunix" and args.tunix_python else ""
      raise SystemExit(f"--peers={name} needs {PEER_NAMES[name]}{where}: pip install -e "
                       f"'.[{'peers' if name == 'trl' else 'tunix'}]'.")
  if args.same_process and "tunix" in peers:
    raise SystemExit("--same_process runs TRL only (Tunix is JAX too: it gets its own process); "
                     "drop --same_process or --peers=tunix.")
  if args.steps < 1 or args.warmup < 0:
    raise SystemExit(f"--steps={args.steps} --warmup={args.warmup}; expected >= 1 and >= 0.")

  w = Workload()
  model_cfg = MODELS[args.size]
  total = args.steps + args.warmup
  with contextlib.ExitStack() as stack:
    root = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="rlx_peers_"))
    model_dir, data_dir = os.path.join(root, "model"), os.path.join(root, "data")
    make_model_dir(model_dir, model_cfg, seed=w.seed, eos_in_vocab=args.eos_in_vocab)
    write_prompts(data_dir)
    if peers:
      ids = check_tokenizers(model_dir)
    else:
      tok = rlx.load_tokenizer(model_dir)
      ids = [tok.encode(q, add_special_tokens=True) for q in PROMPTS]
    prompt_len = max(map(len, ids))
    print(f"model: Llama {args.size}, {model_cfg.num_params() / 1e6:.2f}M params (vocab "
          f"{model_cfg.vocab_size}, {model_cfg.num_layers} layers, d_model {model_cfg.d_model}); "
          f"workload: {w.prompts} prompts x G={w.group_size}, prompt {prompt_len} tokens, "
          f"{w.max_new_tokens} new tokens, EOS {'in' if args.eos_in_vocab else 'outside'} the "
          f"model's vocabulary; rlx sampler {args.sampler}"
          f"{''.join(' --rlx=' + kv for kv in args.rlx)}; peers: {','.join(peers) or 'none'}",
          flush=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    peer_rows = {}
    if args.same_process:
      config = rlx_config(w, model_dir, data_dir, prompt_len, total, args.sampler,
                          tuple(args.rlx))
      rlx_step = RlxStepper(config, os.path.join(root, "rlx"))
      if "trl" in peers:
        peer_rows["trl"] = run_trl(w, model_dir, os.path.join(root, "trl"), total, rlx_step,
                                   args.trl_device)
      else:
        for _ in range(total):
          rlx_step()
      rlx_rows = rlx_step.rows
    else:
      rows = take_turns(["rlx"] + peers, args, root, prompt_len, total)
      rlx_rows = rows.pop("rlx")
      peer_rows = rows
    load_after = os.getloadavg()[0]
    print(f"\n{_per_step(rlx_rows, peer_rows)}\n(wall {time.perf_counter() - t0:.0f} s)\n")
  table = report(args.size, model_cfg.num_params(), rlx_rows, peer_rows, args.warmup,
                 (load_before, load_after),
                 "one process" if args.same_process else
                 f"one process each, {'taking turns' if args.schedule == 'turns' else 'one after the other'}")
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table)


if __name__ == "__main__":
  _flag_holders = define_flags()
  app.run(lambda argv: main(argv, _flag_holders))
