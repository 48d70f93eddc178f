"""End to end: the runlocal experiment trains, logs, checkpoints and resumes; bad input fails
with one clear message."""

import os

import pytest

import rlx
from rlx import checkpoint, configs, train, trainer
from rlx.metrics import MetricsWarning

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH = os.path.join(REPO, "experiments", "arith.py")


def runlocal_config(**overrides):
  return configs.with_overrides(rlx.load_config(ARITH, "runlocal"), overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  logs = []
  summary = trainer.run(runlocal_config(), workdir, log=logs.append, show_progress=False)
  return workdir, logs, summary


def test_runlocal_trains_logs_and_checkpoints(trained):
  workdir, logs, summary = trained
  lines = rlx.read_metrics(workdir)
  assert [l["step"] for l in lines] == list(range(0, 9))
  step = lines[3]
  for key in ("reward/mean", "ledger/tokens_generated", "ledger/tokens_trained",
              "ledger/zero_adv_group_frac", "ledger/truncated_frac", "time/generate_s",
              "time/update_s", "loss/policy", "grad_norm"):
    assert key in step, key
  assert step["ledger/tokens_generated"] > 0
  assert "eval/band_accuracy" in lines[0] and "eval/band_accuracy" in lines[-1]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "8"]
  assert any("before RL" in l for l in logs) and any("after RL" in l for l in logs)
  assert os.path.exists(os.path.join(workdir, "base", "model.safetensors"))
  assert summary["after"]["eval/band_accuracy"] == lines[-1]["eval/band_accuracy"]


def test_rerun_resumes_from_the_last_checkpoint(trained):
  workdir, _, _ = trained
  # A damaged line in the middle of metrics.jsonl (and a torn last one) costs only themselves.
  path = os.path.join(workdir, "metrics.jsonl")
  lines = open(path).read().splitlines(keepends=True)
  with open(path, "w") as f:
    f.writelines(lines[:3] + ["{\"step\": 3, \"rew\x00\n"] + lines[3:] + ['{"step": 9, "rew'])
  logs = []
  with pytest.warns(MetricsWarning, match=r"metrics.jsonl: skipped 2 unreadable lines \(lines 4, "
                    r"11\); moved to .*metrics.jsonl.corrupt"):
    trainer.run(runlocal_config(total_steps=10), workdir, log=logs.append, show_progress=False)
  assert any("resumed from" in l and l.endswith("/8") for l in logs), logs
  assert not any("supervised warm start" in l for l in logs)  # the base model is cached
  lines = rlx.read_metrics(workdir)
  assert [l["step"] for l in lines] == list(range(0, 11))
  assert open(path + ".corrupt").read() == '{"step": 3, "rew\x00\n{"step": 9, "rew\n'


def test_workdir_with_a_different_model_is_refused(trained, tmp_path):
  workdir, _, _ = trained
  base = os.path.join(workdir, "base", "model.safetensors")
  before = open(base, "rb").read()
  with pytest.raises(checkpoint.CheckpointError, match=r"holds a run made with another task or "
                     r"model .*'d_model': 32.*not .*'d_model': 48"):
    trainer.run(runlocal_config(**{"model.d_model": 48, "sft.steps": 2}), workdir,
                log=lambda s: None, show_progress=False)
  # The refused run left the existing checkpoints and base model alone.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "8"]
  assert open(base, "rb").read() == before


def test_a_checkpoint_resumes_with_another_compute_dtype(trained, tmp_path):
  """A run made computing in float32 (model.dtype="auto" on CPU) resumes computing in bfloat16,
  as "auto" does on a GPU: the state holds f32 master params either way, the cached base is
  reused, and the resume names the change, which config.json records."""
  import json  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  workdir, _, _ = trained
  other = str(tmp_path / "bf16")
  shutil.copytree(workdir, other)
  assert json.load(open(os.path.join(other, "config.json")))["model"]["dtype"] == "float32"
  logs = []
  trainer.run(runlocal_config(total_steps=12, **{"model.dtype": "bfloat16"}), other,
              log=logs.append, show_progress=False)
  assert any("model.dtype: checkpoint 'float32', now 'bfloat16'" in l for l in logs), logs
  assert any("computing in bfloat16 with float32 master params" in l for l in logs), logs
  assert not any("supervised warm start" in l for l in logs)
  assert rlx.read_metrics(other)[-1]["step"] == 12
  assert json.load(open(os.path.join(other, "config.json")))["model"]["dtype"] == "bfloat16"


def test_resume_with_the_layers_scanned_continues_the_run(trained, tmp_path):
  """model.scan_layers is how the layers run, not what they hold: a run checkpointed unrolled
  resumes scanned from the same state and cached base, and goes on learning the same way
  (the model tests compare the two numerically)."""
  import shutil  # pylint: disable=g-import-not-at-top
  workdir, _, _ = trained
  other = str(tmp_path / "scan")
  shutil.copytree(workdir, other)
  logs = []
  trainer.run(runlocal_config(total_steps=12, **{"model.scan_layers": True}), other,
              log=logs.append, show_progress=False)
  assert not any("supervised warm start" in l for l in logs), logs
  lines = rlx.read_metrics(other)
  assert sorted({l["step"] for l in lines})[-3:] == [10, 11, 12]


def test_bf16_compute_keeps_f32_master_params_and_optimizer_state(trained, tmp_path):
  """The cached base loads in model.param_dtype, not in the compute dtype: under bf16 compute
  the params the update trains and their Adam moments are f32; only the sampler's copy is
  bf16."""
  import shutil  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  workdir, _, _ = trained
  other = str(tmp_path / "bf16_build")
  shutil.copytree(workdir, other)
  setup = trainer.build(runlocal_config(**{"model.dtype": "bfloat16"}), other,
                        log=lambda s: None)
  assert (setup.exp.model_cfg.dtype, setup.step_cfg.compute_dtype) == ("bfloat16", "bfloat16")
  floats = lambda t: {str(x.dtype) for x in jax.tree.leaves(t) if x.ndim}
  assert floats(setup.state.params) == floats(setup.state.opt_state) == {"float32"}
  policy = floats(jax.jit(lambda s: train.policy_params(s, setup.step_cfg))(setup.state))
  assert policy == {"bfloat16", "float32"}  # matrices bf16; norm scales f32


def test_checkpoint_of_a_different_architecture_is_refused(trained, tmp_path):
  # Same task, but the checkpoint's recorded model differs from what the config builds.
  workdir, _, _ = trained
  ck = checkpoint.Checkpointer(workdir)
  meta = ck.read_meta(10)
  meta["model"]["num_layers"] = 7
  import shutil
  other = str(tmp_path / "other")
  shutil.copytree(workdir, other)
  checkpoint.save_json(os.path.join(other, "checkpoints", "10", "meta", "metadata"), meta)
  with pytest.raises(checkpoint.CheckpointError, match=r"holds a different model \(num_layers: "
                     r"checkpoint 7 vs config 2\)"):
    trainer.run(runlocal_config(total_steps=12), other, log=lambda s: None,
                show_progress=False)


