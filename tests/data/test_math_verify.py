r"""Answer extraction and matching on the answer formats of GSM8K and MATH.

Each row is (model answer, reference answer, expected match). References are written as the
datasets write them (GSM8K: `#### 72` -> '72'; MATH: the content of \boxed{...}).
"""

import pytest

from rlx.data.math_verify import answers_match, extract_answer, last_boxed, normalize_answer

MATCH_CASES = [
    # --- GSM8K-style integers, money, units, thousands separators
    ("72", "72", True),
    ("72.0", "72", True),
    ("72.00", "72", True),
    ("1,000", "1000", True),
    ("1000", "1,000", True),
    ("\\$18", "18", True),
    ("$18.00", "18", True),
    ("18 dollars", "18", True),
    ("5 cm", "5", True),
    ("5cm", "5", True),
    ("7 sheep", "7", True),
    ("3", "-3", False),
    ("-3", "-3", True),
    ("\u22123", "-3", True),  # unicode minus
    ("+5", "5", True),
    ("12", "1,2", False),  # '1,2' is a list (1, 2), not a thousands separator
    ("1, 000", "1000", False),  # a space after the comma: a list
    ("71", "72", False),
    ("100.0001", "100", False),
    ("50\\%", "50", True),
    ("50%", "0.5", False),  # the percent sign is dropped, not applied
    ("1e3", "1000", True),
    ("1.5\\times10^{3}", "1500", True),
    # --- MATH-style fractions and decimals
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\frac{1}{2}", True),
    ("1/2", "\\dfrac{1}{2}", True),
    ("\\dfrac12", "\\frac{1}{2}", True),
    ("\\tfrac{3}{4}", "0.75", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),
    ("-\\frac{1}{2}", "\\frac{-1}{2}", True),
    ("-0.5", "-\\frac12", True),
    ("\\frac{1}{2}", "-\\frac{1}{2}", False),
    ("0.33", "\\frac{1}{3}", False),  # a rounded decimal is not the exact answer
    ("\\frac{14}{3}", "4\\frac{2}{3}", True),  # MATH's mixed numbers
    ("\\frac{1}{0}", "0", False),
    # --- LaTeX wrappers
    ("\\boxed{7}", "7", True),
    ("$\\boxed{7}$", "7", True),
    ("7.", "7", True),
    ("\\text{Monday}", "Monday", True),
    ("\\textbf{(C)}", "\\text{(C)}", True),
    ("30^\\circ", "30", True),
    ("90", "{90^\\circ}", True),
    ("30^{\\circ}", "30", True),
    ("10\\text{ cm}^2", "10", True),
    ("10,\\!000", "10000", True),
    ("10{,}000", "10000", True),
    ("x = 5", "5", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    # --- sqrt, pi and other symbolic forms: normalized strings
    ("\\sqrt2", "\\sqrt{2}", True),
    ("2\\sqrt{3}", "2 \\sqrt 3", True),
    ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", False),  # no symbolic algebra
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("2\\pi", "2 \\pi", True),
    ("2m", "2", False),  # a one-letter 'unit' glued to a number is a variable
    ("\\infty", "\\infty", True),
    # --- tuples, intervals, solution lists, sets
    ("(1, 2)", "(1,2)", True),
    ("(1,2)", "(2,1)", False),  # a point: order matters
    ("(1,2)", "[1,2)", False),  # an interval: brackets matter
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("(0.5, 2)", "\\left(\\frac{1}{2}, 2\\right)", True),  # elementwise numeric
    ("1, 2", "2,1", True),  # MATH 'enter all solutions': order-free
    ("-2, 1", "1, -2", True),
    ("1, 2", "1, 3", False),
    ("1, 2", "(1, 2)", False),
    ("\\{1,2\\}", "\\{2, 1\\}", True),
    # --- nothing to compare
    (None, "5", False),
    ("", "5", False),
]


@pytest.mark.parametrize("pred, ref, expected", MATCH_CASES)
def test_answers_match(pred, ref, expected):
  assert answers_match(pred, ref) is expected, (normalize_answer(pred), normalize_answer(ref))


def test_there_are_enough_cases():
  assert len(MATCH_CASES) >= 40
  assert sum(1 for *_, e in MATCH_CASES if not e) >= 15


EXTRACT_CASES = [
    # GSM8K reference solution format
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
     "clips altogether in April and May.\n#### 72", "72"),
    ("So she pays $1,200.\n#### 1,200", "1,200"),
    # MATH solution format: the last \boxed, nested braces intact
    ("First $\\boxed{1}$ is wrong; so $a+b=\\boxed{\\frac{14}{3}}$.", "\\frac{14}{3}"),
    ("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("We get $\\boxed{\\frac{a}{\\sqrt{b+{c}}}}$", "\\frac{a}{\\sqrt{b+{c}}}"),
    ("so the answer is $\\fbox{5}$", "5"),
    ("so $\\boxed 5$.", "5"),
    ("unclosed \\boxed{3 but #### 4", "4"),  # an unclosed box is skipped
    # "The answer is x"
    ("The answer is $\\frac{1}{2}$.", "$\\frac{1}{2}$"),
    ("So the final answer is: 3.5. Hope that helps", "3.5"),
    ("I think the answer is 12\nand more text 99", "12"),
    # the last number
    ("She has 3 apples and buys 1,000 more.", "1,000"),
    ("3-2 = 1 and then -4 more", "-4"),
    ("half, i.e. 1/2", "1/2"),
    ("no number here", None),
    ("", None),
]


@pytest.mark.parametrize("completion, expected", EXTRACT_CASES)
def test_extract_answer(completion, expected):
  assert extract_answer(completion) == expected


def test_extract_then_match_end_to_end():
  completion = "Janet sells 16 - 3 - 4 = 9 eggs for $2 each, so she makes \\boxed{\\$18}."
  assert answers_match(extract_answer(completion), "18")
  assert not answers_match(extract_answer("She makes \\boxed{17}, not 18."), "18")


def test_last_boxed_takes_the_last_one():
  assert last_boxed("\\boxed{1} and \\boxed{{2}+{3}}") == "{2}+{3}"
  assert last_boxed("nothing") is None
