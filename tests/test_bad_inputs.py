"""Bad input costs seconds, not a lost day: each case stops with one clear message (asserted)
and leaves the existing checkpoints of the workdir byte-for-byte intact."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from rlx import checkpoint, configs, rewards, trainer
from rlx import metrics as rlx_metrics
from test_main import ARITH, REPO, runlocal_config

ONE = dict(devices=jax.devices()[:1])


def _boom(prompts, completions, **unused):
  raise ZeroDivisionError("reward exploded")


rewards.register_reward("boom_for_tests", _boom)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  wd = tmp_path_factory.mktemp("existing")
  trainer.run(runlocal_config(**{"total_steps": 2, "checkpoint_every": 1, "mesh.data": 1}),
              str(wd), log=lambda s: None, show_progress=False, **ONE)
  return wd


def _digest(path):
  h = hashlib.sha256()
  for root, _, files in sorted(os.walk(path)):
    for f in sorted(files):
      h.update(f.encode())
      with open(os.path.join(root, f), "rb") as fh:
        h.update(fh.read())
  return h.hexdigest()


def _files(path):
  return sorted(os.path.relpath(os.path.join(root, f), path)
                for root, _, files in os.walk(path) for f in files)


def _garbage(path):
  with open(path, "wb") as f:
    f.write(b"\x00not what you think\xff" * 7)


def corrupt_tokenizer(wd):
  _garbage(wd / "base" / "tokenizer.model")


def delete_tokenizer(wd):
  os.remove(wd / "base" / "tokenizer.model")


def corrupt_checkpoint(wd):
  for root, _, files in os.walk(wd / "checkpoints" / "2" / "state"):
    for f in files:
      _garbage(os.path.join(root, f))


def corrupt_eval_base(wd):
  (wd / "eval_base.json").write_text('{"eval/accuracy": 0.5,')


def corrupt_base_meta(wd):
  (wd / "base" / "rlx_base.json").write_bytes(b"\xff\xfe not json")


def rename_checkpoint(wd):
  os.rename(wd / "checkpoints" / "2", wd / "checkpoints" / "99999999999999999999")


def foreign_checkpoint(wd):
  # What another tool might leave: an orbax checkpoint of some other pytree, newer step.
  import orbax.checkpoint as ocp
  mgr = ocp.CheckpointManager(str(wd / "checkpoints"), item_names=("state", "meta"))
  mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(3)}),
                                      meta=ocp.args.JsonSave({"tool": "something else"})))
  mgr.wait_until_finished()


CASES = [
    # (id, config overrides, workdir preparation, error type, message regex)
    ("group_size_1", {"rl.group_size": 1}, None, configs.ConfigError,
     r"config.rl.group_size=1: advantage 'grpo' normalises rewards within a group"),
    ("minibatches_do_not_divide", {"rl.num_minibatches": 5}, None, configs.ConfigError,
     r"training batch of 16 rows .* does not split into config.rl.num_minibatches=5"),
    ("micro_rows_with_minibatches", {"update_shape.micro_rows": 4, "rl.num_minibatches": 2}, None,
     configs.ConfigError,
     r"config.update_shape.micro_rows=4 \(gradient accumulation .*\) needs "
     r"config.rl.num_minibatches=1, got 2"),
    ("micro_rows_negative", {"update_shape.micro_rows": -1}, None, configs.ConfigError,
     r"config.update_shape.micro_rows=-1; expected an integer in \[0, "),
    ("unknown_sampler", {"sampler.impl": "vllm"}, None, configs.ConfigError,
     r"config.sampler.impl='vllm'; expected one of \('dense', 'paged'\)"),
    ("unknown_aggregation", {"rl.aggregation": "sum"}, None, configs.ConfigError,
     r"config.rl: loss aggregation 'sum'; expected one of"),
    ("top_p_out_of_range", {"sampler.top_p": 1.5}, None, configs.ConfigError,
     r"config.sampler: top_p=1.5; expected 0 < top_p <= 1"),
    ("unknown_selection_mode", {"selection.mode": "greedy"}, None, configs.ConfigError,
     r"config.selection: selection mode 'greedy'"),
    ("replay_bigger_than_ring", {"replay.enabled": True, "replay.capacity": 8,
                                 "replay.num_samples": 16}, None, configs.ConfigError,
     r"config.replay: replay num_samples=16 exceeds capacity=8"),
    ("page_pool_too_small", {"sampler.num_pages": 2}, None, configs.ConfigError,
     r"config.sampler.num_pages=2 is too small: .* needs num_pages >= \d+ per data shard"),
    ("does_not_fit_in_memory", {"memory.device_bytes": 1024}, None, configs.ConfigError,
     r"the run needs .* per device at its peak .* but a device has 1.00 KiB"),
    ("corrupt_tokenizer", {}, corrupt_tokenizer, ValueError,
     r"Tokenizer file '.*base/tokenizer.model' is not a valid sentencepiece model"),
    ("missing_tokenizer", {}, delete_tokenizer, FileNotFoundError,
     r"Tokenizer file '.*base/tokenizer.model' does not exist"),
    ("corrupt_checkpoint", {}, corrupt_checkpoint, checkpoint.CheckpointError,
     r"Could not restore the checkpoint at .*checkpoints/2 .* corrupt or from an incompatible"),
    ("foreign_checkpoint", {}, foreign_checkpoint, checkpoint.CheckpointError,
     r"Could not restore the checkpoint at .*checkpoints/3"),
    ("empty_dataset", {"task.num_train_per_level": 0}, None, configs.ConfigError,
     r"config.task.num_train_per_level=0 gives an empty dataset; expected >= 1"),
    ("prompt_longer_than_maximum", {"sampler.max_prompt_len": 4}, None, ValueError,
     r"example \d+ prompt '\d+\+\d+=' has \d+ tokens, longer than the maximum prompt length 4"),
    ("reward_function_raises", {"task.reward": "boom_for_tests"}, None, ValueError,
     r"reward function 'boom_for_tests' \(_boom\) raised ZeroDivisionError: reward exploded on "
     r"arithmetic example 0 \(prompt '\d+\+\d+=', completion"),
    ("unknown_reward", {"task.reward": "nope"}, None, configs.ConfigError,
     r"config.task.reward='nope'"),
    ("missing_warm_start_dir", {"warm_start.dir": "/nonexistent/base"}, None,
     FileNotFoundError, r"config.warm_start.dir='/nonexistent/base' is not a directory"),
    ("missing_model_path", {"model.path": "/nonexistent/Qwen"}, None, FileNotFoundError,
     r"config.model.path='/nonexistent/Qwen' is not a directory"),
    ("gsm8k_without_files", {"task.name": "gsm8k", "model.path": REPO}, None,
     configs.ConfigError, r"config.task.name='gsm8k' reads local JSONL files: set "
     r"config.task.manual_dir"),
    ("reward_out_of_range", {"guard.reward_range": (2.0, 3.0)}, None, trainer.NumericError,
     r"task 'arithmetic': reward 0.0 for train example \d+ .* outside \[2.0, 3.0\]"),
    # Nonsense values, refused before anything runs.
    ("keep_checkpoints_negative", {"keep_checkpoints": -1}, None, configs.ConfigError,
     r"config.keep_checkpoints=-1; expected an integer >= 0"),
    ("negative_lr", {"optim.lr": -1e-3}, None, configs.ConfigError,
     r"config.optim.lr=-0.001; expected 0 < lr"),
    ("infinite_lr", {"optim.lr": float("inf")}, None, configs.ConfigError,
     r"config.optim.lr=inf; expected 0 < lr"),
    ("negative_warmup", {"optim.warmup_steps": -5}, None, configs.ConfigError,
     r"config.optim.warmup_steps=-5; expected an integer >= 0"),
    ("b2_above_one", {"optim.b2": 1.5}, None, configs.ConfigError,
     r"config.optim.b2=1.5; expected 0 <= b2 < 1"),
    ("negative_grad_clip", {"optim.grad_clip": -1.0}, None, configs.ConfigError,
     r"config.optim.grad_clip=-1.0; expected grad_clip >= 0 \(0: no clipping\)"),
    ("teacher_error_rate_above_one", {"task.teacher_error_rate": 1.5}, None,
     configs.ConfigError, r"config.task.teacher_error_rate=1.5; expected 0 <= "
     r"teacher_error_rate <= 1"),
    ("sft_batch_size_zero", {"sft.batch_size": 0}, None, configs.ConfigError,
     r"config.sft.batch_size=0; expected an integer >= 1"),
    ("reversed_reward_range", {"guard.reward_range": (1.0, 0.0)}, None, configs.ConfigError,
     r"config.guard.reward_range=\(1.0, 0.0\) is empty; expected \(low, high\) with low <= "
     r"high"),
    ("zero_max_consecutive_skips", {"guard.max_consecutive_skips": 0}, None,
     configs.ConfigError, r"config.guard.max_consecutive_skips=0; expected an integer >= 1"),
    ("huge_max_new_tokens", {"sampler.max_new_tokens": 10 ** 9}, None, configs.ConfigError,
     r"config.sampler.max_new_tokens=1000000000; expected an integer in \[1, 1048576\]"),
    # jax.random.key keeps 32 bits: 2**32 ran as seed 0, 20 digits were an OverflowError.
    ("seed_beyond_32_bits", {"seed": 99999999999999999999}, None, configs.ConfigError,
     r"config.seed=99999999999999999999; expected an integer in \[0, 4294967295\]"),
    ("seed_2_to_the_32", {"seed": 2 ** 32}, None, configs.ConfigError,
     r"config.seed=4294967296; expected an integer in \[0, 4294967295\]"),
    # A resume whose settings change the saved state's layout: say what differs (README
    # quickstart: the second command once reused the first one's workdir).
    ("changed_grad_clip_on_resume", {"optim.grad_clip": 0.0}, None, checkpoint.CheckpointError,
     r"made with other settings \(optim.grad_clip: checkpoint 1.0, now 0.0\).* pass a new "
     r"--workdir to start a new run"),
    ("replay_enabled_on_resume", {"replay.enabled": True, "replay.capacity": 32,
                                  "replay.num_samples": 8}, None, checkpoint.CheckpointError,
     r"made with other settings \(.*replay.enabled: checkpoint False, now True.*\).* pass a "
     r"new --workdir to start a new run"),
    ("length_guard_on_resume", {"length.length_reward": 0.5, "length.guard_margin": 0.1},
     None, checkpoint.CheckpointError,
     r"made with other settings \(.*length.guard_margin: checkpoint 0.0, now 0.1.*\).* pass a "
     r"new --workdir to start a new run"),
    ("length_guard_margin_above_one", {"length.guard_margin": 2.0}, None, configs.ConfigError,
     r"config.length: length guard_margin=2.0; expected an accuracy difference in \[0, 1\]"),
    # A LoRA rank above a matrix's smaller side adds only memory (100000: 7.4 GB, minutes
    # compiling): refused by the memory plan, before the state is built.
    ("lora_rank_above_the_matrix_sides", {"lora.rank": 100000}, None, configs.ConfigError,
     r"config.lora.rank=100000 exceeds the smaller side of the adapted matrix "
     r"'layer_0/attn/k_proj' \(shape \(32, 16\)\); the update A @ B of an \[in, out\] matrix "
     r"has rank <= min\(in, out\), so expected rank <= 16\.$"),
    # A resume keeps the tokenizer it trained: the changed value was written into config.json.
    ("changed_vocab_size_on_resume", {"tokenizer.vocab_size": 5}, None,
     checkpoint.CheckpointError,
     r"config.tokenizer.vocab_size=5, but the checkpoint at .*checkpoints/2 was made with 64, "
     r"and a resume keeps the tokenizer the run trained .* Rerun with "
     r"--config.tokenizer.vocab_size=64 to resume, or pass a new --workdir"),
    # A step directory renamed by hand was resumed as the step its name says.
    ("renamed_checkpoint_directory", {}, rename_checkpoint, checkpoint.CheckpointError,
     r"the checkpoint directory .*checkpoints/99999999999999999999 holds the state after step "
     r"2; expected a directory named after the step it holds, .* Rename it back to 2"),
    ("corrupt_eval_base_json", {}, corrupt_eval_base, checkpoint.CheckpointError,
     r".*eval_base.json is not valid JSON \(line 1 column \d+"),
    ("corrupt_base_meta_json", {}, corrupt_base_meta, checkpoint.CheckpointError,
     r".*base/rlx_base.json is not UTF-8 text"),
]


# Cases whose config was accepted (the run resumed) and that failed later, in a step.
RESUMED = {"reward_function_raises", "reward_out_of_range"}


@pytest.mark.parametrize("name, overrides, prepare, error, message", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_has_one_clear_message(run_dir, tmp_path, name, overrides, prepare, error,
                                         message):
  wd = tmp_path / "wd"
  shutil.copytree(run_dir, wd)
  if prepare:
    prepare(wd)
  before = _digest(wd / "checkpoints")
  record = (wd / "config.json").read_bytes()
  files = _files(wd)
  cfg = runlocal_config(**{"total_steps": 4, "mesh.data": 1, **overrides})
  with pytest.raises(error, match=message) as info:
    trainer.run(cfg, str(wd), log=lambda s: None, show_progress=False, **ONE)
  assert "\n" not in str(info.value).strip()  # one message, one line
  assert _digest(wd / "checkpoints") == before, f"{name} changed the checkpoints"
  if name not in RESUMED:  # a rejected config leaves the run's record alone
    assert (wd / "config.json").read_bytes() == record, f"{name} rewrote the run's config.json"
  # No file appears or goes: e.g. no new TensorBoard events file for a run that wrote nothing.
  assert _files(wd) == files, f"{name} changed the workdir's files"


def test_a_resume_past_total_steps_says_what_the_checkpoint_holds(run_dir, tmp_path):
  # The closing line said "after 1 RL steps" while the state resumed held step 2.
  wd = tmp_path / "wd"
  shutil.copytree(run_dir, wd)
  before = _digest(wd / "checkpoints")
  logs = []
  trainer.run(runlocal_config(**{"total_steps": 1, "mesh.data": 1}), str(wd), log=logs.append,
              show_progress=False, **ONE)
  assert (f"[rlx] the checkpoint already holds step 2 >= config.total_steps=1: nothing is "
          f"trained; its policy is evaluated") in logs, logs
  band = [l for l in logs if l.startswith("[rlx] held-out greedy accuracy on the band")]
  assert len(band) == 1 and band[0].endswith(" after 2 RL steps"), band
  assert _digest(wd / "checkpoints") == before


def test_the_advice_for_a_damaged_base_record_works(run_dir, tmp_path):
  # "Delete it to have it rewritten" for base/rlx_base.json led to a second refusal ("holds
  # a run made with another task or model (... has no rlx_base.json)").
  wd = tmp_path / "wd"
  shutil.copytree(run_dir, wd)
  corrupt_base_meta(wd)
  cfg = runlocal_config(**{"total_steps": 3, "checkpoint_every": 1, "eval_every": 100,
                           "mesh.data": 1})
  run = lambda log=lambda s: None: trainer.run(cfg, str(wd), log=log, show_progress=False, **ONE)
  advice = (f"Delete the directory {wd / 'base'} to have the warm start trained again (the "
            f"checkpoints are kept and resumed), or use a new --workdir.")
  with pytest.raises(checkpoint.CheckpointError) as info:
    run()
  assert str(info.value).endswith(advice) and "\n" not in str(info.value), info.value
  os.remove(wd / "base" / "rlx_base.json")  # not the advice: the base can no longer be checked
  with pytest.raises(checkpoint.CheckpointError) as info:
    run()
  assert str(info.value) == (f"{wd / 'base'} has no rlx_base.json (the record of the task and "
                             f"model its warm start was made for), so it cannot be checked "
                             f"against this run. {advice}")
  shutil.rmtree(wd / "base")  # the advice
  logs = []
  run(logs.append)
  assert any(l.endswith(f"resumed from {wd / 'checkpoints'}/2") for l in logs), logs
  assert checkpoint.Checkpointer(str(wd)).latest_step() == 3
  for f in ("model.safetensors", "tokenizer.model"):  # the same seed, the same base
    assert (wd / "base" / f).read_bytes() == (run_dir / "base" / f).read_bytes(), f


def test_a_vocabulary_too_small_for_the_task_on_a_fresh_workdir(tmp_path):
  # sentencepiece's trainer raised a RuntimeError ("INTERNAL: src/trainer_interface.cc(638)
  # ... 5 vs 16 ...") through rlx.main as a traceback.
  with pytest.raises(configs.ConfigError) as info:
    trainer.run(runlocal_config(**{"tokenizer.vocab_size": 5, "mesh.data": 1}), str(tmp_path),
                log=lambda s: None, show_progress=False, **ONE)
  msg = str(info.value)
  assert "\n" not in msg
  assert re.fullmatch(r"config.tokenizer.vocab_size=5 is too small for task 'arithmetic': its "
                      r"characters and special tokens alone need (\d+) tokens; set "
                      r"config.tokenizer.vocab_size >= \1.", msg), msg
  # Only the lock and the data cache (kept, as after a stop in set-up) were written.
  assert set(os.listdir(tmp_path)) <= {".rlx.lock", "data", "checkpoints"}
  assert not os.listdir(tmp_path / "checkpoints")


def test_a_lora_rank_above_the_matrix_sides_is_refused_before_the_warm_start(tmp_path):
  with pytest.raises(configs.ConfigError, match=r"config.lora.rank=17 exceeds the smaller side "
                     r"of the adapted matrix .*expected rank <= 16\.$"):
    trainer.run(runlocal_config(**{"lora.rank": 17, "mesh.data": 1}), str(tmp_path),
                log=lambda s: None, show_progress=False, **ONE)
  assert not os.path.exists(tmp_path / "base")  # no warm start trained first


def test_batch_not_divisible_by_the_data_axis(tmp_path):
  # All 8 test devices on the data axis: 3 prompts x 4 samples cannot be split 8 ways.
  with pytest.raises(configs.ConfigError, match=r"12 rollouts cannot be split over the 8 "
                     r"data-parallel devices"):
    trainer.run(runlocal_config(**{"rl.prompts_per_step": 3}), str(tmp_path),
                log=lambda s: None, show_progress=False)
  assert not os.listdir(tmp_path)  # failed before writing anything


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(configs.ConfigError, match=r"--workdir='.*a_file/run' is not writable"):
    trainer.run(runlocal_config(**{"mesh.data": 1}), str(blocker / "run"), log=lambda s: None,
                show_progress=False, **ONE)


@pytest.mark.parametrize("flag, message", [
    ("--config.rl.grup_size=3",
     "rlx: error: unknown config key --config.rl.grup_size; did you mean "
     "--config.rl.group_size?"),
    ("--config.rl.group_size=abc",
     "rlx: error: flag --config.rl.group_size=abc: invalid literal for int()"),
    ("--cpu_devices=-3", "rlx: error: flag --cpu_devices=-3: -3 is not a non-negative integer"),
    ("--config.seed=99999999999999999999",
     "rlx: error: config.seed=99999999999999999999; expected an integer in [0, 4294967295]"),
])
def test_cli_flag_errors_are_one_line(flag, message, tmp_path):
  out = subprocess.run([sys.executable, "-m", "rlx.main", f"--config={ARITH}:runlocal",
                        f"--workdir={tmp_path}", flag], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
  assert out.returncode == 2
  assert message in out.stderr
  assert "Traceback" not in out.stderr
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("case", ["lone_surrogate", "train_jsonl_is_a_directory"])
def test_bad_jsonl_files_through_the_cli_are_one_line(case, tmp_path):
  # A lone surrogate escape was a TFDS UnicodeEncodeError traceback; a train.jsonl directory a
  # message naming neither the file nor the cause.
  files = tmp_path / "gsm8k"
  files.mkdir()
  if case == "lone_surrogate":
    (files / "train.jsonl").write_text('{"question": "x\\ud800y", "answer": "#### 1"}\n')
    message = (f"rlx: error: {files}/train.jsonl:1: field 'question' holds the escape \\ud800, "
               f"half of a UTF-16 surrogate pair without its other half (not a character); "
               f"expected valid Unicode text.")
  else:
    (files / "train.jsonl").mkdir()
    message = (f"rlx: error: {files}/train.jsonl is a directory; expected train.jsonl to be a "
               f"JSONL file (one JSON object per line).")
  wd = tmp_path / "wd"
  out = subprocess.run([sys.executable, "-m", "rlx.main", f"--config={ARITH}:runlocal",
                        f"--workdir={wd}", "--config.task.name=gsm8k",
                        f"--config.model.path={REPO}", f"--config.task.manual_dir={files}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
  assert out.returncode == 2, out.stderr[-3000:]
  errors = [l for l in out.stderr.splitlines() if "error" in l.lower()]
  assert len(errors) == 1 and errors[0].startswith(message), out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  assert _files(wd) == [".rlx.lock"]  # no data prepared (and the empty checkpoints/ only)


# Runs `python -m rlx.main ARGS` with the disk "full" for metrics.jsonl after FULL_AFTER lines
# were appended to it: the file's writes then fail with ENOSPC, as they do on a full disk.
_FULL_DISK_DRIVER = """
    import builtins, errno, os, runpy, sys
    real_open, budget = builtins.open, [int(os.environ["FULL_AFTER"])]

    class FullDisk:
      def __init__(self, f):
        self._f = f
      def write(self, text):
        budget[0] -= 1
        if budget[0] < 0:
          raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(text)
      def __getattr__(self, name):
        return getattr(self._f, name)

    def open_(file, mode="r", *args, **kwargs):
      f = real_open(file, mode, *args, **kwargs)
      full = isinstance(file, str) and os.path.basename(file) == "metrics.jsonl" and "a" in mode
      return FullDisk(f) if full else f

    builtins.open = open_
    sys.argv = ["rlx.main", *sys.argv[1:]]
    runpy.run_module("rlx.main", run_name="__main__", alter_sys=True)
"""


def test_a_disk_that_fills_mid_run_is_one_line_and_the_rerun_resumes(run_dir, tmp_path):
  # Regression (issue 37, N4): a full disk ended the run with hundreds of lines, tracebacks
  # and a raw "OSError: [Errno 28]" from the metrics writer, naming no file.
  wd = tmp_path / "wd"
  shutil.copytree(run_dir, wd)  # checkpoints 1 and 2; this run resumes from 2
  driver = tmp_path / "full_disk.py"
  driver.write_text(textwrap.dedent(_FULL_DISK_DRIVER))
  flags = [f"--config={ARITH}:runlocal", f"--workdir={wd}", "--config.mesh.data=1",
           "--config.total_steps=5", "--config.checkpoint_every=1", "--config.eval_every=100"]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
         "FULL_AFTER": "1"}  # step 3's line is written, step 4's finds the disk full
  out = subprocess.run([sys.executable, str(driver), *flags], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
  assert out.returncode == 2, out.stderr[-3000:]
  errors = [l for l in out.stderr.splitlines() if "rlx: error:" in l or "Error" in l]
  assert errors == [
      f"rlx: error: could not write {wd / 'metrics.jsonl'} (No space left on device [Errno 28]);"
      f" the last checkpoint is kept: free space, then rerun the same command to resume from "
      f"it. (set RLX_TRACEBACK=1 for the traceback)"], out.stderr[-3000:]
  assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
  assert checkpoint.Checkpointer(str(wd)).latest_step() == 3
  # With space again, a rerun resumes from that checkpoint and finishes (in this process,
  # whose compiled steps the fixture's run already made: the same code path, seconds faster).
  logs = []
  trainer.run(runlocal_config(**{"total_steps": 5, "checkpoint_every": 1, "eval_every": 100,
                                 "mesh.data": 1}), str(wd), log=logs.append,
              show_progress=False, **ONE)
  assert any(l.endswith(f"resumed from {wd / 'checkpoints'}/3") for l in logs), logs
  assert [l["step"] for l in rlx_metrics.read_metrics(wd)] == [0, 1, 2, 3, 4, 5]


# Runs `python -m rlx.main ARGS` and makes the checkpoint directory read-only just before the
# save of step READ_ONLY_AT (as a user or a cleanup job might, mid-run).
_READ_ONLY_DRIVER = """
    import os, runpy, sys
    from rlx import checkpoint
    save, at = checkpoint.Checkpointer.save, int(os.environ["READ_ONLY_AT"])

    def save_(self, step, *args, **kwargs):
      if step == at:
        os.chmod(self.directory, 0o555)
      return save(self, step, *args, **kwargs)

    checkpoint.Checkpointer.save = save_
    sys.argv = ["rlx.main", *sys.argv[1:]]
    runpy.run_module("rlx.main", run_name="__main__", alter_sys=True)
"""


def test_a_checkpoint_directory_made_unwritable_mid_run_is_one_line(run_dir):
  # Issue 37: orbax's background save threads printed a 100-line traceback before rlx's
  # line (fixed with the full-disk case, 022d4fc: orbax's held ERROR records are dropped when
  # the run ends with that line). Root writes to a read-only directory, so as root the run is
  # made by `nobody` (setpriv), in a directory it owns.
  import tempfile  # pylint: disable=g-import-not-at-top
  as_user = []
  if os.geteuid() == 0:
    if not shutil.which("setpriv"):
      pytest.skip("root without setpriv: a read-only directory stays writable")
    as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
  home = tempfile.mkdtemp(prefix="rlx_read_only_")
  try:
    wd = os.path.join(home, "wd")
    shutil.copytree(run_dir, wd)  # checkpoints 1 and 2; this run resumes from 2
    driver = os.path.join(home, "read_only.py")
    with open(driver, "w") as f:
      f.write(textwrap.dedent(_READ_ONLY_DRIVER))
    if as_user:
      for root, dirs, files in os.walk(home):
        for name in [root] + [os.path.join(root, n) for n in dirs + files]:
          os.chown(name, 65534, 65534)
    # Without the suite's compilation cache (tests/conftest.py): its lock file and entries
    # belong to this user, and `nobody` failing to open them printed 6 warning lines (CI, 5857fea).
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
           "HOME": home, "READ_ONLY_AT": "4",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(as_user + [sys.executable, driver, f"--config={ARITH}:runlocal",
                                    f"--workdir={wd}", "--config.mesh.data=1",
                                    "--config.total_steps=6", "--config.checkpoint_every=1",
                                    "--config.eval_every=100"],
                         capture_output=True, text=True, timeout=300, cwd=home, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [l for l in out.stderr.splitlines()
             if "rlx: error:" in l or "Error" in l or "Trace" in l or "File " in l]
    assert len(lines) == 1 and "Permission denied" in lines[0], out.stderr[-3000:]
    assert lines[0].startswith(f"rlx: error: could not save the checkpoint of step 4 to "
                               f"{wd}/checkpoints (Permission denied"), lines[0]
    os.chmod(os.path.join(wd, "checkpoints"), 0o755)
    # Step 3's save, still finishing in the background, could not move its files in either.
    kept = int(re.search(r"the checkpoint of step (\d+) is kept", lines[0]).group(1))
    os.chmod(os.path.join(wd, "checkpoints"), 0o755)
    assert kept >= 2 and checkpoint.Checkpointer(wd).latest_step() == kept
    logs = []  # with the permission back, the rerun resumes from it and finishes
    trainer.run(runlocal_config(**{"total_steps": 6, "checkpoint_every": 1, "eval_every": 100,
                                   "mesh.data": 1}), wd, log=logs.append,
                show_progress=False, **ONE)
    assert any(l.endswith(f"resumed from {wd}/checkpoints/{kept}") for l in logs), logs
    assert checkpoint.Checkpointer(wd).latest_step() == 6
  finally:
    shutil.rmtree(home, ignore_errors=True)


_SMALL_DISK_SCRIPT = """
    set -eu
    mount -t tmpfs -o size=3m none "$DISK"
    cp -r "$RUN_DIR" "$DISK/wd"
    avail=$(df --output=avail -B1 "$DISK" | tail -1)
    head -c $((avail - 300 * 1024)) /dev/zero > "$DISK/filler"  # room for about one checkpoint
    set +e
    "$PYTHON" -m rlx.main "$@" --workdir="$DISK/wd" 2> "$OUT/stderr"
    echo $? > "$OUT/rc"
    cp -r "$DISK/wd" "$OUT/wd"
"""


def _can_mount_tmpfs(tmp_path) -> bool:
  probe = tmp_path / "probe"
  probe.mkdir()
  try:
    return subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "none", str(probe)],
                          capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


def test_a_really_full_disk_is_one_line_and_keeps_the_last_checkpoint(run_dir, tmp_path):
  # The same on a real (tiny tmpfs) disk, where the checkpoint save fails too: orbax's
  # background threads logged each failure with a traceback (hundreds of lines) before rlx's
  # line. Needs a mount namespace (unshare -rm); skipped where there is none.
  if not _can_mount_tmpfs(tmp_path):
    pytest.skip("no mount namespace for a tiny tmpfs (unshare -rm mount)")
  disk, out = tmp_path / "disk", tmp_path / "out"
  disk.mkdir()
  out.mkdir()
  script = tmp_path / "small_disk.sh"
  script.write_text(textwrap.dedent(_SMALL_DISK_SCRIPT))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
         "DISK": str(disk), "OUT": str(out), "RUN_DIR": str(run_dir), "PYTHON": sys.executable}
  subprocess.run(["unshare", "-rm", "bash", str(script), f"--config={ARITH}:runlocal",
                  "--config.mesh.data=1", "--config.total_steps=40",
                  "--config.checkpoint_every=1", "--config.eval_every=1000"],
                 check=True, timeout=600, cwd=tmp_path, env=env)
  err = (out / "stderr").read_text()
  assert (out / "rc").read_text().strip() == "2", err[-3000:]
  lines = [l for l in err.splitlines() if "rlx: error:" in l or "Error" in l or "Trace" in l]
  assert len(lines) == 1 and "No space left on device" in lines[0], err[-3000:]
  assert lines[0].startswith(("rlx: error: could not save the checkpoint of step",
                              "rlx: error: could not write")), lines[0]
  assert checkpoint.Checkpointer(str(out / "wd")).latest_step() >= 2  # the last one is kept
