"""GSM8K / MATH TFDS builders over small JSONL files written in the exact public formats."""

import json
import os

import pytest

from rlx.data import math_datasets as md
from rlx.data.math_verify import answers_match

GSM8K_TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                 "many clips to her friends in May. How many clips did Natalia sell altogether "
                 "in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
                 "babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she "
               "earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "A company spends $1,000 a month on each of 3 offices for 2 months. What is "
                 "the total cost?",
     "answer": "One month costs 3 * 1,000 = $<<3*1000=3000>>3,000.\nTwo months cost 2 * 3,000 "
               "= $<<2*3000=6000>>6,000.\nSo the total is $6,000.\n#### 6,000"},
]
GSM8K_TEST = [
    {"question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning "
                 "and bakes muffins for her friends every day with four. She sells the "
                 "remainder at the farmers' market daily for $2 per fresh duck egg. How much in "
                 "dollars does she make every day at the farmers' market?",
     "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = "
               "$<<9*2=18>>18 every day at the farmer\u2019s market.\n#### 18"},
]
MATH_TRAIN = [
    {"problem": "Let \\[f(x) = \\left\\{\n\\begin{array}{cl} ax+3, &\\text{ if }x>2, \\\\\nx-5 "
                "&\\text{ if } -2 \\le x \\le 2, \\\\\n2x-b &\\text{ if } x <-2.\n\\end{array}"
                "\n\\right.\\]Find $a+b$ if the piecewise function is continuous.",
     "level": "Level 5", "type": "Algebra",
     "solution": "For the piecewise function to be continuous, ... So $a+b=-3+3=\\boxed{0}$."},
    {"problem": "What is the value of $\\sqrt{36 \\times \\sqrt{16}}$?", "level": "Level 1",
     "type": "Prealgebra",
     "solution": "Calculating from the inside out, $$\\sqrt{36 \\times \\sqrt{16}} = \\sqrt{36 "
                 "\\times 4} = \\sqrt{144} = \\boxed{12}.$$"},
    {"problem": "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? "
                "Express your answer as a common fraction.", "level": "Level 3",
     "type": "Algebra",
     "solution": "$f(-2)+f(-1)+f(0)=\\frac{-8}{-4}+\\frac{-5}{-3}+\\frac{-2}{-2}=2+\\frac{5}{3}"
                 "+1=\\boxed{\\frac{14}{3}}$"},
    {"problem": "In the diagram, what is the measure of $\\angle PQR$?", "level": "Level ?",
     "type": "Geometry",
     "solution": "Since $\\angle PQS$ is a straight angle, ... $\\angle PQR = \\boxed{"
                 "{90^\\circ}}$."},
]
MATH500_TEST = [
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  "
                "Enter your answer in the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta "
                "< 2 \\pi.$",
     "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$  ... Therefore, the polar "
                 "coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "What is $1^{(2^{235423523})}$?",
     "solution": "One raised to any power is one, so our answer is $\\boxed{1}.$",
     "answer": "1", "subject": "Prealgebra", "level": 1,
     "unique_id": "test/prealgebra/1747.json"},
]


def write_jsonl(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


@pytest.fixture
def gsm8k_dir(tmp_path):
  d = tmp_path / "gsm8k"
  write_jsonl(str(d / "train.jsonl"), GSM8K_TRAIN)
  write_jsonl(str(d / "test.jsonl"), GSM8K_TEST)
  return str(d)


def test_gsm8k_builder_extracts_answers_and_steps(gsm8k_dir, tmp_path):
  sources = md.build("gsm8k", gsm8k_dir, str(tmp_path / "data"))
  assert sorted(sources) == ["test", "train"]
  train = sorted(md.read_all(sources["train"]), key=lambda e: e["prompt"])
  test = md.read_all(sources["test"])
  assert [e["answer"] for e in train] == ["6000", "72", "10"]  # thousands comma removed
  assert [e["difficulty"] for e in train] == [3, 2, 2]  # solution lines before '####'
  assert test[0]["answer"] == "18" and test[0]["prompt"] == GSM8K_TEST[0]["question"]
  assert test[0]["solution"] == GSM8K_TEST[0]["answer"] and test[0]["subject"] == ""


def test_math_builder_reads_hendrycks_and_math500_rows(tmp_path):
  d = tmp_path / "math"
  write_jsonl(str(d / "train.jsonl"), MATH_TRAIN)
  write_jsonl(str(d / "test.jsonl"), MATH500_TEST)
  sources = md.build("math", str(d), str(tmp_path / "data"))
  train = {e["prompt"]: e for e in md.read_all(sources["train"])}
  got = [(train[r["problem"]]["answer"], train[r["problem"]]["difficulty"],
          train[r["problem"]]["subject"]) for r in MATH_TRAIN]
  assert got == [("0", 5, "Algebra"), ("12", 1, "Prealgebra"), ("\\frac{14}{3}", 3, "Algebra"),
                 ("{90^\\circ}", 0, "Geometry")]
  test = sorted(md.read_all(sources["test"]), key=lambda e: e["difficulty"])
  assert [(e["answer"], e["difficulty"], e["id"]) for e in test] == [
      ("1", 1, "test/prealgebra/1747.json"),
      ("\\left( 3, \\frac{\\pi}{2} \\right)", 2, "test/precalculus/807.json")]
  # The extracted answers are what the verifier compares model answers with.
  assert answers_match("(3, \\frac{\\pi}{2})", test[1]["answer"])
  assert answers_match("90", got[3][0])


def test_only_one_split_file_is_enough(tmp_path):
  d = tmp_path / "math500"
  write_jsonl(str(d / "test.jsonl"), MATH500_TEST)
  sources = md.build("math", str(d), str(tmp_path / "data"))
  assert list(sources) == ["test"] and len(sources["test"]) == 2


def test_edited_files_are_prepared_again(gsm8k_dir, tmp_path):
  data = str(tmp_path / "data")
  assert len(md.build("gsm8k", gsm8k_dir, data)["test"]) == 1
  write_jsonl(os.path.join(gsm8k_dir, "test.jsonl"), GSM8K_TEST + GSM8K_TRAIN[:1])
  assert len(md.build("gsm8k", gsm8k_dir, data)["test"]) == 2


def test_missing_manual_dir_names_the_expected_files(tmp_path):
  with pytest.raises(md.DataFileError, match=r"manual_dir '.*nowhere' is not a directory; put "
                     r"train.jsonl and/or test.jsonl there. GSM8K: .*openai/grade-school-math"):
    md.build("gsm8k", str(tmp_path / "nowhere"), str(tmp_path / "data"))
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "gsm8k_train.json").write_text("{}")
  with pytest.raises(md.DataFileError, match=r"holds neither of \['train.jsonl', 'test.jsonl'\] "
                     r"\(it has \['gsm8k_train.json'\]\). MATH: "):
    md.build("math", str(tmp_path / "empty"), str(tmp_path / "data"))


@pytest.mark.parametrize("kind, lines, message", [
    ("gsm8k", [json.dumps(GSM8K_TRAIN[0]), '{"question": "x", "answer": "#### 3"'],
     r"train.jsonl:2: malformed JSON"),
    ("gsm8k", [json.dumps({"question": "How many?", "solution": "#### 3"})],
     r"train.jsonl:1: missing field 'answer'; expected GSM8K rows with fields 'question' and "
     r"'answer' \(got fields \['question', 'solution'\]\)"),
    ("gsm8k", [json.dumps({"question": "How many?", "answer": "It is 3."})],
     r"train.jsonl:1: the 'answer' field has no final '#### <number>' line"),
    ("math", ["", json.dumps({"problem": "p", "solution": "no box", "level": "Level 2",
                              "type": "Algebra"})],
     r"train.jsonl:2: the solution has no \\boxed\{...\} final answer"),
    ("math", [json.dumps({"problem": "p", "solution": "\\boxed{1}", "level": "hard",
                          "type": "Algebra"})],
     r"train.jsonl:1: field 'level' is 'hard'; expected 'Level 1'..'Level 5'"),
    ("math", [json.dumps({"problem": "p", "solution": "\\boxed{1}", "level": "Level 1"})],
     r"train.jsonl:1: missing field 'type'"),
    ("math", [json.dumps({"problem": None, "answer": "1", "level": 1})],
     r"train.jsonl:1: field 'problem' is NoneType None; expected a string"),
    ("math", ["[1, 2]"], r"train.jsonl:1: a line holds a JSON list; expected one JSON object"),
])
def test_bad_rows_name_file_and_line(kind, lines, message, tmp_path):
  d = tmp_path / kind
  d.mkdir()
  (d / "train.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(md.DataFileError, match=message):
    md.build(kind, str(d), str(tmp_path / "data"))
  assert not os.path.exists(tmp_path / "data")  # failed before TFDS wrote anything


def test_builder_used_directly_through_tfds(gsm8k_dir, tmp_path):
  import tensorflow_datasets as tfds
  builder = md.Gsm8kJsonl(data_dir=str(tmp_path / "data"), file_format="array_record")
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=gsm8k_dir))
  assert len(builder.as_data_source()["train"]) == 3
