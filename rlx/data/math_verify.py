r"""Final-answer extraction and comparison for GSM8K- and MATH-style problems (pure Python).

  extract_answer(completion)   the answer a model wrote: the last \boxed{...} (nested braces),
                               else the last `#### x`, else the last "The answer is x",
                               else the last number in the text; None if there is none.
  normalize_answer(text)       a canonical string (LaTeX wrappers, units, `$`, `%`, thousands
                               separators and spaces removed; \dfrac -> \frac, \sqrt2 ->
                               \sqrt{2}, ...).
  answers_match(pred, ref)     True when the two answers are the same.

What counts as the same (decided here, tested in tests/data/test_math_verify.py):
  * Numbers compare as exact rationals: 0.5 = \frac{1}{2} = 1/2 = \dfrac12, 2.0 = 2,
    -\frac{1}{2} = \frac{-1}{2} = -0.5, 1e3 = 1000 = 1\times10^{3}. A rounded decimal does not
    equal a fraction it approximates (0.33 != \frac{1}{3}): MATH asks for exact answers.
  * Mixed numbers: `2\frac{1}{4}` is 9/4 (MATH writes mixed numbers this way).
  * Commas: a comma followed by exactly three digits is a thousands separator (1,000 = 1000,
    10{,}000 and 10,\!000 too); anything else is a list separator, so `1,2` is the list (1, 2)
    and does not equal 12.
  * Units and decorations are dropped: `$18`, `18 dollars`, `5 cm`, `10\text{ cm}^2`, `30^\circ`,
    `50\%`, `x = 5`. The percent sign is only dropped (50\% = 50, not 0.5).
  * Lists: unbracketed lists (`1, 2`; MATH's "enter all solutions") compare as multisets;
    bracketed tuples and intervals compare elementwise in order and the brackets must agree
    (`(1,2)` != `[1,2)`); `\{1,2\}` is a set (order-free).
  * Everything else (sqrt forms, \pi, expressions, words) compares as normalized strings:
    `\sqrt2` = `\sqrt{2}`, `\frac{\sqrt3}{2}` = `\frac{\sqrt{3}}{2}`, but `\frac{1}{\sqrt{2}}`
    != `\frac{\sqrt{2}}{2}` (no symbolic algebra). Comparison is case-sensitive.

No sympy on purpose: a reward must not change with what happens to be installed.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED_CMDS = ("\\boxed", "\\fbox")


def _braced(text: str, open_at: int) -> tuple[str, int] | None:
  """The content of the brace group opening at text[open_at] == '{' and the index after it."""
  depth = 0
  for i in range(open_at, len(text)):
    c = text[i]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[open_at + 1:i], i + 1
  return None


def last_boxed(text: str) -> str | None:
  r"""The content of the last \boxed{...} / \fbox{...} (or `\boxed 5`), braces balanced."""
  start = max(text.rfind(cmd) for cmd in _BOXED_CMDS)
  while start >= 0:
    cmd = next(c for c in _BOXED_CMDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == "{":
      got = _braced(text, i)
      if got is not None:
        return got[0]
    elif i < len(text) and text[i] == " ":  # `\boxed 5`: up to the next `$` or space
      m = re.match(r" +([^\s$]+)", text[i:])
      if m:
        return m.group(1)
    start = max(text.rfind(cmd, 0, start) for cmd in _BOXED_CMDS)
  return None


_NUMBER_IN_TEXT = re.compile(
    r"(?<![\w.])(?:-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+)")
_ANSWER_IS = re.compile(r"(?:final\s+)?answer\s+is\b\s*:?\s*(.+)", re.IGNORECASE)


def extract_answer(completion: str) -> str | None:
  """The final answer a completion states, as written (see the module docstring), or None."""
  if not completion:
    return None
  boxed = last_boxed(completion)
  if boxed is not None and boxed.strip():
    return boxed.strip()
  hashes = completion.rfind("####")
  if hashes >= 0:
    line = completion[hashes + 4:].strip().split("\n")[0].strip()
    if line:
      return line
  found = list(_ANSWER_IS.finditer(completion))
  if found:
    text = found[-1].group(1).split("\n")[0].strip()
    text = re.sub(r"\.\s.*$", "", text)  # the sentence ends at ". "
    text = text.rstrip(". ").strip()
    if text:
      return text
  numbers = _NUMBER_IN_TEXT.findall(completion)
  return numbers[-1] if numbers else None


# ---- normalization ---------------------------------------------------------------------------

_UNIT_WORDS = (
    "dollars", "dollar", "cents", "cent", "euros", "euro", "pounds", "units", "unit",
    "square units", "sq units", "degrees", "degree", "percent", "meters", "meter", "m", "cm",
    "mm", "km", "inches", "inch", "in", "feet", "foot", "ft", "yards", "yard", "miles", "mile",
    "mph", "hours", "hour", "hrs", "hr", "minutes", "minute", "min", "seconds", "second", "sec",
    "s", "days", "day", "weeks", "week", "months", "month", "years", "year", "grams", "gram",
    "g", "kg", "kilograms", "pounds", "lbs", "lb", "ounces", "oz", "liters", "liter", "l",
    "ml", "gallons", "gallon", "cups", "cup", "people", "students", "apples", "points", "times",
    "ways", "items", "pages", "books", "cookies", "marbles", "eggs", "tickets",
)
_TEXT_CMDS = ("\\text", "\\textbf", "\\textit", "\\mathrm", "\\mathbf", "\\mbox", "\\textrm",
              "\\operatorname")


def _unwrap_commands(s: str, commands: tuple[str, ...]) -> str:
  r"""Replaces `\cmd{x}` by `x` for each command (nested braces respected)."""
  for cmd in commands:
    out, i = [], 0
    while True:
      j = s.find(cmd + "{", i)
      if j < 0:
        out.append(s[i:])
        break
      out.append(s[i:j])
      got = _braced(s, j + len(cmd))
      if got is None:
        out.append(s[j:])
        break
      out.append(got[0])
      i = got[1]
    s = "".join(out)
  return s


def _strip_outer_boxed(s: str) -> str:
  r"""`\boxed{x}`, `\fbox{x}` and `{x}` (a group around the whole answer) -> x."""
  while True:
    m = re.match(r"^(?:\\(?:boxed|fbox)\s*)?\{", s)
    if not m:
      return s
    got = _braced(s, m.end() - 1)
    if got is None or got[1] != len(s):
      return s
    s = got[0].strip()


def _fix_latex_args(s: str) -> str:
  r"""\frac12 -> \frac{1}{2}, \frac1{x} -> \frac{1}{x}, \sqrt2 -> \sqrt{2}."""
  s = re.sub(r"\\sqrt\s*([0-9a-zA-Z])", r"\\sqrt{\1}", s)
  s = re.sub(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)
  s = re.sub(r"\\frac\s*([0-9a-zA-Z])\s*\{", r"\\frac{\1}{", s)
  s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*([0-9a-zA-Z])", r"\\frac\1{\2}", s)
  return s


def normalize_answer(text: str | None) -> str:
  """A canonical string form of an answer (see the module docstring); '' for None."""
  if text is None:
    return ""
  s = str(text).strip()
  s = s.replace("\u2212", "-").replace("\u00b0", "^\\circ")
  s = _strip_outer_boxed(s)
  s = s.replace("\\$", "").replace("$", "")
  s = _strip_outer_boxed(s.strip())
  s = _unwrap_commands(s, _TEXT_CMDS)
  s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])", "", s)
  s = re.sub(r"\\(?:displaystyle|limits)(?![a-zA-Z])", "", s)
  s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
  s = re.sub(r"\\[!,;:> ]", "", s)  # LaTeX spacing, incl. the `10,\!000` thousands style
  s = s.replace("{,}", ",").replace("~", " ")
  s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
  s = s.replace("\\circ", "")
  s = s.replace("\\%", "").replace("%", "")
  s = _strip_outer_boxed(s.strip())
  s = re.sub(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)\s*=\s*(?=\S)", "", s)  # `x = 5`, `\theta = ...`
  s = s.rstrip(".").strip()
  s = _strip_units(s)
  if _THOUSANDS.match(s):  # before spaces go: '1, 000' is a list, '1,000' a number
    s = s.replace(",", "")
  s = _fix_latex_args(s)
  s = re.sub(r"\s+", "", s)
  s = re.sub(r"^\(([A-E])\)$", r"\1", s)  # multiple choice `(C)`
  if re.fullmatch(r"\+\d.*", s):
    s = s[1:]
  return s


_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_MULTI_LETTER_UNITS = "|".join(
    re.escape(u) for u in sorted({u for u in _UNIT_WORDS if len(u) > 1}, key=len, reverse=True))
_ONE_LETTER_UNITS = "".join(sorted({u for u in _UNIT_WORDS if len(u) == 1}))
# Multi-letter units may follow the number directly ('5cm'); one-letter units need a space
# ('5 m'), so that an algebraic answer such as '2m' keeps its variable.
_UNIT_RE = re.compile(
    r"^(?P<num>.*?[0-9}])(?:\s*(?:" + _MULTI_LETTER_UNITS + r")|\s+[" + _ONE_LETTER_UNITS +
    r"])(?:\s*\^\s*\{?[23]\}?)?$", re.IGNORECASE)
_NUMBER_THEN_WORDS = re.compile(r"^(?P<num>-?[\d.,]+)\s+[a-zA-Z][a-zA-Z ]*$")  # '18 sheep'


def _strip_units(s: str) -> str:
  """Drops a trailing unit after a number ('18 dollars', '5cm', '10 cm^2', '7 sheep')."""
  m = _UNIT_RE.match(s)
  if m and _parse_number(re.sub(r"\s+", "", m.group("num")).replace(",", "")) is not None:
    return m.group("num").strip()
  m = _NUMBER_THEN_WORDS.match(s)
  if m:
    return m.group("num")
  return s


# ---- numbers ---------------------------------------------------------------------------------

_DECIMAL = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")
_SCI_TIMES = re.compile(r"^(?P<m>[+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:\\times|\\cdot|\*)10\^"
                        r"(?:\{(?P<e1>[+-]?\d+)\}|(?P<e2>[+-]?\d))$")


def _parse_number(s: str) -> Fraction | None:
  """An exact rational for a normalized number string, or None if it is not a number."""
  if not s:
    return None
  if _DECIMAL.match(s):
    try:
      return Fraction(s)
    except (ValueError, ZeroDivisionError):
      return None
  m = _SCI_TIMES.match(s)
  if m:
    return Fraction(m.group("m")) * Fraction(10) ** int(m.group("e1") or m.group("e2"))
  sign = 1
  body = s
  if body.startswith("-"):
    sign, body = -1, body[1:]
  elif body.startswith("+"):
    body = body[1:]
  m = re.fullmatch(r"(?:(\d+))?\\frac\{([^{}]+)\}\{([^{}]+)\}", body)
  if m:
    num, den = _parse_number(m.group(2)), _parse_number(m.group(3))
    if num is None or den is None or den == 0:
      return None
    whole = Fraction(int(m.group(1))) if m.group(1) else Fraction(0)
    frac = num / den
    if m.group(1) and frac < 0:
      return None
    return sign * (whole + frac)
  m = re.fullmatch(r"([+-]?[\d.]+)/([+-]?[\d.]+)", body)
  if m:
    num, den = _parse_number(m.group(1)), _parse_number(m.group(2))
    if num is None or den is None or den == 0:
      return None
    return sign * num / den
  return None


# ---- lists -----------------------------------------------------------------------------------

def _split_top_level(s: str) -> list[str]:
  parts, depth, cur, i = [], 0, [], 0
  while i < len(s):
    c = s[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    if c == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(c)
    i += 1
  parts.append("".join(cur))
  return parts


def _as_sequence(s: str) -> tuple[str, str, list[str]] | None:
  """(open, close, items) for `(a,b)`, `[a,b)`, `\\{a,b\\}` or `a,b`; None for one item."""
  if s.startswith("\\{") and s.endswith("\\}"):
    return "{", "}", _split_top_level(s[2:-2])
  if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
    inner = s[1:-1]
    if _balanced(inner):
      items = _split_top_level(inner)
      if len(items) >= 2:
        return s[0], s[-1], items
  items = _split_top_level(s)
  if len(items) >= 2:
    return "", "", items
  return None


def _balanced(s: str) -> bool:
  depth = 0
  for c in s:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth < 0:
        return False
  return depth == 0


def _atoms_match(a: str, b: str) -> bool:
  if a == b:
    return True
  x, y = _parse_number(a), _parse_number(b)
  return x is not None and y is not None and x == y


def _normalized_match(a: str, b: str) -> bool:
  if _atoms_match(a, b):
    return True
  sa, sb = _as_sequence(a), _as_sequence(b)
  if sa is None or sb is None:
    return False
  (oa, ca, ia), (ob, cb, ib) = sa, sb
  if (oa, ca) != (ob, cb) or len(ia) != len(ib):
    return False
  ia = [normalize_answer(x) for x in ia]
  ib = [normalize_answer(x) for x in ib]
  if oa in ("", "{"):  # unordered: solution lists and sets
    remaining = list(ib)
    for x in ia:
      hit = next((k for k, y in enumerate(remaining) if _normalized_match(x, y)), None)
      if hit is None:
        return False
      remaining.pop(hit)
    return True
  return all(_normalized_match(x, y) for x, y in zip(ia, ib))


def answers_match(pred: str | None, ref: str | None) -> bool:
  """Whether a predicted answer equals the reference answer (see the module docstring)."""
  if pred is None or ref is None:
    return False
  a, b = normalize_answer(pred), normalize_answer(ref)
  if not a or not b:
    return False
  return _normalized_match(a, b)
