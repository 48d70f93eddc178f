"""Bad tokenizer directories, chat templates, JSONL files and TFDS shards: one-line errors."""

import glob
import json
import os
import shutil
import time

import pytest

from rlx.data import arithmetic as ar
from rlx.data import math_datasets as md
from rlx.data import tokenizer as tokenizer_lib
from rlx.data.tasks import tokenize_pool

USER = [{"role": "user", "content": "2+2?"}]


def _one_line(excinfo, pattern):
  message = str(excinfo.value)
  assert "\n" not in message, message
  assert len(message) < 600, message[:1000]
  assert excinfo.match(pattern)


@pytest.fixture(scope="module")
def sp_model():
  tok = tokenizer_lib.train_sentencepiece(["1+2=3", "12+30=42", "hello world"] * 20, 40)
  return tok._sp.serialized_model_proto()  # pylint: disable=protected-access


def _tokenizer_dir(path, sp_model, files):
  """A sentencepiece model directory with files {name: str, bytes or a JSON value}."""
  files = {"tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>"}, **files}
  (path / "tokenizer.model").write_bytes(sp_model)
  for name, contents in files.items():
    if not isinstance(contents, (str, bytes)):
      contents = json.dumps(contents)
    (path / name).write_bytes(contents if isinstance(contents, bytes) else contents.encode())
  return str(path)


# ---- chat templates --------------------------------------------------------------------------


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}\n{{ m.role }\n{% endfor %}",
     r"is not valid jinja2 at line 2: unexpected '}'$"),
    ("{% if messages|length < 2 %}\n{{ raise_exception('Conversation roles must\nalternate "
     "user/assistant') }}{% endif %}",
     r"raised an error at line 2: Conversation roles must alternate user/assistant$"),
    ("hi\n{{ messages.append(1) }}", r"did something the sandbox forbids at line 2: access to "
     r"attribute 'append' of 'list' object is unsafe"),
    ("{{ ''.__class__.__mro__ }}", r"did something the sandbox forbids at line 1: "
     r"access to attribute '__class__'"),
    ("{{ 'x' * 10**8 }}", r"did something the sandbox forbids at line 1: repeating a str of "
     r"length 1 100000000 times is too large"),
    ("{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}",
     r"failed at line 1: OverflowError: Range too big"),
    ("{{ messages[0].content.foo.bar }}", r"failed at line 1: UndefinedError: .*'foo'"),
])
def test_broken_chat_template_is_one_line_naming_the_file(template, message, sp_model,
                                                          tmp_path):
  config = {"eos_token": "</s>", "chat_template": template}
  tok = tokenizer_lib.load_tokenizer(_tokenizer_dir(tmp_path, sp_model,
                                                    {"tokenizer_config.json": config}))
  with pytest.raises(ValueError) as e:
    tok.apply_chat_template(USER)
  _one_line(e, r"^The chat template in .*tokenizer_config.json " + message)


def test_chat_template_error_names_the_jinja_file(sp_model, tmp_path):
  tok = tokenizer_lib.load_tokenizer(_tokenizer_dir(
      tmp_path, sp_model, {"chat_template.jinja": "{{ raise_exception('no system role') }}"}))
  with pytest.raises(ValueError) as e:
    tok.apply_chat_template(USER)
  _one_line(e, r"chat_template.jinja raised an error at line 1: no system role")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    # No call inside the loops: only the check compiled into each loop body can stop this one.
    "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
])
def test_endless_chat_template_is_stopped(template, sp_model, tmp_path):
  tok = tokenizer_lib.load_tokenizer(_tokenizer_dir(
      tmp_path, sp_model, {"chat_template.jinja": template}))
  start = time.monotonic()
  with pytest.raises(ValueError) as e:
    tok.apply_chat_template(USER, time_limit_s=0.2)
  assert time.monotonic() - start < 5
  _one_line(e, r"chat_template.jinja was still rendering after 0.2 s; expected it to finish in "
               r"milliseconds")
  # The default budget is generous, and the deadline does not outlive the failed render.
  assert tokenizer_lib.CHAT_TEMPLATE_TIME_LIMIT_S >= 1
  assert tokenizer_lib.render_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}",
                                            USER) == "2+2?"


# ---- tokenizer json files --------------------------------------------------------------------


@pytest.mark.parametrize("name, contents, message", [
    ("tokenizer_config.json", "{\"eos_token\": ", r"tokenizer_config.json is not valid JSON "
     r"\(Expecting value at line 1 column 15\)"),
    ("tokenizer_config.json", ["<s>"], r"tokenizer_config.json holds a JSON list; expected a "
     r"JSON object"),
    ("special_tokens_map.json", "null", r"special_tokens_map.json holds a JSON NoneType; "
     r"expected a JSON object"),
    ("special_tokens_map.json", b"{\"eos_token\": \"\xff\"}", r"special_tokens_map.json is not "
     r"UTF-8 text \(byte 0xff at offset 15\)"),
    ("generation_config.json", "[1, 2]", r"generation_config.json holds a JSON list"),
    ("generation_config.json", {"eos_token_id": ["</s>" * 1000]},
     r"generation_config.json: eos_token_id is \['</s></s>.*\.\.\. \(\d+ characters\); "
     r"expected a token id or a list of ids"),
    ("tokenizer_config.json", {"chat_template": 7}, r"tokenizer_config.json: chat_template is "
     r"7; expected a jinja2 template string"),
    ("chat_template.jinja", b"{{ '\xe9' }}", r"chat_template.jinja is not UTF-8 text"),
])
def test_malformed_tokenizer_json_is_one_line_naming_the_file(name, contents, message, sp_model,
                                                              tmp_path):
  path = _tokenizer_dir(tmp_path, sp_model, {name: contents})
  with pytest.raises(ValueError) as e:
    tokenizer_lib.load_tokenizer(path)
  _one_line(e, "^" + str(tmp_path) + "/" + message)


# ---- GSM8K / MATH JSONL ----------------------------------------------------------------------

GSM8K_ROW = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
MATH_ROW = {"problem": "p", "solution": "\\boxed{1}", "level": "Level 1", "type": "Algebra"}


@pytest.mark.parametrize("kind, contents, message", [
    ("gsm8k", b"", r"train.jsonl has no rows; expected one JSON object per line \(GSM8K rows"),
    ("math", b"\n  \n", r"train.jsonl has no rows; expected one JSON object per line \(MATH rows"),
    ("gsm8k", (GSM8K_ROW + "\n").encode() + b'{"question": "caf\xe9", "answer": "#### 1"}\n',
     r"train.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\); expected a UTF-8 JSONL file"),
    ("gsm8k", (GSM8K_ROW + "\n\n" + '{"question": "' + "x" * 10**6 + '"').encode(),
     r"train.jsonl:3: malformed JSON \(Expecting ',' delimiter at column \d+\)"),
    ("math", json.dumps({**MATH_ROW, "level": "Level " + "9" * 10**6}).encode(),
     r"train.jsonl:1: field 'level' is 'Level 9999.*\.\.\. \(\d+ characters\); expected "),
    ("math", json.dumps({**MATH_ROW, "problem": ["x" * 10**6]}).encode(),
     r"train.jsonl:1: field 'problem' is list \['xxx.*\.\.\. \(\d+ characters\); expected a "
     r"string"),
    # json.loads accepts an unpaired surrogate escape; TFDS's UTF-8 encoder then raised.
    ("gsm8k", b'{"question": "x\\ud800y", "answer": "#### 1"}\n',
     r"train.jsonl:1: field 'question' holds the escape \\ud800, half of a UTF-16 surrogate "
     r"pair without its other half \(not a character\); expected valid Unicode text\.$"),
    ("math", (json.dumps({**MATH_ROW, "extra": {"notes": ["ok", "\udfff"]}}) + "\n").encode(),
     r"train.jsonl:1: field 'extra.notes.1' holds the escape \\udfff"),
    ("gsm8k", json.dumps({f"field{i}": 1 for i in range(10**5)}).encode(),
     r"train.jsonl:1: missing field 'question'; .* \(got fields \['field0', .*\.\.\. "
     r"\(\d+ characters\)\)\.$"),
])
def test_bad_jsonl_is_one_short_line_naming_file_and_line(kind, contents, message, tmp_path):
  (tmp_path / kind).mkdir()
  (tmp_path / kind / "train.jsonl").write_bytes(contents)
  with pytest.raises(md.DataFileError) as e:
    md.build(kind, str(tmp_path / kind), str(tmp_path / "data"))
  _one_line(e, message)


def test_a_paired_surrogate_escape_is_text(tmp_path):
  (tmp_path / "train.jsonl").write_text('{"question": "\\ud83d\\ude00?", "answer": "#### 1"}\n')
  assert [e["prompt"] for e in md.read_jsonl_examples(str(tmp_path / "train.jsonl"), "gsm8k",
                                                       "train")] == ["\U0001F600?"]


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
def test_a_split_file_that_is_a_directory_is_named(kind, tmp_path):
  # The message named neither the file nor the cause ("holds neither of [...] (it has
  # ['train.jsonl'])"), and beside a good test.jsonl the directory was passed over in silence.
  d = tmp_path / kind
  (d / "train.jsonl").mkdir(parents=True)
  for extra in ([], ["test.jsonl"]):
    for name in extra:
      (d / name).write_text(GSM8K_ROW + "\n" if kind == "gsm8k" else json.dumps(MATH_ROW))
    with pytest.raises(md.DataFileError) as e:
      md.build(kind, str(d), str(tmp_path / "data"))
    _one_line(e, "^" + str(d) + r"/train.jsonl is a directory; expected train.jsonl to be a "
              r"JSONL file \(one JSON object per line\)\. (GSM8K|MATH): ")
  assert not os.path.exists(tmp_path / "data")


def test_long_prompt_error_quotes_a_short_prefix():
  tok = tokenizer_lib.train_sentencepiece(["1+1=2"] * 20, 16)
  with pytest.raises(ValueError) as e:
    tokenize_pool([{"prompt": "1+1=\n" * 10**5, "answer": "2"}], tok, 8, 4, task_name="arith")
  _one_line(e, r"arith: example 0 prompt '1\+1=\\n1\+1=.*\.\.\. \(600002 characters\) has \d+ "
               r"tokens, longer than the maximum prompt length 8")


# ---- corrupt TFDS shards ---------------------------------------------------------------------


def _corrupt_shard(data_dir, split, how):
  [shard] = glob.glob(os.path.join(data_dir, "**", f"*-{split}.array_record-*"), recursive=True)
  size = os.path.getsize(shard)
  with open(shard, "r+b") as f:
    if how == "garbage":
      f.write(bytes(range(256)) * (size // 256))
    else:  # truncated: what a full disk or a killed copy leaves
      f.truncate(size // 2)
  return os.path.dirname(shard)


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_corrupt_arithmetic_shard_says_to_delete_the_directory(how, tmp_path):
  spec = ar.ArithmeticSpec(ops=("add",), levels=(1,), num_train_per_level=20,
                           num_eval_per_level=5)
  data_dir = str(tmp_path / "data")
  ar.build(spec, data_dir)
  prepared = _corrupt_shard(data_dir, "train", how)
  sources = ar.build(spec, data_dir)
  assert len(ar.read_all(sources["eval"])) == 5
  with pytest.raises(ValueError) as e:
    ar.read_all(sources["train"])
  _one_line(e, f"^The prepared dataset in {prepared} cannot be read \\(.*\\); its files are "
               f"corrupt: delete {prepared} and the next run generates it again.$")
  shutil.rmtree(prepared)  # as the message says
  assert len(ar.read_all(ar.build(spec, data_dir)["train"])) == 20


def test_corrupt_dataset_info_says_to_delete_the_directory(tmp_path):
  spec = ar.ArithmeticSpec(ops=("add",), levels=(1,), num_train_per_level=20,
                           num_eval_per_level=5)
  data_dir = str(tmp_path / "data")
  ar.build(spec, data_dir)
  [info] = glob.glob(os.path.join(data_dir, "**", "dataset_info.json"), recursive=True)
  with open(info, "w") as f:
    f.write("{\"name\": ")
  with pytest.raises(ValueError) as e:
    ar.build(spec, data_dir)
  _one_line(e, f"^The prepared dataset in {os.path.dirname(info)} cannot be read .*; its files "
               f"are corrupt: delete .* and the next run generates it again.$")


def test_corrupt_math_shard_says_it_is_prepared_again_from_manual_dir(tmp_path):
  manual = tmp_path / "gsm8k"
  manual.mkdir()
  (manual / "test.jsonl").write_text(GSM8K_ROW + "\n")
  data_dir = str(tmp_path / "data")
  md.build("gsm8k", str(manual), data_dir)
  prepared = _corrupt_shard(data_dir, "test", "garbage")
  with pytest.raises(ValueError) as e:
    md.read_all(md.build("gsm8k", str(manual), data_dir)["test"])
  _one_line(e, f"^The prepared dataset in {prepared} cannot be read \\(.*\\); its files are "
               f"corrupt: delete {prepared} and the next run prepares it again from the JSONL "
               f"files in manual_dir.$")
