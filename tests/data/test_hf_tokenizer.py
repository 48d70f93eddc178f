"""Tokenizer parity with transformers.AutoTokenizer: sentencepiece and tokenizer.json."""

import io
import json
import os
import random

import pytest

from rlx.data import tokenizer as tokenizer_lib

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")

FRAGMENTS = ["hello", "world", "The", "quick", "brown", "fox", "jumps", "über", "naïve", "café",
             "日本語", "中文字符", "テスト", "한국어", "😀", "🚀", "👍🏽", "1234", "3.14159", "-42",
             "def f(x):", "return x", "x=1;", "Привет", "مرحبا", "Ελληνικά", "e\u0301",
             "don't", "I'm", "  ", "   ", "\n", "\n\n", "\t", " \n ", "...", "?!", "$100", "ﬁ",
             "<tag>", "a_b-c", "USA", "2+2=4", "\u00a0", "ZWJ\u200d", "x\r\ny"]


def _strings(n=300, seed=0):
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    parts = [rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10))]
    out.append(rng.choice(["", " ", ""]).join(parts) if rng.random() < 0.5 else " ".join(parts))
  out += ["", " ", "  leading", "trailing  ", "a\n\nb", "\n", "   ", "x  y   z", "12345678901",
          "🚀🚀 ok", "ÆØÅ unseen ŧ", " \t\n mixed"]
  return out


def _training_text(seed=1):
  return _strings(3000, seed)


QWEN_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- set date_string = \"26 Jul 2024\" %}\n"
    "{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse. 你好 🚀"},
     {"role": "user", "content": "  Add 17 and 25.\nShow work. "},
     {"role": "assistant", "content": "17 + 25 = 42"},
     {"role": "user", "content": "Now double it."}],
    [{"role": "system", "content": "Answer in JSON."},
     {"role": "user", "content": "name?"},
     {"role": "assistant", "content": "{\"name\": \"x\"}"}],
]


def _bpe(specials):
  """A byte-level BPE (GPT-2 / Qwen / Llama 3 style) trained on the test strings."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=600, special_tokens=specials,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(_training_text(), trainer)
  return tok


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  """ChatML tokenizer.json: no bos, eos <|im_end|>, pad <|endoftext|>, two stop ids."""
  path = str(tmp_path_factory.mktemp("qwen"))
  tok = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
      chat_template=QWEN_TEMPLATE)
  hf_tok.save_pretrained(path)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
               "pad_token_id": tok.token_to_id("<|endoftext|>")}, f)
  return path


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
  """Llama 3 style: the post-processor adds <|begin_of_text|>; eos <|eot_id|> + end_of_text."""
  path = str(tmp_path_factory.mktemp("llama3"))
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
              "<|end_header_id|>", "<|eot_id|>"]
  tok = _bpe(specials)
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
      special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
      chat_template=LLAMA3_TEMPLATE)
  hf_tok.save_pretrained(path)
  with open(os.path.join(path, "config.json"), "w") as f:  # no generation_config.json
    json.dump({"eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")],
               "bos_token_id": tok.token_to_id("<|begin_of_text|>")}, f)
  return path


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
  """A Llama/Gemma-style sentencepiece model: BPE, byte fallback, identity normalization."""
  path = str(tmp_path_factory.mktemp("sp"))
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_training_text()), model_writer=model, model_type="bpe",
      vocab_size=500, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
      remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=1.0,
      unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
      hard_vocab_limit=False)
  with open(os.path.join(path, "tokenizer.model"), "wb") as f:
    f.write(model.getvalue())
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
               "legacy": False, "chat_template": QWEN_TEMPLATE.replace(
                   "<|im_start|>", "<s>").replace("<|im_end|>", "</s>")}, f)
  return path


@pytest.mark.parametrize("legacy", [True, None])
def test_sentencepiece_legacy_prefix(sp_dir, tmp_path, legacy):
  """legacy=True: every text segment between special tokens gets the "▁" prefix."""
  import shutil  # pylint: disable=g-import-not-at-top
  path = shutil.copytree(sp_dir, tmp_path / "sp")
  config = json.loads((path / "tokenizer_config.json").read_text())
  config.pop("legacy")
  if legacy is not None:
    config["legacy"] = legacy
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  ours = tokenizer_lib.load_tokenizer(str(path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(path))
  strings = [f"<s>{a}</s>{b}" for a, b in zip(_strings(40, 3), _strings(40, 4))]
  _check_encode_decode(ours, theirs, strings)


def _check_encode_decode(ours, theirs, strings):
  mismatches = []
  for s in strings:
    for special in (False, True):
      want = theirs.encode(s, add_special_tokens=special)
      got = ours.encode(s, add_special_tokens=special)
      if got != want:
        mismatches.append((s, special, got, want))
    if theirs.eos_token in s:
      continue  # rlx's decode stops at the first stop token (tested in test_special_ids)
    ids = theirs.encode(s, add_special_tokens=False)
    want_text = theirs.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if ours.decode(ids) != want_text:
      mismatches.append((s, "decode", ours.decode(ids), want_text))
  assert not mismatches, f"{len(mismatches)} mismatches, e.g. {mismatches[:3]}"


@pytest.mark.parametrize("which", ["qwen_dir", "llama3_dir", "sp_dir"])
def test_encode_decode_match_transformers(which, request):
  path = request.getfixturevalue(which)
  ours = tokenizer_lib.load_tokenizer(path)
  theirs = transformers.AutoTokenizer.from_pretrained(path)
  assert isinstance(ours, tokenizer_lib.Tokenizer if which == "sp_dir"
                    else tokenizer_lib.HFTokenizer)
  strings = _strings()
  # special tokens written in the text are parsed as such
  strings += [f"{theirs.eos_token}x {s}" for s in strings[:20]]
  _check_encode_decode(ours, theirs, strings)
  assert ours.vocab_size == len(theirs)
  assert ours.eos_id == theirs.eos_token_id
  assert ours.bos_id == theirs.bos_token_id


def test_special_ids(qwen_dir, llama3_dir, sp_dir):
  qwen = tokenizer_lib.load_tokenizer(qwen_dir)
  im_end, eot = qwen.encode("<|im_end|><|endoftext|>")
  assert (qwen.bos_id, qwen.eos_id, qwen.pad_id, qwen.stop_ids) == (None, im_end, eot,
                                                                    (im_end, eot))
  assert qwen.decode(qwen.encode("ab cd") + [im_end] + qwen.encode("zz")) == "ab cd"
  llama = tokenizer_lib.load_tokenizer(llama3_dir)
  bos, end_text, eot_id = llama.encode("<|begin_of_text|><|end_of_text|><|eot_id|>")
  assert llama.bos_id == bos and llama.stop_ids == (eot_id, end_text)
  assert llama.encode("hi", add_special_tokens=True)[0] == bos
  assert llama.pad_id == eot_id  # no pad token anywhere: falls back to eos
  sp = tokenizer_lib.load_tokenizer(sp_dir)
  assert (sp.bos_id, sp.eos_id, sp.stop_ids) == (1, 2, (2,))
  assert sp.encode("hi", add_special_tokens=True)[0] == 1


@pytest.mark.parametrize("which", ["qwen_dir", "llama3_dir", "sp_dir"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(which, add_generation_prompt, request):
  path = request.getfixturevalue(which)
  ours = tokenizer_lib.load_tokenizer(path)
  theirs = transformers.AutoTokenizer.from_pretrained(path)
  for messages in CONVERSATIONS:
    want = theirs.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == want
    want_ids = theirs.apply_chat_template(messages, tokenize=True, return_dict=False,
                                          add_generation_prompt=add_generation_prompt)
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(
        want_ids)
  if which == "qwen_dir":
    assert got.startswith("<|im_start|>system\nAnswer in JSON.<|im_end|>\n")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "ü"}}}]
    assert ours.apply_chat_template(CONVERSATIONS[0], tools=tools) == (
        theirs.apply_chat_template(CONVERSATIONS[0], tools=tools, tokenize=False,
                                   add_generation_prompt=True))
  if which == "llama3_dir":  # template variables pass through, as in transformers
    assert "Today Date: 1 Jan 2025" in ours.apply_chat_template(CONVERSATIONS[0],
                                                                date_string="1 Jan 2025")


def test_chat_template_from_jinja_file_and_save(qwen_dir, tmp_path):
  ours = tokenizer_lib.load_tokenizer(qwen_dir)
  ours.save(str(tmp_path / "saved"))
  assert os.path.exists(tmp_path / "saved" / "chat_template.jinja")
  again = tokenizer_lib.load_tokenizer(str(tmp_path / "saved"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
  text = again.apply_chat_template(CONVERSATIONS[1])
  assert text == theirs.apply_chat_template(CONVERSATIONS[1], tokenize=False,
                                            add_generation_prompt=True)
  assert again.encode(text) == ours.encode(text)


def test_rlx_sentencepiece_unchanged(tmp_path):
  """Models from train_sentencepiece keep their fixed ids and old encode/decode."""
  tok = tokenizer_lib.train_sentencepiece(["1+2=3", "12+30=42", "7+8=15"] * 20, vocab_size=32)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1 + 1, 3)
  ids = tok.encode("12+3=15")
  assert tok.decode(ids + [tok.eos_id] + ids) == "12+3=15"
  assert tok.encode("12+3=15", add_special_tokens=True) == [tok.bos_id] + ids
  tok.save(str(tmp_path / "t.model"))
  loaded = tokenizer_lib.load_tokenizer(str(tmp_path / "t.model"))
  assert isinstance(loaded, tokenizer_lib.Tokenizer) and loaded.encode("12+3=15") == ids
  with pytest.raises(ValueError, match="no chat template"):
    loaded.apply_chat_template([{"role": "user", "content": "x"}])


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tokenizer_lib.load_tokenizer(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
    tokenizer_lib.load_tokenizer(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a valid tokenizer.json"):
    tokenizer_lib.load_tokenizer(str(tmp_path))
