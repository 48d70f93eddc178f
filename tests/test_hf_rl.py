"""experiments/hf_rl.py end to end on a tiny Hugging Face checkpoint written by the test:
chat-template prompts, the host-Python "math" reward, training, and export back to
transformers."""

import json
import os

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from rlx import configs, trainer  # noqa: E402
from rlx.metrics import read_jsonl  # noqa: E402
from rlx.model import hf  # noqa: E402
import rlx  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_qwen"))
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  rng = np.random.default_rng(0)
  text = [f"Compute {a}+{b}=\nEnd your reply with the final number. {a + b}"
          for a, b in rng.integers(0, 99999, (400, 2))]
  tok.train_from_iterator(text, tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>", chat_template=CHATML)
  fast.save_pretrained(path)
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True, eos_token_id=tok.token_to_id(
                                     "<|im_end|>"))
  transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
  return path


def test_hf_rl_runlocal_trains_and_exports(tiny_qwen, tmp_path):
  config = configs.with_overrides(rlx.load_config("hf_rl", "runlocal"), {
      "model.path": tiny_qwen, "mesh.data": 1, "total_steps": 2, "eval_every": 2,
      "checkpoint_every": 2})
  logs = []
  summary = trainer.run(config, str(tmp_path / "run"), log=logs.append, show_progress=False,
                        devices=jax.devices()[:1])
  assert any("Hugging Face checkpoint" in l for l in logs)
  lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert [l["step"] for l in lines] == [0, 1, 2]
  assert lines[1]["ledger/tokens_generated"] > 0
  # The prompts were rendered with the model's chat template.
  setup = trainer.build(config, str(tmp_path / "probe"), log=lambda s: None,
                        devices=jax.devices()[:1])
  first = setup.exp.train_host.prompts[0]
  assert first.startswith("<|im_start|>user\nCompute ") and first.endswith(
      "<|im_start|>assistant\n")
  # The trained policy goes back to transformers unchanged.
  out = str(tmp_path / "export")
  hf.save_hf(setup.exp.model_cfg, jax.device_get(summary["state"].params), out,
             source_dir=tiny_qwen)
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert model.config.architectures == ["Qwen2ForCausalLM"]
  assert json.load(open(os.path.join(out, "config.json")))["eos_token_id"] == \
      json.load(open(os.path.join(tiny_qwen, "config.json")))["eos_token_id"]
