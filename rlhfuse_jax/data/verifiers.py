"""Rule-based verifiers of math answers and format rewards, one sample at a time.

Each is `fn(response: str, answer: str | None, record: dict) -> float`: the decoded response
(up to its EOS), the sample's ground truth (record['target'], the dataset's answer column) and
the whole record. data/rewards.py turns them into batch reward functions (`per_sample`) that
name the function and the sample in every error.

  gsm8k          1.0 if the response's final number equals the answer's. The final number is
                 the first number after the last '####' when there is one (GSM8K's own answer
                 format), else the last number in the text; commas in thousands groups and a
                 leading '$' ('\\$', '€', '£') are ignored (a sign before it kept: -$15 is -15;
                 LaTeX's ',\\!', '{,}' and a thin space '\\,' between digit groups are commas),
                 a minus is '-' or U+2212, and numbers compare exactly as decimals (72 ==
                 72.0). An answer that holds no number, ends in a fraction, or has digits
                 glued to its final number ('1e3', '1.2.3', '3,5') is refused.
  math           1.0 if the response's last \\boxed{...} is mathematically equal to the answer,
                 as math-verify decides (sympy: 1/2 == 0.5 == \\dfrac12, x^2+1 == 1+x^2, sets,
                 intervals, equations x=2 vs 2). No \\boxed in the response: 0. The answer may be
                 bare LaTeX ('\\frac{1}{2}') or a MATH solution holding \\boxed{}.
  boxed_format   1.0 if the response holds a non-empty \\boxed{...} with balanced braces
  gsm8k_format   1.0 if the response ends with '#### <number>'
  think_format   1.0 if the response is '<think>...</think>' followed by a non-empty answer;
                 when the rendered prompt (record['_prompt_text']) already ends with '<think>'
                 (R1-distill and QwQ chat templates), '...</think>' and the answer

The GSM8K extraction is a regular expression written here: GSM8K answers are plain integers
(sometimes with thousands commas), and the benchmark's convention is exactly "the final number",
which math-verify's LaTeX-first extraction does not implement; equivalence of MATH answers is
left to math-verify, a maintained library (HF), not re-implemented.
"""
from __future__ import annotations

import decimal
import re
import threading
from typing import Any, Mapping, Optional

from rlhfuse_jax.data.records import PROMPT_TEXT_KEY

# A minus sign: ASCII '-' or U+2212 MINUS SIGN, which typeset text and some models write: read
# as no sign, U+2212 then 5 was the number 5, and scored right against an answer of 5.
_MINUS = "-\u2212"
# A number: thousands-grouped (1,234.5), plain (1234.5, -3) or a bare fraction part (.5). A
# group of more than three digits is no thousands group: "1,2345" is the numbers 1 and 2345
# (without the (?!\d), "1,234" matched and the 5 was lost: "1,234567" read as 1234).
_NUMBER = r"[" + _MINUS + r"]?(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
# A leading '$' may carry the sign before it ("-$15") or the number after it ("$-15"), with
# spaces after it. No two `\s*` may meet (nor one open a match): on a long run of whitespace,
# which a degenerate policy emits, each start re-scanned the run: quadratic, ~20 s per
# 16k-space response.
# '$' also as LaTeX's '\$', and '€' or '£': "-\$15" and "-€15" read as 15 (the sign lost).
_DOLLAR = r"(?:\\?\$|€|£)"
_CURRENCY = r"(?:([" + _MINUS + r"]\s*" + _DOLLAR + r"|" + _DOLLAR + r")\s*)?"
# Not inside a word ('x72', 'v1.5'): an ASCII letter, digit, '_' or '.' before it. Not `\w`,
# which holds every script's letters: Chinese and Japanese write no space before a number, and
# '共72个' read no number at all (a right answer scored 0).
_NUMBER_RE = re.compile(r"(?<![A-Za-z0-9_.])" + _CURRENCY + r"(" + _NUMBER + r")")
_GSM8K_FORMAT_RE = re.compile(r"####\s*" + _CURRENCY + _NUMBER + r"(?:\s*\.)?\s*$")
_THINK_RE = re.compile(r"\s*<think>.*?</think>\s*\S.*", re.S)
# The rest of a think block the prompt opened (R1-distill and QwQ chat templates end the
# generation prompt with '<think>\n', so the response starts inside the block).
_THINK_OPENED_RE = re.compile(r".*?</think>\s*\S.*", re.S)


# LaTeX's thin space between digit groups, '10\\,000' (read as 10 and 000: right answers 0, and
# '10\\,000' equal to an answer of 0).
_THIN_SPACE_GROUP_RE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")
# An ellipsis: "So the answer is...72" found no number ('.' before a number marks it as part of
# another, 'v1.5').
_ELLIPSIS_RE = re.compile(r"\.{2,}|\u2026")


def _latex_commas(text: str) -> str:
  """`text` with LaTeX's spellings of a thousands comma, ',\\!' (MATH's: '10,\\!000'), '{,}'
  and a thin space between digit groups ('10\\,000'), as a plain ','. Read as they were,
  '10,\\!000' was the numbers 10 and 000, a right answer 0."""
  return _THIN_SPACE_GROUP_RE.sub(",", text.replace(",\\!", ",").replace("{,}", ","))


def _final_match(text: str) -> Optional[re.Match]:
  """The match of final_number's number in `text` (its commas and ellipses normalised: the
  match's .string is what was searched), None if it has none."""
  text = _ELLIPSIS_RE.sub(" ", _latex_commas(text))
  if "####" in text:
    return _NUMBER_RE.search(text.rsplit("####", 1)[1])
  found = None
  for found in _NUMBER_RE.finditer(text):
    pass
  return found


def final_number(text: str) -> Optional[decimal.Decimal]:
  """The final number of a GSM8K-style text (see the module docstring); None if it has none."""
  found = _final_match(text)
  if found is None:
    return None
  value = decimal.Decimal(found.group(2).replace(",", "").replace("\u2212", "-"))
  return -value if (found.group(1) or "")[:1] in ("-", "\u2212") else value


def gsm8k(response: str, answer: Optional[str], record: Mapping[str, Any]) -> float:
  gold = final_number(_required(answer))
  if gold is None:
    raise ValueError(f"the answer {answer!r} holds no number (GSM8K answers end with "
                     "'#### <number>' or are a number)")
  pred = final_number(response)
  return float(pred is not None and pred == gold)


# LaTeX allows a space before the group ('\\boxed {72}', which read as no box).
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> Optional[str]:
  r"""The content of the last \boxed{...} (or \fbox{...}) with balanced braces, else None (a
  last box left open, a response cut at max_new_tokens, no longer hides a whole one before)."""
  # One pass with a stack of open braces (a scan from each box was quadratic in a degenerate
  # response of many open boxes).
  boxes = {m.end() - 1 for m in _BOX_RE.finditer(text)}  # their opening braces
  if not boxes:
    return None
  stack, best = [], None
  for i, c in enumerate(text):
    if c == "{":
      stack.append(i)
    elif c == "}" and stack:
      j = stack.pop()
      if j in boxes and (best is None or j > best[0]):
        best = (j, i)
  return None if best is None else text[best[0] + 1:best[1]]


def _timeout() -> Optional[int]:
  """math-verify bounds sympy with SIGALRM, which only the main thread may use; elsewhere it
  runs unbounded (its own advice for threaded callers)."""
  return 5 if threading.current_thread() is threading.main_thread() else None


def math_answer(response: str, answer: Optional[str], record: Mapping[str, Any]) -> float:
  import math_verify  # pylint: disable=import-outside-toplevel (sympy: ~0.5 s to import)
  # (math-verify reads '1\\,000' as 1*0: a thin space between digit groups is dropped first)
  answer = _THIN_SPACE_GROUP_RE.sub("", _required(answer))
  boxed = last_boxed(response)
  if boxed is None:
    return 0.0
  boxed = _THIN_SPACE_GROUP_RE.sub("", boxed)
  timeout = _timeout()
  # Only the last box is handed to math-verify: given the whole text it joins every \boxed{}
  # into one set ('\boxed{3} ... \boxed{4}' parses as {3, 4}), so a response that corrects
  # itself scored 0 and one that boxes several guesses could match a set answer.
  gold_boxed = last_boxed(answer) if "\\boxed" in answer else None
  gold = math_verify.parse(f"$\\boxed{{{gold_boxed}}}$" if gold_boxed is not None
                           else f"${answer}$", parsing_timeout=timeout)
  if not gold:
    raise ValueError(f"math-verify cannot parse the answer {answer!r}")
  pred = math_verify.parse(f"$\\boxed{{{boxed}}}$", extraction_config=[
      math_verify.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)],
      parsing_timeout=timeout)
  return float(bool(pred) and math_verify.verify(gold, pred, timeout_seconds=timeout))


def boxed_format(response: str, answer: Optional[str], record: Mapping[str, Any]) -> float:
  boxed = last_boxed(response)
  return float(boxed is not None and bool(boxed.strip()))


def gsm8k_format(response: str, answer: Optional[str], record: Mapping[str, Any]) -> float:
  return float(_GSM8K_FORMAT_RE.search(_latex_commas(response)) is not None)


def think_format(response: str, answer: Optional[str], record: Mapping[str, Any]) -> float:
  prompt = record.get(PROMPT_TEXT_KEY)
  opened = isinstance(prompt, str) and prompt.rstrip().endswith("<think>")
  return float((_THINK_OPENED_RE if opened else _THINK_RE).fullmatch(response) is not None)


def _required(answer: Optional[str]) -> str:
  if not isinstance(answer, str):
    raise ValueError(f"needs the sample's answer as a string (record['target'], from "
                     f"config.data.answer_key), got {type(answer).__name__}")
  return answer


VERIFIERS = {"gsm8k": gsm8k, "math": math_answer, "boxed_format": boxed_format,
             "gsm8k_format": gsm8k_format, "think_format": think_format}
# The verifiers that read the answer: a dataset without one cannot train with them.
NEEDS_ANSWER = frozenset({"gsm8k", "math"})


# Digits glued to the final number that it does not read: '1e3' read as 1, '1.2.3' as 1.2,
# '3,5' (a decimal comma) as 5, each the gold answer that responses were scored against.
_GLUED_AFTER_RE = re.compile(r"[eE][+" + _MINUS + r"]?\d|[.,]\d")
_GLUED_BEFORE_RE = re.compile(r"\d[.,]$")


def _check_gsm8k_answer(answer: str) -> None:
  found = _final_match(answer)
  if found is None:
    raise ValueError(f"the answer {answer!r} holds no number (GSM8K answers end with "
                     "'#### <number>' or are a number)")
  if (_GLUED_AFTER_RE.match(found.string, found.end()) or
      _GLUED_BEFORE_RE.search(found.string[:found.start()])):
    raise ValueError(f"the answer {answer!r} reads as the number {final_number(answer)}, with "
                     "digits around it that gsm8k does not read (an exponent, a second decimal "
                     "point or a decimal comma); expected a plain number such as 1234.5 or "
                     "1,234.5")
  # (gsm8k reads the final number alone: '3/4' was 4, and 'answer 1/4' scored right)
  if re.search(r"\d\s*/\s*[" + _MINUS + r"]?\d+(?:\.\d+)?\s*\.?\s*$",
               answer.rsplit("####", 1)[-1]):
    raise ValueError(f"the answer {answer!r} is a fraction, of which gsm8k reads the final "
                     "number alone; expected a number (or the 'math' verifier, which compares "
                     "fractions)")


def _check_math_answer(answer: str) -> None:
  # (math-verify reads an unbalanced answer as its raw text, which no response equals: every
  # response scored 0, without a word; a full parse needs sympy, too slow for every row)
  depth, i = 0, 0
  while i < len(answer) and depth >= 0:
    if answer[i] == "\\":  # a backslash escapes the next character: \{ is a literal brace,
      i += 2               # \\ a line break (and a '{' after it opens a group)
      continue
    depth += {"{": 1, "}": -1}.get(answer[i], 0)
    i += 1
  if depth:
    raise ValueError(f"the answer {answer!r} has unbalanced braces; expected a LaTeX answer "
                     "(e.g. '\\frac{1}{2}', '\\boxed{72}')")


# What the run checks of each row's answer when it loads the prompts, for the verifiers that
# read one: a row whose answer they cannot read stopped the run mid-training, when it was
# first drawn (hours in, on a full dataset), or scored every response 0.
ANSWER_CHECKS = {"gsm8k": _check_gsm8k_answer, "math": _check_math_answer}
