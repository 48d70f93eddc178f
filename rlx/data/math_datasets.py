r"""GSM8K and MATH from local JSONL files, as TFDS builders (no download, no TensorFlow).

Nothing is downloaded: put the public files in a directory (the TFDS `manual_dir`) and call

  sources = math_datasets.build("gsm8k", manual_dir="~/data/gsm8k", data_dir="/tmp/rlx_data")
  sources["train"][0]  # {'prompt': ..., 'answer': '72', 'difficulty': 2, 'solution': ..., ...}

GSM8K (github.com/openai/grade-school-math, folder grade_school_math/data/):
  files   `train.jsonl` (7,473 rows) and `test.jsonl` (1,319 rows)
  a row   {"question": "Natalia sold clips to 48 of her friends in April, ...",
           "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n...\n#### 72"}
  The final answer is the text after the last `#### ` (thousands commas removed). The
  difficulty is the number of reasoning steps: the lines of the solution before `####` (GSM8K
  problems take 2 to 8 steps; step count is the usual GSM8K complexity measure, e.g.
  arXiv 2210.00720).

MATH (Hendrycks et al., github.com/hendrycks/math; the Hugging Face dataset
`hendrycks/competition_math`, saved as JSONL with `dataset.to_json("train.jsonl")`):
  files   `train.jsonl` (7,500 rows) and/or `test.jsonl` (5,000 rows)
  a row   {"problem": "What is $\\dfrac{1}{2}+\\dfrac{1}{3}$?",
           "solution": "... $\\boxed{\\frac{5}{6}}$.", "level": "Level 2", "type": "Prealgebra"}
  The final answer is the content of the last \boxed{...} (or \fbox{...}) of the solution;
  the difficulty is the level, 1..5 (the few rows labelled "Level ?" get 0).
MATH-500 (Hugging Face `HuggingFaceH4/MATH-500`, file `test.jsonl`) rows are accepted too:
  {"problem": ..., "solution": ..., "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
   "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"}
  Here `answer` is used as given and `level` is an int.

Each example: prompt (the question / problem text, verbatim: prompt templates are applied
later), answer (the final answer string), difficulty (int32), solution (the reference solution
text), subject ('' for GSM8K) and id (`unique_id` when given, else `<split>-<line>`).
A split exists for each file present; at least one is required. The prepared dataset is cached
in data_dir under a fingerprint of the files' contents, so edited files are prepared anew.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds

from rlx.data import arithmetic, math_verify

SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}
KINDS = ("gsm8k", "math")

_WHERE_TO_GET = {
    "gsm8k": "GSM8K: train.jsonl and test.jsonl from github.com/openai/grade-school-math "
             "(folder grade_school_math/data)",
    "math": "MATH: train.jsonl and/or test.jsonl with fields problem, solution, level, type "
            "(the Hugging Face dataset hendrycks/competition_math saved with "
            "dataset.to_json(...)), or MATH-500's test.jsonl (HuggingFaceH4/MATH-500)",
}


class DataFileError(ValueError):
  """A missing manual_dir or file, a malformed line or a missing field (one clear sentence)."""


def _short(value: Any, limit: int = 80) -> str:
  """repr(value), cut to about `limit` characters: one JSONL line can hold megabytes."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


# ---- parsing one row -------------------------------------------------------------------------


def gsm8k_final_answer(solution: str) -> str | None:
  """'... #### 1,600' -> '1600'; None when the solution has no `####` line."""
  i = solution.rfind("####")
  if i < 0:
    return None
  answer = solution[i + 4:].strip().replace(",", "")
  return answer or None


def gsm8k_num_steps(solution: str) -> int:
  """Reasoning steps of a GSM8K solution: its non-empty lines before the `####` line."""
  body = solution[:solution.rfind("####")] if "####" in solution else solution
  return sum(1 for line in body.split("\n") if line.strip())


def math_level(level: Any) -> int | None:
  """'Level 3' / 3 / '3' -> 3; 'Level ?' -> 0; None when it is none of these."""
  if isinstance(level, bool):
    return None
  if isinstance(level, int):
    return level if 0 <= level <= 10 else None
  if isinstance(level, str):
    m = re.fullmatch(r"\s*(?:Level\s*)?(\d{1,3}|\?)\s*", level, re.IGNORECASE)
    if m:
      return 0 if m.group(1) == "?" else int(m.group(1))
  return None


def _field(row: dict, name: str, where: str, expected: str) -> str:
  if name not in row:
    raise DataFileError(f"{where}: missing field {name!r}; expected {expected} "
                        f"(got fields {_short(sorted(row))}).")
  value = row[name]
  if not isinstance(value, str):
    raise DataFileError(f"{where}: field {name!r} is {type(value).__name__} {_short(value)}; "
                        f"expected a string.")
  return value


_GSM8K_FIELDS = "GSM8K rows with fields 'question' and 'answer'"
_MATH_FIELDS = ("MATH rows with fields 'problem', 'solution', 'level', 'type' (or MATH-500 rows "
                "with 'problem', 'answer', 'level', 'subject', 'unique_id')")


def parse_gsm8k_row(row: dict, where: str, default_id: str) -> dict:
  question = _field(row, "question", where, _GSM8K_FIELDS)
  solution = _field(row, "answer", where, _GSM8K_FIELDS)
  answer = gsm8k_final_answer(solution)
  if answer is None:
    raise DataFileError(f"{where}: the 'answer' field has no final '#### <number>' line "
                        f"(GSM8K solutions end with one): {solution[-80:]!r}.")
  return {"prompt": question, "answer": answer, "difficulty": gsm8k_num_steps(solution),
          "solution": solution, "subject": "", "id": default_id}


def parse_math_row(row: dict, where: str, default_id: str) -> dict:
  problem = _field(row, "problem", where, _MATH_FIELDS)
  if "level" not in row:
    raise DataFileError(f"{where}: missing field 'level'; expected {_MATH_FIELDS} "
                        f"(got fields {_short(sorted(row))}).")
  level = math_level(row["level"])
  if level is None:
    raise DataFileError(f"{where}: field 'level' is {_short(row['level'])}; expected 'Level 1'.."
                        f"'Level 5' (MATH) or an int 1..5 (MATH-500).")
  if "answer" in row:  # MATH-500 style: the answer is given
    answer = _field(row, "answer", where, _MATH_FIELDS).strip()
    solution = row.get("solution", "") or ""
    subject = row.get("subject", row.get("type", "")) or ""
  else:
    solution = _field(row, "solution", where, _MATH_FIELDS)
    subject = _field(row, "type", where, _MATH_FIELDS)
    answer = (math_verify.last_boxed(solution) or "").strip()
    if not answer:
      raise DataFileError(f"{where}: the solution has no \\boxed{{...}} final answer: "
                          f"{solution[-80:]!r}.")
  if not answer:
    raise DataFileError(f"{where}: field 'answer' is empty.")
  return {"prompt": problem, "answer": answer, "difficulty": level, "solution": str(solution),
          "subject": str(subject), "id": str(row.get("unique_id", default_id))}


_PARSERS = {"gsm8k": parse_gsm8k_row, "math": parse_math_row}


def _lone_surrogate(value: Any, field: str = "") -> tuple[str, str] | None:
  """(field, '\\udXXX') of the first lone surrogate in a parsed JSON value (keys included),
  else None: json.loads accepts an unpaired \\ud800 escape, which no UTF-8 text can hold."""
  if isinstance(value, str):
    m = _SURROGATE.search(value)
    return None if m is None else (field, f"\\u{ord(m.group()):04x}")
  items = (value.items() if isinstance(value, dict) else enumerate(value)
           if isinstance(value, list) else ())
  for k, v in items:
    name = f"{field}.{k}" if field else str(k)
    found = _lone_surrogate(k, name) if isinstance(k, str) else None
    found = found or _lone_surrogate(v, name)
    if found:
      return found
  return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def read_jsonl_examples(path: str, kind: str, split: str) -> Iterator[dict]:
  """Parses one JSONL file into examples; errors name the file and line."""
  parse = _PARSERS[kind]
  rows = 0
  with open(path, "rb") as f:  # bytes, so that a non-UTF-8 line is reported with its number
    for line_no, raw in enumerate(f, start=1):
      where = f"{path}:{line_no}"
      if line_no == 1 and raw.startswith(codecs.BOM_UTF8):  # tolerate a byte-order mark
        raw = raw[len(codecs.BOM_UTF8):]
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataFileError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                            f"{e.start + 1}); expected a UTF-8 JSONL file.") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataFileError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); each line "
                            f"must be one JSON object.") from None
      if not isinstance(row, dict):
        raise DataFileError(f"{where}: a line holds a JSON {type(row).__name__}; expected "
                            f"one JSON object per line.")
      if "\\u" in line:  # only a \uXXXX escape gives a lone surrogate (UTF-8 bytes cannot)
        bad = _lone_surrogate(row)
        if bad is not None:
          raise DataFileError(f"{where}: field {bad[0]!r} holds the escape {bad[1]}, half of "
                              f"a UTF-16 surrogate pair without its other half (not a "
                              f"character); expected valid Unicode text.")
      rows += 1
      yield parse(row, where, f"{split}-{line_no}")
  if not rows:
    raise DataFileError(f"{path} has no rows; expected one JSON object per line "
                        f"({_GSM8K_FIELDS if kind == 'gsm8k' else _MATH_FIELDS}).")


# ---- files -----------------------------------------------------------------------------------


def split_files(kind: str, manual_dir: str) -> dict[str, str]:
  """{split: path} of the files present in manual_dir; raises if manual_dir or all are missing."""
  if kind not in KINDS:
    raise ValueError(f"Unknown math dataset {kind!r}; expected one of {KINDS}.")
  manual_dir = os.path.expanduser(manual_dir or "")
  expected = " and/or ".join(SPLIT_FILES.values())
  if not manual_dir or not os.path.isdir(manual_dir):
    raise DataFileError(f"manual_dir {manual_dir!r} is not a directory; put {expected} there. "
                        f"{_WHERE_TO_GET[kind]}.")
  for f in SPLIT_FILES.values():
    path = os.path.join(manual_dir, f)
    if os.path.exists(path) and not os.path.isfile(path):
      what = "a directory" if os.path.isdir(path) else "not a regular file"
      raise DataFileError(f"{path} is {what}; expected {f} to be a JSONL file (one JSON "
                          f"object per line). {_WHERE_TO_GET[kind]}.")
  found = {s: os.path.join(manual_dir, f) for s, f in SPLIT_FILES.items()
           if os.path.isfile(os.path.join(manual_dir, f))}
  if not found:
    raise DataFileError(f"{manual_dir} holds neither of {list(SPLIT_FILES.values())} (it has "
                        f"{sorted(os.listdir(manual_dir))[:10]}). {_WHERE_TO_GET[kind]}.")
  return found


def fingerprint(paths: Sequence[str]) -> str:
  h = hashlib.sha256()
  for p in sorted(paths):
    h.update(os.path.basename(p).encode() + b"\0")
    with open(p, "rb") as f:
      for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
  return h.hexdigest()[:16]


# ---- TFDS builders ---------------------------------------------------------------------------


def _features() -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict({
      "prompt": tfds.features.Text(),
      "answer": tfds.features.Text(),
      "difficulty": np.int32,
      "solution": tfds.features.Text(),
      "subject": tfds.features.Text(),
      "id": tfds.features.Text(),
  })


class _JsonlBuilder(tfds.core.GeneratorBasedBuilder):
  """Reads SPLIT_FILES from the manual_dir (see the module docstring)."""

  VERSION = tfds.core.Version("1.0.0")
  KIND = ""

  def _info(self) -> tfds.core.DatasetInfo:
    return arithmetic.LocalDatasetInfo(
        builder=self, description=f"{self.KIND} read from local JSONL files.",
        features=_features(), supervised_keys=None)

  def _split_generators(self, dl_manager):
    files = split_files(self.KIND, str(dl_manager.manual_dir))
    return {split: self._generate_examples(path, split) for split, path in files.items()}

  def _generate_examples(self, path: str, split: str):
    for i, ex in enumerate(read_jsonl_examples(path, self.KIND, split)):
      yield f"{split}-{i}", ex


class Gsm8kJsonl(_JsonlBuilder):
  """GSM8K from train.jsonl / test.jsonl in the manual_dir."""

  name = "gsm8k_jsonl"
  KIND = "gsm8k"
  MANUAL_DOWNLOAD_INSTRUCTIONS = _WHERE_TO_GET["gsm8k"]


class MathJsonl(_JsonlBuilder):
  """MATH (or MATH-500) from train.jsonl / test.jsonl in the manual_dir."""

  name = "math_jsonl"
  KIND = "math"
  MANUAL_DOWNLOAD_INSTRUCTIONS = _WHERE_TO_GET["math"]


BUILDERS = {"gsm8k": Gsm8kJsonl, "math": MathJsonl}


def build(kind: str, manual_dir: str, data_dir: str) -> dict[str, Sequence[dict]]:
  """Prepares (once per file contents, cached in data_dir) and returns {split: data source}.

  Splits are named after the files: 'train' (train.jsonl) and 'test' (test.jsonl).
  """
  files = split_files(kind, manual_dir)
  # Parse everything first: a bad line fails here with its file and line number, before TFDS
  # starts writing (and wrapping the error in its own).
  for split, path in files.items():
    for _ in read_jsonl_examples(path, kind, split):
      pass
  config = tfds.core.BuilderConfig(name="files-" + fingerprint(list(files.values())),
                                   description=f"{kind} from {sorted(files.values())}")
  os.makedirs(data_dir, exist_ok=True)
  sources = arithmetic.open_prepared(
      BUILDERS[kind], config, data_dir, _REGENERATE,
      download_config=tfds.download.DownloadConfig(manual_dir=os.path.expanduser(manual_dir)))
  return {split: sources[split] for split in files}


_REGENERATE = "the next run prepares it again from the JSONL files in manual_dir"


def read_all(source) -> list[dict]:
  """All examples of a source from build(), with str (not bytes) text fields.

  A corrupt shard is a ValueError that names the prepared directory.
  """
  return arithmetic.read_prepared(source, _REGENERATE)
