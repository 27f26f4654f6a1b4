"""Math verifiers (GSM8K final number, MATH boxed answers through math-verify), format rewards,
user functions by import path, and errors that name the function and the sample."""
import concurrent.futures
import functools
import os
import re
import time

import numpy as np
import pytest

from rlhfuse_jax.data import rewards as rewards_lib
from rlhfuse_jax.data import verifiers
from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.inference.scoring import RewardTerm, Rewards
from rlhfuse_jax.models import llama
from rlhfuse_jax.trainer import build
from tests.test_trainer import tiny_config

CHAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_chat")
GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
                  "<<48+24=72>>72 clips altogether in April and May.\n#### 72")


# ------------------------------------------------------------ user functions for the tests
def answer_length(response, answer, record):
  """A user reward by import path ('tests.test_rewards:answer_length'): the response's length
  in characters over 100, so that scores differ between responses."""
  return len(response) / 100.0


def broken(response, answer, record):
  return 1.0 / 0.0 if record.get("id") == 2 else 0.5


def not_a_number(response, answer, record):
  return "high"


NOT_CALLABLE = 3


def two_args(response, answer):
  return 0.0


def with_defaults(response, answer=None, record=None, *, scale=1.0):
  return scale * len(response)


def half_missing(response, answer, record):
  """A statistic with no value for some responses ('tests.test_rewards:half_missing')."""
  return float("nan") if record.get("id") == 1 else len(response) / 100.0


def none_missing(response, answer, record):
  """half_missing with None for "no value"."""
  return None if record.get("id") == 1 else len(response) / 100.0


def overflows(response, answer, record):
  return 1e39 if record.get("id") == 1 else 0.5


def huge_int(response, answer, record):
  return 10 ** 400


def overlong(response, answer, record, num_tokens, max_tokens=8, cache=4):
  """DAPO's overlong penalty (a reward.format term): 0 up to max_tokens - cache tokens, then
  falling linearly to -1 at max_tokens, -1 beyond ('tests.test_rewards:overlong')."""
  return max(-1.0, min(0.0, (max_tokens - cache - num_tokens) / cache))


def batch_tokens(responses, answers, records, *, num_tokens):
  """A batched function of the token counts ('tests.test_rewards:batch_tokens')."""
  return [float(n) for n in num_tokens]


batch_tokens.batched = True

CALLS = []


def batch_lengths(responses, answers, records):
  """A batched user reward ('tests.test_rewards:batch_lengths'): called once per batch."""
  CALLS.append((list(responses), list(answers), [r.get("id") for r in records]))
  return [len(r) / 100.0 if a != "bad" else float("nan") for r, a in zip(responses, answers)]


batch_lengths.batched = True


def batch_short(responses, answers, records):
  return [0.0] * (len(responses) - 1)


batch_short.batched = True


def batch_pool(responses, answers, records):
  """What a verifier pool returns: concurrent.futures' Executor.map, an iterator."""
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    return pool.map(lambda r, a: float("nan") if a == 19 else len(r) / 100.0, responses, answers)


batch_pool.batched = True


def batch_scaled(responses, answers, records, scale=1.0):
  """A batched function whose keyword a user binds ('tests.test_rewards:batch_half')."""
  return [scale * len(r) for r in responses]


batch_scaled.batched = True
batch_half = functools.partial(batch_scaled, scale=0.5)  # no `batched` of its own


# ------------------------------------------------------------ the verifiers, text in
@pytest.mark.parametrize("response, score", [
    ("She sold 24 in May, 72 in all.", 1.0),  # the last number
    ("72 clips, then 3 more", 0.0),  # the last number is 3
    ("#### 72", 1.0), ("so #### $72.", 1.0), ("#### 72 and then 5", 1.0),  # after the last ####
    ("The answer is 72.0", 1.0), ("-72", 0.0), ("720", 0.0), ("7,2", 0.0),
    ("no number at all", 0.0), ("", 0.0), ("x72", 0.0),
    # Exact decimal equality, not closeness: a near miss scores 0, trailing zeros do not count.
    ("#### 72.5", 0.0), ("#### 71.99", 0.0), ("#### 72.000", 1.0),
])
def test_gsm8k_final_number(response, score):
  assert verifiers.gsm8k(response, GSM8K_SOLUTION, {}) == score
  assert verifiers.gsm8k(response, "72", {}) == score  # a bare number as the answer


@pytest.mark.parametrize("text, number", [
    ("the change is -$15.", -15), ("the change is $-15.", -15), ("- $ 15", -15), ("$15", 15),
    ("-15", -15), ("x-15", 15), ("5-$3", 3), ("#### -$1,000.5", -1000.5)])
def test_the_sign_before_a_dollar_sign_is_kept(text, number):
  """'-$15' is -15 (the '-' sat inside the number's group, after '$?', so it read as 15); a '-'
  joined to a word before it is a hyphen, as before."""
  assert verifiers.final_number(text) == number


@pytest.mark.parametrize("text, number", [
    ("所以她一共卖了72个。", 72), ("答案是 -5", -5), ("答えは１２です", 12), ("x72", None),
    ("v1.5", None), ("10-3", 3)])
def test_a_number_right_after_a_cjk_character_is_read(text, number):
  """Chinese and Japanese write no space before a number: a lookbehind of `\\w` (every
  script's letters) read no number in '共72个', so a right answer in Chinese scored 0. Inside an
  ASCII word ('x72', 'v1.5') a number is still none, and a '-' after a digit a hyphen."""
  assert verifiers.final_number(text) == number
  assert verifiers.gsm8k("所以她一共卖了72个。", "#### 72", {}) == 1.0


@pytest.mark.parametrize("text, number", [
    ("so $\\boxed{10,\\!000}$", 10000), ("#### 1,\\!234,\\!567.5", 1234567.5),
    ("$1{,}250$ in all", 1250), ("-$2{,}000", -2000)])
def test_latex_thousands_commas_are_commas(text, number):
  """MATH-trained models write thousands as '10,\\!000' or '10{,}000': read as they were, the
  final number was 000 (or 10 after '####'), and a right answer scored 0."""
  assert verifiers.final_number(text) == number
  assert verifiers.gsm8k("so the total is $10,\\!000$.", "#### 10,000", {}) == 1.0
  assert verifiers.gsm8k_format("#### 10{,}000", None, {}) == 1.0


@pytest.mark.parametrize("text, number", [
    ("so 10\\,000 in all", 10000), ("#### 10\\,000", 10000), ("-\\$15", -15),
    ("\\$15", 15), ("The loss is -\u20ac15", -15), ("costs \u00a320.", 20),
    ("So the answer is...72", 72), ("Total:\u202672", 72), ("v1.5", None),
    ("3\\,\\text{cm}", 3), ("1\\,2345", 2345)])
def test_thin_spaces_escaped_and_other_currencies_and_ellipses(text, number):
  """LaTeX's thin space between digit groups ('10\\,000' read as 10 and 000: right answers 0,
  and equal to an answer of 0); LaTeX's escaped '\\$', '\u20ac' and '\u00a3' keep the sign before
  them (read as 15); a number after an ellipsis is read (none was). A thin space elsewhere, and
  a number inside a version string, read as before."""
  assert verifiers.final_number(text) == number
  assert verifiers.gsm8k("so 10\\,000 in all", "0", {}) == 0.0
  assert verifiers.gsm8k_format("#### \\$15", None, {}) == 1.0
  assert verifiers.math_answer("\\boxed{1\\,000}", "1000", {}) == 1.0
  assert verifiers.math_answer("\\boxed{1\\,000}", "0", {}) == 0.0


@pytest.mark.parametrize("text, number", [
    ("it fell to \u22125 degrees", -5), ("#### \u2212$1,000", -1000), ("$\u22122.5", -2.5),
    ("10\u22123", 3)])
def test_a_unicode_minus_sign_is_a_sign(text, number):
  """U+2212, the minus sign of typeset text, read as no sign: '\u22125' was 5 and scored 1
  against an answer of 5 (and 0 against -5)."""
  assert verifiers.final_number(text) == number
  assert verifiers.gsm8k("it fell to \u22125 degrees", "#### 5", {}) == 0.0
  assert verifiers.gsm8k("it fell to \u22125 degrees", "#### -5", {}) == 1.0
  assert verifiers.gsm8k_format("so #### \u22125", None, {}) == 1.0


@pytest.mark.parametrize("response, score", [
    ("#### -$15", 1.0), ("#### $-15", 1.0), ("#### -15", 1.0), ("#### --15", 0.0)])
def test_gsm8k_format_takes_a_sign_before_the_dollar(response, score):
  assert verifiers.gsm8k_format(response, None, {}) == score


@pytest.mark.parametrize("response", [
    "1" + " " * 5000 + "x", "1" + "\n" * 5000, "####" + " " * 5000 + "x",
    "#### 1" + " " * 5000 + "x", "-" + " " * 5000 + "x"],
    ids=["spaces", "newlines", "hashes", "format", "minus"])
def test_gsm8k_rewards_are_linear_in_a_whitespace_run(response):
  """A degenerate policy emits long runs of spaces or newlines; two `\\s*` that met in the
  number and format patterns (or one opening a match) re-scanned the run from each start:
  ~1.5 s per 5000 spaces, 20 s per 16000, for every such sample of every batch."""
  start = time.thread_time()  # this thread's CPU time: a stall of the machine is not counted
  verifiers.gsm8k(response, "1", {}), verifiers.gsm8k_format(response, None, {})
  assert time.thread_time() - start < 0.2


@pytest.mark.parametrize("response, score", [
    ("2 plus 3 is 5.\n</think>\n\nThe answer is 5.", 1.0),
    ("2 plus 3 is 5.\n</think>\n", 0.0),  # no answer after the block
    ("The answer is 5.", 0.0),  # the block never closed
])
def test_think_format_when_the_prompt_opened_the_block(response, score):
  """R1-distill and QwQ chat templates end the generation prompt with '<think>\\n': the response
  starts inside the block (it scored 0 for every such response)."""
  record = {"_prompt_text": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
                            "<think>\n"}
  assert verifiers.think_format(response, None, record) == score
  assert verifiers.think_format("<think>add</think> 5", None, {"_prompt_text": "Q: 2+3?"}) == 1.0
  assert verifiers.think_format(response, None, {"_prompt_text": "Q: 2+3?"}) == 0.0


def test_gsm8k_numbers_commas_and_bad_answers():
  assert verifiers.final_number("in total $1,234,567.50 dollars") == verifiers.final_number(
      "1234567.5")
  assert verifiers.final_number("3, 4, 5") == 5 and verifiers.final_number(".5 of it") == 0.5
  assert verifiers.gsm8k("The answer is 1,000", "#### 1000", {}) == 1.0
  # Malformed groups lose no digits: the last number of "1,2345" is 2345, not 1234.
  assert verifiers.final_number("the total is 1,2345") == 2345
  assert verifiers.final_number("about 12,3456") == 3456
  assert verifiers.gsm8k("so 1,234567 items", "#### 1234", {}) == 0.0
  assert verifiers.gsm8k("#### 1,234", "#### 1234", {}) == 1.0
  with pytest.raises(ValueError, match="the answer 'many' holds no number"):
    verifiers.gsm8k("72", "many", {})
  with pytest.raises(ValueError, match=r"needs the sample's answer as a string \(record"):
    verifiers.gsm8k("72", None, {})


@pytest.mark.parametrize("answer, response, score", [
    ("\\frac{1}{2}", "so the answer is \\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\dfrac12}", 1.0),
    ("0.5", "$\\boxed{\\frac{1}{2}}$", 1.0),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt3}{2}}", 1.0),
    ("x^2+1", "we get \\boxed{1+x^2}", 1.0),
    ("x=2", "\\boxed{2}", 1.0),
    ("(1,2)", "\\boxed{(1, 2)}", 1.0),
    ("\\text{Monday}", "\\boxed{\\text{Monday}}", 1.0),
    ("The area is $\\boxed{12}$.", "\\boxed{12}", 1.0),  # a MATH solution as the answer
    ("3", "\\boxed{3} at first, but \\boxed{4}", 0.0),  # the last box counts
    ("4", "\\boxed{3} at first, but \\boxed{4}", 1.0),  # ... and only it (not the set {3, 4})
    ("4", "first \\boxed{3}. Wait, actually the answer is \\boxed{4}", 1.0),
    ("3, 4", "maybe \\boxed{3}? no: \\boxed{4}", 0.0),  # two guesses are not a set answer
    ("Try $\\boxed{5}$; no, $\\boxed{12}$.", "\\boxed{12}", 1.0),  # a solution's last box
    ("3", "\\boxed{-3}", 0.0),
    ("\\pi", "\\boxed{3.14159}", 0.0),
    ("72", "The final answer is $72$", 0.0),  # no \boxed: MATH answers are boxed
    ("72", "\\boxed{}", 0.0),
    ("72", "\\boxed{72", 0.0),  # unbalanced
])
def test_math_boxed_answers(answer, response, score):
  assert verifiers.math_answer(response, answer, {}) == score


def test_math_unparseable_answer_is_an_error():
  with pytest.raises(ValueError, match="math-verify cannot parse the answer ''"):
    verifiers.math_answer("\\boxed{1}", "", {})


@pytest.mark.parametrize("fn, response, score", [
    (verifiers.boxed_format, "so \\boxed{x+1}.", 1.0),
    (verifiers.boxed_format, "\\boxed{ }", 0.0),
    (verifiers.boxed_format, "\\boxed{\\frac{1}{2}", 0.0),
    (verifiers.boxed_format, "72", 0.0),
    (verifiers.gsm8k_format, "work...\n#### 72", 1.0),
    (verifiers.gsm8k_format, "#### 1,000.", 1.0),
    (verifiers.gsm8k_format, "#### 72 apples", 0.0),
    (verifiers.gsm8k_format, "72", 0.0),
    (verifiers.think_format, "<think>add them</think> 72", 1.0),
    (verifiers.think_format, "<think>\na\nb\n</think>\n\\boxed{3}", 1.0),
    (verifiers.think_format, "<think>add them</think>", 0.0),
    (verifiers.think_format, "72 <think>late</think> 3", 0.0),
])
def test_format_rewards(fn, response, score):
  assert fn(response, None, {}) == score


def test_last_boxed():
  assert verifiers.last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
  assert verifiers.last_boxed("\\fbox{7}") == "7"
  assert verifiers.last_boxed("\\boxed{{x}") is None and verifiers.last_boxed("none") is None
  # A space before the group is LaTeX; a last box left open (a response cut short) no longer
  # hides a whole one before it.
  assert verifiers.last_boxed("so \\boxed {72}") == "72"
  assert verifiers.last_boxed("x \\boxed{72} and then \\boxed{") == "72"
  assert verifiers.boxed_format("x \\boxed{72} and then \\boxed{", None, {}) == 1.0


# ------------------------------------------------------------ batch functions, ids in
@pytest.fixture(scope="module")
def tok():
  return HFTokenizer.from_file(os.path.join(CHAT, "chatml"))


def _batch(tok, texts, stop=True, width=40):
  """[B, T] ids of each text (+ EOS when stop) and [B] lengths, padded with PAD."""
  rows = [tok.encode(t, add_bos=False) + ([tok.eos_id] if stop else []) for t in texts]
  ids = np.full((len(rows), width), tok.pad_id, np.int32)
  for i, r in enumerate(rows):
    ids[i, :len(r)] = r
  return ids, np.array([len(r) for r in rows], np.int32)


def test_a_batched_array_of_texts_or_nones_is_refused_as_a_list_of_them_is(tok):
  """np.array(["1", "0.5"]) passed (numpy read the texts as numbers), where ["1", "0.5"] is
  refused; an object array's None was reported as a nan."""
  ids, lens = _batch(tok, ["1", "2"])
  for values, shown in ((np.array(["1", "0.5"]), "'1'"),
                        (np.array([1.0, None], dtype=object), "None")):
    fn = lambda responses, answers, records, values=values: values
    fn.batched = True
    with pytest.raises(rewards_lib.RewardFunctionError,
                       match=rf"returned {shown} for sample \d .*expected one number per "):
      rewards_lib.per_batch(fn, "b")(None, ids, lens, tok)


def test_a_decimal_is_a_number(tok):
  """A function that computes with decimal.Decimal (as gsm8k's final_number does) may return
  one: per sample it was refused as "not a finite number", batched it passed; a NaN one is
  refused as any NaN."""
  import decimal
  ids, lens = _batch(tok, ["1", "2"])
  half = lambda response, answer, record: decimal.Decimal("0.5")
  np.testing.assert_array_equal(rewards_lib.per_sample(half, "d")(None, ids, lens, tok),
                                [0.5, 0.5])
  for nan in ("NaN", "sNaN"):
    with pytest.raises(rewards_lib.RewardFunctionError, match=r"returned nan for sample 0"):
      rewards_lib.per_sample(lambda *_: decimal.Decimal(nan), "d")(None, ids, lens, tok)


def test_a_function_that_changes_its_record_leaves_the_pool_as_it_was(tok):
  """The records a function gets are copies: one that changed its record (an answer
  "normalised" in place, a counter) changed the prompt pool's for every later draw, which a
  resumed run, reading the file again, did not have."""
  pool = [{"target": " 1 ", "prompt": [{"role": "user", "content": "1?"}]},
          {"target": "2", "prompt": [{"role": "user", "content": "2?"}]}]

  def normalise(response, answer, record):
    record["target"] = answer.strip() + "0"
    record["prompt"][0]["content"] = ""
    return 0.0

  def batched(responses, answers, records):
    return [normalise(r, a, rec) for r, a, rec in zip(responses, answers, records)]
  batched.batched = True
  ids, lens = _batch(tok, ["1", "2"])
  for fn in (rewards_lib.per_sample(normalise, "n"), rewards_lib.per_batch(batched, "b")):
    fn(pool, ids, lens, tok)
    fn(pool, ids, lens, tok)
  assert [r["target"] for r in pool] == [" 1 ", "2"]
  assert [r["prompt"][0]["content"] for r in pool] == ["1?", "2?"]


def test_a_prompt_s_samples_share_one_copy_of_its_record(tok):
  """The copies keep the batch's identities: a prompt's samples_per_prompt rows hold the same
  record (trainer/loop.py), and a function that groups them by identity found them; with a copy
  per row every sample was a group of one. Each record is still copied (the pool unchanged)."""
  first, second = {"target": "1", "prompt": "1?"}, {"target": "2", "prompt": "2?"}
  records = [first, first, second, second]
  seen = []

  def batched(responses, answers, recs):
    seen.append(recs)
    return [0.0] * len(responses)
  batched.batched = True

  def one(response, answer, record):
    seen.append(record)
    return 0.0
  ids, lens = _batch(tok, ["1", "1", "2", "2"])
  rewards_lib.per_batch(batched, "b")(records, ids, lens, tok)
  recs = seen.pop()
  assert recs[0] is recs[1] and recs[2] is recs[3] and recs[1] is not recs[2]
  assert recs[0] == first and recs[0] is not first and recs[2] is not second
  rewards_lib.per_sample(one, "s")(records, ids, lens, tok)
  assert seen[0] is seen[1] and seen[2] is seen[3] and seen[1] is not seen[2]
  assert seen[0] is not first and seen[2] is not second


def test_decode_responses_stops_at_eos_and_marks_foreign_ids(tok):
  ids, lens = _batch(tok, ["so #### 72", "7"], stop=True)
  ids[0, lens[0]:lens[0] + 3] = tok.encode(" 5", add_bos=False)[0]  # after EOS: ignored
  assert rewards_lib.decode_responses(ids, lens + 3, tok) == ["so #### 72", "7"]
  ids[1, 1], ids[1, 2], lens[1] = tok.vocab_size + 5, tok.encode("2", add_bos=False)[0], 3
  text = rewards_lib.decode_responses(ids, lens, tok)[1]
  assert text == "7\ufffd2"  # never '72'
  assert verifiers.gsm8k(text, "72", {}) == 0.0


def test_the_first_id_past_the_vocabulary_also_splits_the_text(tok):
  """A model's embedding padded past the vocabulary can sample id vocab_size itself, the first
  id decoding cannot read: it marks the text as any foreign id does ('7', foreign, '2' is not
  72), while the last id of the vocabulary, vocab_size - 1, decodes as itself."""
  ids, lens = _batch(tok, ["7"], stop=False)
  ids[0, 1], ids[0, 2], lens[0] = tok.vocab_size, tok.encode("2", add_bos=False)[0], 3
  assert rewards_lib.decode_responses(ids, lens, tok) == ["7\ufffd2"]
  ids[0, 1] = tok.vocab_size - 1
  assert "\ufffd" not in rewards_lib.decode_responses(ids, lens, tok)[0]


def test_a_special_token_between_digits_does_not_join_them(tok):
  """decode(skip_special_tokens=True) drops special tokens the vocabulary knows (<|im_start|>)
  and joined the text around them: '7', <|im_start|>, '2' read as 72, a reward a policy could
  learn to collect. They now split the text as ids outside the vocabulary do."""
  start = tok.token_to_id("<|im_start|>")
  assert start in tok.special_ids and tok.token_to_id("a") not in tok.special_ids
  ids, lens = _batch(tok, ["so 7"], stop=False)
  ids[0, lens[0]], ids[0, lens[0] + 1] = start, tok.encode("2", add_bos=False)[0]
  ids[0, lens[0] + 2] = tok.eos_id
  text = rewards_lib.decode_responses(ids, lens + 3, tok)[0]
  assert text == "so 7\ufffd2"
  assert rewards_lib.REWARD_FUNCTIONS["gsm8k"]([{"target": "#### 72"}], ids, lens + 3, tok) == 0


def test_a_response_ends_at_the_first_of_any_stop_id(tok):
  """Qwen2.5 Instruct's generation_config ends a turn on <|im_end|> or <|endoftext|>: the
  functions read a response up to whichever comes first, and count it as stopped."""
  qwen = HFTokenizer(tok.backend, eos_id=tok.eos_id, pad_id=tok.pad_id,
                     extra_eos_ids=[tok.token_to_id("<|endoftext|>")])
  ids, lens = _batch(tok, ["so #### 72", "7"], stop=False)
  end = qwen.token_to_id("<|endoftext|>")
  ids[0, lens[0]], ids[0, lens[0] + 1:lens[0] + 3] = end, tok.encode("5", add_bos=False)[0]
  lens[0] += 3
  assert rewards_lib.decode_responses(ids, lens, qwen) == ["so #### 72", "7"]
  assert rewards_lib.decode_responses(ids, lens, tok)[0] != "so #### 72"  # one EOS: runs on
  rlen, stopped = rewards_lib.response_extent(ids, lens, qwen.stop_ids)
  assert rlen.tolist() == [lens[0] - 2, lens[1]] and stopped.tolist() == [True, False]


def test_a_target_reached_through_another_stop_id_scores_full_marks(tok):
  """The targets end in eos_id; a response that stops on another of the tokenizer's stop ids
  (Qwen's <|endoftext|> beside <|im_end|>) has reached its end as well: target_match gave the
  right answer 2/3 where length_match and exact_match gave 1."""
  end = tok.token_to_id("<|endoftext|>")
  qwen = HFTokenizer(tok.backend, eos_id=tok.eos_id, pad_id=tok.pad_id, extra_eos_ids=[end])
  ids, lens = _batch(tok, ["7 2", "7 2", "7"])
  ids[1, lens[1] - 1] = end  # the same answer, stopped on the other id
  records = [{"target": "7 2"}] * 3
  for name in ("target_match", "length_match", "exact_match"):
    got = rewards_lib.REWARD_FUNCTIONS[name](records, ids, lens, qwen)
    assert got[0] == got[1] == 1 and got[2] < 1, (name, got)
  # With one stop id the other is a token like any: no end, no full marks.
  assert rewards_lib.target_match(records, ids, lens, tok)[1] < 1


def test_registered_verifiers_score_token_batches(tok):
  texts = ["She sold 72 clips.", "#### 71", "The answer is \\boxed{72}", "no idea"]
  ids, lens = _batch(tok, texts)
  records = [{"target": GSM8K_SOLUTION}] * 4
  gsm8k = rewards_lib.get_reward_function("gsm8k")
  np.testing.assert_array_equal(gsm8k(records, ids, lens, tok), [1, 0, 1, 0])
  math = rewards_lib.get_reward_function("math")
  np.testing.assert_array_equal(math([{"target": "72"}] * 4, ids, lens, tok), [0, 0, 1, 0])
  # Without an EOS (cut at max_new_tokens) the whole row is the response.
  ids2, lens2 = _batch(tok, texts, stop=False)
  np.testing.assert_array_equal(gsm8k(records, ids2, lens2, tok), [1, 0, 1, 0])


def test_config_combines_a_verifier_and_a_weighted_format_reward(tok):
  """reward.function='gsm8k', reward.format='gsm8k_format', weight 0.25: gsm8k + 0.25 *
  format, per sample, through the trainer's Rewards."""
  cfg = tiny_config(**{"reward.function": "gsm8k", "reward.format": "gsm8k_format",
                       "reward.format_weight": 0.25})
  rewards = build.build_rewards(cfg, None, tok, None, None)
  assert (rewards.name, [(t.label, t.name, t.weight) for t in rewards.extra]) == (
      "gsm8k", [("format", "gsm8k_format", 0.25)])
  ids, lens = _batch(tok, ["work\n#### 72", "72", "#### 5", "five"])
  out, metrics = rewards.combine([{"target": "#### 72"}] * 4, ids, lens)
  np.testing.assert_allclose(out, [1.25, 1.0, 0.25, 0.0])
  # Each term's unweighted batch mean: 2 of 4 right, 2 of 4 in the format.
  assert metrics == {"reward/function_mean": 0.5, "reward/format_mean": 0.5}
  # One term alone: no per-term metrics (reward/mean is that term's).
  alone = build.build_rewards(tiny_config(**{"reward.function": "gsm8k"}), None, tok, None, None)
  assert alone.combine([{"target": "#### 72"}] * 4, ids, lens)[1] == {}


def test_user_function_by_import_path(tok):
  fn = rewards_lib.get_reward_function("tests.test_rewards:answer_length")
  texts = ["a", "abc def", ""]
  ids, lens = _batch(tok, texts)
  np.testing.assert_allclose(fn([{}] * 3, ids, lens, tok), [0.01, 0.07, 0.0])
  # The trainer's resolver and the early check accept it too.
  cfg = tiny_config(**{"reward.function": "tests.test_rewards:answer_length"})
  build.check_reward_functions(cfg)
  out = build.build_rewards(cfg, None, tok, None, None).combine([{}] * 3, ids, lens)[0]
  np.testing.assert_allclose(out, [0.01, 0.07, 0.0])


def test_a_batched_user_function_is_called_once_per_batch(tok):
  """A user function with `batched = True` gets the batch's responses, answers and records in
  one call (a verifier pool, a reward server); a result of another length or a non-finite
  value names the function (and the first bad sample)."""
  texts = ["a", "abc def", ""]
  ids, lens = _batch(tok, texts)
  records = [{"id": i, "target": f"t{i}"} for i in range(3)]
  fn = rewards_lib.get_reward_function("tests.test_rewards:batch_lengths")
  # the module as imported by path (pytest may have imported this file under another name)
  calls = rewards_lib.import_function("tests.test_rewards:batch_lengths").__globals__["CALLS"]
  calls.clear()
  np.testing.assert_allclose(fn(records, ids, lens, tok), [0.01, 0.07, 0.0])
  assert calls == [(texts, ["t0", "t1", "t2"], [0, 1, 2])]
  records[1]["target"] = "bad"
  with pytest.raises(rewards_lib.RewardFunctionError,
                     match=r"'tests\.test_rewards:batch_lengths' \(batched\) returned nan for "
                           r"sample 1 \(answer 'bad', response 'abc def'\) and 0 more"):
    fn(records, ids, lens, tok)
  with pytest.raises(rewards_lib.RewardFunctionError,
                     match=r"returned shape \(2,\); expected one number per response, \(3,\)"):
    rewards_lib.get_reward_function("tests.test_rewards:batch_short")(records, ids, lens, tok)
  pool = rewards_lib.get_reward_function("tests.test_rewards:batch_pool")
  np.testing.assert_allclose(pool(records, ids, lens, tok), [0.01, 0.07, 0.0])
  # a number as the answer (a JSON column), and no records at all, in the error's sample
  with pytest.raises(rewards_lib.RewardFunctionError, match=r"nan for sample 2 \(answer '19'"):
    pool([{}, {}, {"target": 19}], ids, lens, tok)
  with pytest.raises(rewards_lib.RewardFunctionError,
                     match=r"returned shape \(2,\).*\(3,\)"):
    rewards_lib.get_reward_function("tests.test_rewards:batch_short")(None, ids, lens, tok)
  cfg = tiny_config(**{"reward.format": "tests.test_rewards:batch_lengths"})
  build.check_reward_functions(cfg)


def test_stats_are_measured_and_not_added_to_the_reward(tok):
  """reward.stats: each function's batch mean is logged as stats/<function>_mean (a per-sample
  and a batched one); the reward and its term metrics are those of the run without them. A bad
  entry or two functions of one name fail before the run, naming the field."""
  texts = ["a", "abc def", ""]
  ids, lens = _batch(tok, texts)
  records = [{"id": i, "target": f"t{i}"} for i in range(3)]
  spec = "tests.test_rewards:answer_length, tests.test_rewards:batch_lengths"
  cfg = tiny_config(**{"reward.function": "tests.test_rewards:with_defaults",
                       "reward.stats": spec})
  build.check_reward_functions(cfg)
  alone = tiny_config(**{"reward.function": "tests.test_rewards:with_defaults"})
  plain = build.build_rewards(alone, None, tok, None, None).combine(records, ids, lens)
  got = build.build_rewards(cfg, None, tok, None, None).combine(records, ids, lens)
  np.testing.assert_array_equal(got[0], plain[0])
  assert got[1] == {**plain[1], "stats/answer_length_mean": pytest.approx(0.08 / 3),
                    "stats/batch_lengths_mean": pytest.approx(0.08 / 3)}
  # A statistic may have no value (NaN) for some responses: the mean is over the rest, NaN
  # when none has one (it stopped the run as a reward's NaN does); infinity still stops it.
  records[1]["target"] = "bad"  # batch_lengths' NaN
  cfg = tiny_config(**{"reward.function": "tests.test_rewards:with_defaults",
                       "reward.stats": "tests.test_rewards:half_missing,"
                                       "tests.test_rewards:batch_lengths,"
                                       "tests.test_rewards:none_missing"})
  got = build.build_rewards(cfg, None, tok, None, None).combine(records, ids, lens)[1]
  assert got == {"stats/half_missing_mean": pytest.approx(0.01 / 2),
                 "stats/batch_lengths_mean": pytest.approx(0.01 / 2),
                 "stats/none_missing_mean": pytest.approx(0.01 / 2)}
  got = build.build_rewards(cfg, None, tok, None, None).combine(records[1:2], ids[1:2],
                                                                 lens[1:2])[1]
  assert all(np.isnan(v) for v in got.values()) and len(got) == 3
  cfg = tiny_config(**{"reward.function": "tests.test_rewards:with_defaults",
                       "reward.stats": "tests.test_rewards:overflows"})
  with pytest.raises(ValueError, match=r"^statistic 'tests\.test_rewards:overflows' returned "
                                       r"1e\+39 for "
                                       r"sample 1"):
    build.build_rewards(cfg, None, tok, None, None).combine(records, ids, lens)
  # As a reward, the statistic's NaN is refused.
  with pytest.raises(ValueError, match=r"'tests\.test_rewards:half_missing' returned nan"):
    rewards_lib.get_reward_function("tests.test_rewards:half_missing")(records, ids, lens, tok)
  with pytest.raises(ValueError, match=r"config\.reward\.stats='tests\.test_rewards:nope': "):
    build.check_reward_functions(tiny_config(**{"reward.stats": "tests.test_rewards:nope"}))
  with pytest.raises(ValueError, match=r"config\.reward\.stats=.*distinct function names.*; "
                                       r"score named twice"):
    tiny_config(**{"reward.stats": "a.b:score,c.d:score"})


@pytest.mark.parametrize("spec, expected", [
    ("nope", r"unknown reward function 'nope'; known: \[.*'gsm8k'.*'math'.*or a function by "
             r"import path"),
    ("tests.no_such_module:f", r"cannot import module 'tests\.no_such_module' "
                               r"\(ModuleNotFoundError"),
    ("tests.test_rewards:missing", "module 'tests.test_rewards' has no attribute 'missing'"),
    # A misspelled module of a package that imports is named with the closest module it has,
    # not sent to PYTHONPATH.
    ("tests.test_reward:answer_length", r"No module named 'tests\.test_reward'\); did you mean "
                                        r"'tests\.test_rewards:answer_length'\?$"),
    # A misspelled function is named with the closest one the module has.
    ("tests.test_rewards:answer_lenght", r"module 'tests\.test_rewards' has no attribute "
                                         r"'answer_lenght'; did you mean "
                                         r"'tests\.test_rewards:answer_length'\?$"),
    ("tests.test_rewards:NOT_CALLABLE", r"'NOT_CALLABLE' is not callable \(its type is int\)"),
    ("tests.test_rewards:", "expected 'package.module:function'"),
    # Called as fn(response, answer, record): a function that cannot take them is refused now
    # (it failed at the first reward, after set-up and the first generation).
    ("tests.test_rewards:two_args", r"its signature \(response, answer\) cannot take the three "
                                    r"arguments it is called with, \(response, answer, record\)"),
    # A dot where the colon goes is an unknown name, with the colon suggested.
    ("tests.test_rewards.answer_length", r"did you mean 'tests\.test_rewards:answer_length' \(a "
                                         r"colon before the function\)\?"),
    ("gsm8kk", r"did you mean 'gsm8k'\?"),
    ("tests/test_rewards.py:answer_length", r"'tests/test_rewards\.py' is a file path; name the "
                                            r"module by import path, 'tests\.test_rewards:"
                                            r"answer_length'"),
])
def test_bad_function_specs_fail_before_the_run(spec, expected):
  rewards_lib.get_reward_function("tests.test_rewards:with_defaults")  # takes the three
  with pytest.raises(ValueError, match=expected):
    rewards_lib.get_reward_function(spec)
  with pytest.raises(ValueError, match=rf"^config\.reward\.function='{re.escape(spec)}': "
                                       rf".*{expected}"):
    build.check_reward_functions(tiny_config(**{"reward.function": spec}))
  with pytest.raises(ValueError, match=rf"^config\.reward\.format='{re.escape(spec)}': "):
    build.check_reward_functions(tiny_config(**{"reward.format": spec}))
  # Beside a reward model the format term is checked as well (reward.function is unused).
  model = {"reward.kind": "model", "reward.model_checkpoint": "/x", "reward.function": spec}
  build.check_reward_functions(tiny_config(**model))
  with pytest.raises(ValueError, match=rf"^config\.reward\.format='{re.escape(spec)}': "):
    build.check_reward_functions(tiny_config(**{**model, "reward.format": spec}))


def test_a_module_that_fails_in_its_own_imports_is_not_sent_to_pythonpath(tmp_path,
                                                                          monkeypatch):
  """PYTHONPATH is the hint where the module's own package is not found; a module found on it
  whose own import fails (a dependency missing) says so instead."""
  (tmp_path / "walk_pkg").mkdir()
  (tmp_path / "walk_pkg" / "__init__.py").write_text("")
  (tmp_path / "walk_pkg" / "broken.py").write_text("import no_such_dependency_xyz\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ValueError, match=r"No module named 'no_such_dependency_xyz'\); the module "
                                       r"was found: the error is in its own code or imports$"):
    rewards_lib.get_reward_function("walk_pkg.broken:score")
  with pytest.raises(ValueError, match=r"No module named 'walk_pkgg'\); is its directory on "
                                       r"PYTHONPATH\?$"):
    rewards_lib.get_reward_function("walk_pkgg.broken:score")
  with pytest.raises(ValueError, match=r"No module named 'walk_pkg\.zzz'\); package 'walk_pkg' "
                                       r"has no module 'zzz'$"):
    rewards_lib.get_reward_function("walk_pkg.zzz:score")


def test_an_unknown_task_names_the_field():
  with pytest.raises(ValueError, match=r"^config\.data\.task='nope': expected one of "
                                       r"\['count_up', 'countdown', 'repeat', 'sort'\]"):
    build.build_task_and_tokenizer(tiny_config(**{"data.task": "nope"}))


def test_errors_name_the_function_and_the_sample(tok):
  """An exception, a non-number and a non-finite value from a per-sample function each name
  the function, the sample's index and file:line, its answer and response."""
  ids, lens = _batch(tok, ["one", "two", "three"])
  records = [{"id": i, "target": f"t{i}", "_source": f"train.jsonl:{i + 4}"} for i in range(3)]
  rewards = Rewards(fn=lambda r, i, l: rewards_lib.get_reward_function(
      "tests.test_rewards:broken")(r, i, l, tok), name="tests.test_rewards:broken")
  with pytest.raises(rewards_lib.RewardFunctionError,
                     match=r"reward function 'tests\.test_rewards:broken' failed on sample 2 "
                           r"\(train\.jsonl:6\) \(answer 't2', response 'three'\): "
                           r"ZeroDivisionError"):
    rewards.combine(records, ids, lens)[0]
  bad = rewards_lib.get_reward_function("tests.test_rewards:not_a_number")
  with pytest.raises(ValueError, match=r"'tests\.test_rewards:not_a_number' returned 'high' for "
                                       r"sample 0 \(train\.jsonl:4\).*expected a finite number"):
    bad(records, ids, lens, tok)
  nan = rewards_lib.per_sample(lambda r, a, rec: float("nan"), "nan_fn")
  with pytest.raises(ValueError, match=r"'nan_fn' returned nan for sample 0"):
    nan(records, ids, lens, tok)
  # Finite for Python but not in float32, the rewards' type: named there (it became inf and
  # was refused later without the sample; an int too large for a float raised OverflowError).
  for spec, shown in (("overflows", r"1e\+39"), ("huge_int", "1000000000")):
    with pytest.raises(rewards_lib.RewardFunctionError,
                       match=rf"'tests\.test_rewards:{spec}' returned {shown}.* for sample "
                             rf"\d .*expected a finite number \(float32: magnitude at most "
                             rf"3\.4e\+38\)"):
      rewards_lib.get_reward_function(f"tests.test_rewards:{spec}")(records, ids, lens, tok)
  # A None (a forgotten return on one path) or a text among a batched function's values: named
  # as the per-sample path names them (numpy read None as NaN, the error said nan, and "1" as
  # 1.0); a statistic's None is its "no value".
  for given, shown, at in (([1.0, None, 0.0], "None", 1), (["1", "2", "3"], "'1'", 0)):
    with pytest.raises(rewards_lib.RewardFunctionError,
                       match=rf"'odd_batch' \(batched\) returned {shown} for sample {at} "
                             r".*expected one number per response"):
      rewards_lib.per_batch(lambda texts, answers, recs, v=given: v, "odd_batch")(
          records, ids, lens, tok)
  stat = rewards_lib.per_batch(lambda texts, answers, recs: [1.0, None, 0.0], "s", stat=True)
  np.testing.assert_array_equal(stat(records, ids, lens, tok), [1.0, np.nan, 0.0])
  big = rewards_lib.per_batch(lambda texts, answers, recs: [0.0, 1e39, 0.0], "big_batch")
  with pytest.raises(rewards_lib.RewardFunctionError,
                     match=r"'big_batch' \(batched\) returned 1e\+39 for sample 1"):
    big(records, ids, lens, tok)
  # Terms finite alone whose weighted sum is not: refused naming them (it went on to the
  # advantages as inf).
  half = lambda r, i, l: np.full(3, 3e38, np.float32)
  summed = Rewards(fn=half, name="half",
                   extra=[RewardTerm(label="format", fn=half, name="half2", weight=2.0)])
  with pytest.raises(ValueError, match=r"the reward of sample 0 of the batch overflows float32: "
                                       r"function 1 \* 3e\+38, format 2 \* 3e\+38"):
    summed.combine(records, ids, lens)
  # A reward model's own non-finite score is not an overflow of the sum: it goes on to the
  # trainer's guard (guard.on_nonfinite), as before.
  model = Rewards(model_cfg=llama.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                              num_layers=1, num_heads=1, num_kv_heads=1,
                                              head="scalar"), model_params={},
                  extra=[RewardTerm(label="format", fn=lambda r, i, l: np.ones(3, np.float32),
                                    name="one")])
  got, _ = model.combine(records, ids, lens, np.array([0.5, np.nan, np.inf], np.float32))
  assert got[0] == 1.5 and np.isnan(got[1]) and np.isinf(got[2])
  # A registered verifier's error names it and the sample too.
  with pytest.raises(ValueError, match=r"reward function 'gsm8k' failed on sample 1 "
                                       r"\(train\.jsonl:5\).*holds no number"):
    rewards_lib.get_reward_function("gsm8k")(
        [{"target": "7"}, {"target": "x", "_source": "train.jsonl:5"}], ids[:2], lens[:2], tok)


def test_numpy_and_jax_scalars_are_rewards_and_arrays_are_not(tok):
  """Reward code computed with numpy or jax returns 0-d arrays (np.array(0.25), a jnp scalar):
  each is its number (they were refused as 'expected a finite number'), as Python and numpy
  scalars and bools are; a longer array or a string is still refused."""
  import jax.numpy as jnp
  ids, lens = _batch(tok, ["one", "two"])
  for value in (np.array(0.25), jnp.float32(0.25), jnp.asarray(0.25), np.float32(0.25), 0.25):
    fn = rewards_lib.per_sample(lambda r, a, rec, v=value: v, "scalar_fn")
    np.testing.assert_allclose(fn([{}, {}], ids, lens, tok), [0.25, 0.25], err_msg=repr(value))
  for value in (True, np.bool_(True), np.array(True)):
    fn = rewards_lib.per_sample(lambda r, a, rec, v=value: v, "bool_fn")
    np.testing.assert_array_equal(fn([{}, {}], ids, lens, tok), [1.0, 1.0])
  for value, shown in ((np.array([0.25]), r"array\(\[0\.25\]\)"), (np.str_("1"), "'1'"),
                       (jnp.asarray(float("nan")), "nan")):
    fn = rewards_lib.per_sample(lambda r, a, rec, v=value: v, "bad_fn")
    with pytest.raises(ValueError, match=rf"'bad_fn' returned {shown} for sample 0"):
      fn([{}, {}], ids, lens, tok)


def test_batch_function_errors_are_named_by_the_resolver():
  """A batch function's own exception reaches the user with the function's name."""
  def fails(records, ids, lens):
    raise KeyError("target")
  rewards = Rewards(fn=fails, name="my_batch_fn")
  with pytest.raises(ValueError, match=r"reward function 'my_batch_fn' failed on a batch of 2 "
                                       r"samples: KeyError: 'target'"):
    rewards.combine([{}, {}], np.zeros((2, 3), np.int32), np.ones(2, np.int32))


def test_a_statistic_that_verifies_needs_every_answer_at_the_start(tmp_path):
  """reward.stats=gsm8k beside a reward that reads no answer: a row without one passed the load
  and stopped the run once drawn, mid-training; it is named when the prompts load."""
  path = tmp_path / "t.jsonl"
  path.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"}\n')
  user = {"reward.function": "tests.test_rewards:with_defaults", "data.prompts_file": str(path),
          "data.answer_key": "answer"}
  build.load_prompt_records(tiny_config(**user), None)  # no verifier: the row may lack one
  with pytest.raises(ValueError, match=r"t\.jsonl:2: missing answer field 'answer'"):
    build.load_prompt_records(tiny_config(**user, **{"reward.stats": "gsm8k"}), None)
  assert not build._needs_answer(tiny_config(**user, **{"reward.stats": "boxed_format"}))


@pytest.mark.parametrize("verifier,answer,match", [
    ("gsm8k", "Tom has two apples left.\\n#### two", r"holds no number"),
    ("gsm8k", "#### 3/4", r"is a fraction, of which gsm8k reads the final number alone"),
    ("gsm8k", "1e3", r"reads as the number 1, with digits around it"),
    ("gsm8k", "#### 1.2.3", r"reads as the number 1.2, with digits around it"),
    ("gsm8k", "It is 3,5", r"reads as the number 5, with digits around it"),
    ("math", "\\\\frac{1}{", r"has unbalanced braces"),
    ("math", "\\\\boxed{", r"has unbalanced braces"),
    ("math", "\\\\\\\\{", r"has unbalanced braces")])  # a line break, then an open brace
def test_an_answer_the_verifier_cannot_read_is_refused_at_the_start(tmp_path, verifier, answer,
                                                                     match):
  """A row whose answer gsm8k finds no number in passed the load and stopped the run once drawn,
  mid-training (its message then blamed the function); math read an unbalanced answer as its
  raw text and scored every response 0, without a word. Both are named when the prompts load,
  by the verifier as the reward or as a statistic; a balanced one, escaped braces too, loads."""
  path = tmp_path / "t.jsonl"
  path.write_text('{"prompt": "1+1?", "answer": "2"}\n'
                  f'{{"prompt": "2+2?", "answer": "{answer}"}}\n')
  base = {"data.prompts_file": str(path), "data.answer_key": "answer"}
  for how in ({"reward.function": verifier},
              {"reward.function": "tests.test_rewards:with_defaults", "reward.stats": verifier}):
    with pytest.raises(ValueError, match=rf"config\.data\.prompts_file: .*t\.jsonl:2: the answer "
                                         rf".*{match}.*the run's '{verifier}' verifier reads"):
      build.load_prompt_records(tiny_config(**base, **how), None)
  path.write_text('{"prompt": "1+1?", "answer": "\\\\{1\\\\} \\\\boxed{2}"}\n')
  assert len(build.load_prompt_records(tiny_config(**base, **{"reward.function": verifier}),
                                       None)[0]) == 1
  # (a backslash escapes one character: after a line break '\\\\' a brace opens a group)
  for good in ("#### 1,234.5", "It is 8.5.", "$1,000,000.00", "5 apples, 3 pears: 8."):
    verifiers.ANSWER_CHECKS["gsm8k"](good)
  for good in (r"\begin{pmatrix}1\\{-2}\end{pmatrix}", r"\left\{1,2\right\}", "[0, 1)",
               r"x \in \{1\}", r"\text{(A)}"):
    verifiers.ANSWER_CHECKS["math"](good)


def test_held_out_prompts_that_are_training_prompts_are_warned_of(tmp_path, monkeypatch):
  """data.val_file naming the training file, or a repeated prompt split to both sides, had
  validation measure trained prompts without a word; other prompts give no warning."""
  path = tmp_path / "t.jsonl"
  path.write_text("".join(f'{{"prompt": "{i}+1?", "answer": "{i + 1}"}}\n' for i in range(8)))
  other = tmp_path / "v.jsonl"
  other.write_text('{"prompt": "9+1?", "answer": "10"}\n')
  warned = []
  monkeypatch.setattr(build.logging, "warning", lambda msg, *a: warned.append(msg % a))
  base = {"data.prompts_file": str(path), "data.answer_key": "answer", "eval_every": 1}
  build.load_prompt_records(tiny_config(**base, **{"data.val_file": str(other)}), None)
  assert warned == []
  build.load_prompt_records(tiny_config(**base, **{"data.val_file": str(path)}), None)
  assert len(warned) == 1 and warned[0].startswith(
      f"8 of the 8 held-out prompts are also training prompts (the first: {path}:1)")
  path.write_text(path.read_text() * 2)  # every prompt twice: a split puts some on both sides
  build.load_prompt_records(tiny_config(**base, **{"data.val_fraction": 0.25}), None)
  assert len(warned) == 2 and "of the 4 held-out prompts are also training prompts" in warned[1]
  # A synthetic task's own prompts repeat by design (few distinct ones): no warning there.
  cfg = tiny_config(**{"data.val_fraction": 0.25, "eval_every": 1})
  build.load_prompt_records(cfg, build.build_task_and_tokenizer(cfg)[0])
  assert len(warned) == 2


def test_a_registered_verifier_as_a_statistic_is_named_a_statistic(tok):
  """reward.stats=gsm8k failed as "reward function 'gsm8k' failed ...", sending the user to
  reward.function; it is the statistic that failed."""
  ids, lens = _batch(tok, ["4"])
  cfg = tiny_config(**{"reward.function": "tests.test_rewards:with_defaults",
                       "reward.stats": "gsm8k"})
  with pytest.raises(ValueError, match=r"^statistic 'gsm8k' failed on sample 0 \(answer 'many'"):
    build.build_rewards(cfg, None, tok, None, None).combine([{"target": "many"}], ids, lens)
  got = build.build_rewards(cfg, None, tok, None, None).combine([{"target": "4"}], ids, lens)
  assert got[1]["stats/gsm8k_mean"] == 1.0


def test_reward_config_checks():
  # A reward model takes a second function too (a length penalty, a format reward).
  model = {"reward.kind": "model", "reward.model_checkpoint": "/x"}
  tiny_config(**model, **{"reward.format": "boxed_format"})
  # Rows need an answer when a term reads it, beside a model too (reward.function is unused).
  assert build._needs_answer(tiny_config(**model, **{"reward.format": "gsm8k"}))
  assert not build._needs_answer(tiny_config(**model, **{"reward.function": "gsm8k"}))
  assert not build._needs_answer(tiny_config(**model, **{"reward.format": "gsm8k_format"}))
  with pytest.raises(ValueError, match=r"config\.reward\.format_weight=inf"):
    tiny_config(**{"reward.format": "boxed_format", "reward.format_weight": float("inf")})
  # finite, but every reward it weighs overflows float32 (refused after the compiles)
  with pytest.raises(ValueError, match=r"config\.reward\.format_weight=1e\+39: .*float32"):
    tiny_config(**{"reward.format": "boxed_format", "reward.format_weight": 1e39})
  # float32's largest value itself is in range (3.4e38 is a little below it)
  tiny_config(**{"reward.format": "boxed_format", "reward.format_weight": 3.4028e38})


def test_a_user_function_naming_num_tokens_gets_each_responses_token_count(tok):
  """A length penalty (DAPO's overlong shaping) needs the response's length in tokens, which
  the text alone does not give. A function that names a parameter `num_tokens` gets it: the
  generated ids through the first EOS, the EOS counted (ids after it are not the response);
  per sample an int, batched a list. The three-argument functions are called as before."""
  ids, lens = _batch(tok, ["a", "abc def ghi jkl mno", ""])
  want = lens.tolist()  # the text's tokens + EOS
  lens_after = lens.copy()
  lens_after[0] += 3  # ids generated after the EOS: not counted
  penalties = [max(-1.0, min(0.0, (4 - n) / 4)) for n in want]  # max_tokens 8, cache 4
  assert penalties[1] < 0 == penalties[0]  # one penalised, one not
  fn = rewards_lib.get_reward_function("tests.test_rewards:overlong")  # the early check passes
  np.testing.assert_allclose(fn([{}] * 3, ids, lens_after, tok), penalties)
  assert rewards_lib.takes_num_tokens(overlong)
  batched = rewards_lib.get_reward_function("tests.test_rewards:batch_tokens")
  np.testing.assert_array_equal(batched([{}] * 3, ids, lens_after, tok), want)
  # Not passed to a function that does not name it (**kwargs included).
  seen = []
  rewards_lib.per_sample(lambda r, a, rec, **kw: seen.append(kw) or 0.0, "kw")(
      [{}] * 3, ids, lens, tok)
  assert seen == [{}] * 3 and not rewards_lib.takes_num_tokens(answer_length)
  # As a reward.format term beside the task's reward (what a run configures).
  cfg = tiny_config(**{"reward.function": "tests.test_rewards:answer_length",
                       "reward.format": "tests.test_rewards:overlong",
                       "reward.format_weight": 1.0})
  build.check_reward_functions(cfg)
  _, metrics = build.build_rewards(cfg, None, tok, None, None).combine([{}] * 3, ids, lens)
  np.testing.assert_allclose(metrics["reward/format_mean"], np.mean(penalties), rtol=1e-6)


def test_a_per_sample_function_gets_each_responses_exact_token_count(tok):
  """Per sample, num_tokens is the exact count (ids through the first EOS, the EOS counted;
  every id of a response that emitted none): the test above reads it through overlong's clip
  to [-1, 0], where a count off by one (the EOS left out) scored the same."""
  ids, lens = _batch(tok, ["a", "abc def ghi jkl mno", ""])
  lens_after = lens.copy()
  lens_after[0] += 3  # ids generated after the EOS: not counted
  count = rewards_lib.per_sample(lambda response, answer, record, num_tokens: num_tokens, "n")
  np.testing.assert_array_equal(count([{}] * 3, ids, lens_after, tok), lens)
  no_eos, n = _batch(tok, ["abc", "a b"], stop=False)
  np.testing.assert_array_equal(count([{}] * 2, no_eos, n, tok), n)


def test_a_partial_of_a_batched_function_is_called_once_per_batch(tok):
  """functools.partial(batched_fn, ...) has none of batched_fn's attributes: it was called per
  sample, each response's characters read as the batch, and failed. The mark is read through
  the partial; one set on the partial itself wins."""
  ids, lens = _batch(tok, ["ab", "abcd", "x"])
  fn = rewards_lib.get_reward_function("tests.test_rewards:batch_half")
  np.testing.assert_allclose(fn([{}] * 3, ids, lens, tok), [1.0, 2.0, 0.5])
  assert rewards_lib.marked_batched(batch_half)
  per_text = functools.partial(batch_scaled, scale=2.0)
  per_text.batched = False
  assert not rewards_lib.marked_batched(per_text)
  assert not rewards_lib.marked_batched(functools.partial(overlong, max_tokens=8))


def test_a_num_tokens_the_user_bound_is_not_passed_again(tok):
  """functools.partial(fn, num_tokens=K) binds the keyword: the function is scored with K (a
  partial's signature still names num_tokens, with K as its default, and the token counts
  passed as a keyword replaced the user's value). A partial binding another keyword still gets
  the counts; the early check passes either way."""
  ids, lens = _batch(tok, ["a", "abc def ghi jkl mno", ""])
  want = lens.tolist()
  assert 5 not in want  # the counts differ from the bound 5 (else the test could not fail)
  bound = functools.partial(overlong, num_tokens=5)
  rewards_lib._check_arguments(bound, "bound")
  np.testing.assert_allclose(rewards_lib.per_sample(bound, "bound")([{}] * 3, ids, lens, tok),
                             [max(-1.0, min(0.0, (4 - 5) / 4))] * 3)
  batched = functools.partial(batch_tokens, num_tokens=[7, 8, 9])
  np.testing.assert_array_equal(rewards_lib.per_batch(batched, "b")([{}] * 3, ids, lens, tok),
                                [7, 8, 9])
  assert not rewards_lib.takes_num_tokens(bound) and not rewards_lib.takes_num_tokens(batched)

  @functools.wraps(bound)  # a decorator's wrapper: inspect.signature reads the partial's
  def decorated(*args, **kwargs):
    return bound(*args, **kwargs)
  assert not rewards_lib.takes_num_tokens(decorated)
  # Another keyword bound: num_tokens is still the function's to receive.
  other = functools.partial(overlong, max_tokens=16, cache=8)
  assert rewards_lib.takes_num_tokens(other)
  np.testing.assert_allclose(rewards_lib.per_sample(other, "other")([{}] * 3, ids, lens, tok),
                             [max(-1.0, min(0.0, (8 - n) / 8)) for n in want])


# ----------------------------------------------------- OpenRLHF's reward normalisation

def _openrlhf_rm(tmp_path, name="rm", **stats):
  """A copy of the tiny Qwen2 fixture whose config.json is an OpenRLHF reward model's
  (architectures ["RewardModel"], value_head_prefix) plus `stats` (OpenRLHF's trainer writes
  mean and std; normalize_reward records only the flag it was last loaded with)."""
  import json
  import shutil
  src = os.path.join(os.path.dirname(CHAT), "tiny_qwen2")
  rm = tmp_path / name
  shutil.copytree(src, rm)
  with open(rm / "config.json") as f:
    hf = json.load(f)
  hf.update(architectures=["RewardModel"], value_head_prefix="value_head",
            normalize_reward=False, **stats)
  with open(rm / "config.json", "w") as f:
    json.dump(hf, f)
  return str(rm)


def _model_rewards(cfg, tok):
  """build_rewards of reward.kind='model' config `cfg` with a stand-in for the loaded model
  (combine takes the model's scores as given)."""
  import types
  scalar = llama.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                             num_heads=1, num_kv_heads=1, head="scalar")
  models = types.SimpleNamespace(reward_cfg=scalar, reward_params={})
  return build.build_rewards(cfg, None, tok, models, None)


def test_an_openrlhf_reward_models_mean_and_std_normalise_its_scores(tok, tmp_path, caplog):
  """OpenRLHF's reward-model trainer writes the mean and std of its evaluation scores into
  config.json, and its PPO (--normalize_reward, as in its example scripts) scores
  (r - mean) / std: the run took the raw scores, on another scale than the kl_coef and clip
  ranges tuned there. reward.model_normalize='auto' (the default) applies them, with a log line,
  also after the weights moved (the fused stage's with_model_params); 'off' keeps the raw
  scores, saying the statistics go unused."""
  import logging
  rm = _openrlhf_rm(tmp_path, mean=2.5, std=0.5)
  ids, lens = _batch(tok, ["a", "bb", "ccc"])
  raw = np.array([2.5, 3.0, 1.25], np.float32)
  base = {"reward.kind": "model", "reward.model_checkpoint": rm,
          "reward.format": "tests.test_rewards:answer_length", "reward.format_weight": 2.0}
  length = np.array([0.01, 0.02, 0.03])
  with caplog.at_level(logging.INFO):
    rewards = _model_rewards(tiny_config(**base), tok)
  assert rewards.model_norm == (2.5, 0.5)
  assert "rewards are (score - 2.5) / 0.5" in caplog.text, caplog.text
  for r in (rewards, rewards.without_model_params().with_model_params({}, rewards.scorer)):
    out, metrics = r.combine([{}] * 3, ids, lens, raw)
    np.testing.assert_allclose(out, [0.0, 1.0, -2.5] + 2.0 * length, rtol=1e-6)
    assert metrics["reward/model_mean"] == pytest.approx(-0.5)
  caplog.clear()
  with caplog.at_level(logging.INFO):
    off = _model_rewards(tiny_config(**base, **{"reward.model_normalize": "off"}), tok)
  assert off.model_norm is None
  assert "not normalised by the mean 2.5 and std 0.5" in caplog.text, caplog.text
  np.testing.assert_allclose(off.combine([{}] * 3, ids, lens, raw)[0], raw + 2.0 * length,
                             rtol=1e-6)
  # A checkpoint without them (transformers' *ForSequenceClassification): raw, under 'auto'
  # and 'off'; 'on' is refused naming the field, before any weight is read.
  plain = _openrlhf_rm(tmp_path, "plain")
  for how in ("auto", "off"):
    cfg = tiny_config(**{**base, "reward.model_checkpoint": plain,
                         "reward.model_normalize": how})
    assert _model_rewards(cfg, tok).model_norm is None
  on = tiny_config(**{**base, "reward.model_checkpoint": plain, "reward.model_normalize": "on"})
  with pytest.raises(ValueError, match=r"config\.reward\.model_normalize='on': config\.reward\."
                     r"model_checkpoint='.*plain' has no reward statistics \(`mean` and `std`"):
    build.reward_model_config(on)
  assert _model_rewards(tiny_config(**{**base, "reward.model_normalize": "on"}),
                        tok).model_norm == (2.5, 0.5)


def test_a_checkpoint_from_before_model_normalize_resumes_with_the_raw_scores_it_had(tmp_path):
  """A run whose checkpoints predate reward.model_normalize scored its reward model raw: a
  resume with the default 'auto' and a reward model holding OpenRLHF's mean and std would have
  normalised its rewards from then on without a word (a missing field at its default counted
  as unchanged). It is compared with 'off', the value it ran with: refused as that change,
  with the flag to name it; 'off' continues; a reward model without statistics (or a reward
  function) is unaffected."""
  from rlhfuse_jax.trainer import config as config_lib
  from rlhfuse_jax.trainer import loop
  rm = _openrlhf_rm(tmp_path, mean=2.5, std=0.5)
  base = {"reward.kind": "model", "reward.model_checkpoint": rm}
  cfg = tiny_config(**base)
  old = {k: v for k, v in cfg.fingerprint().items() if k != "reward.model_normalize"}
  assert loop.ran_before_fields(cfg) == {"reward.model_normalize": "off"}
  changes = config_lib.fingerprint_changes(old, cfg.fingerprint(), loop.ran_before_fields(cfg))
  assert changes == ["reward.model_normalize: (absent: ran as 'off') -> 'auto'"], changes
  assert "--config.checkpoint.resume_changes=reward.model_normalize" in (
      config_lib.resume_advice(changes))
  off = tiny_config(**base, **{"reward.model_normalize": "off"})
  assert config_lib.fingerprint_changes(old, off.fingerprint(), loop.ran_before_fields(off)) == []
  for other in (tiny_config(**{**base, "reward.model_checkpoint": _openrlhf_rm(tmp_path, "p")}),
                tiny_config()):
    assert loop.ran_before_fields(other) == {}
    saved = {k: v for k, v in other.fingerprint().items() if k != "reward.model_normalize"}
    assert config_lib.fingerprint_changes(saved, other.fingerprint(),
                                          loop.ran_before_fields(other)) == []


def test_bad_reward_statistics_and_normalise_settings_are_refused(tok, tmp_path):
  """A config.json with one statistic but not the other, or one that is no number (std: > 0),
  is refused naming the file and the field; so are reward.model_normalize values other than
  auto / on / off, and 'on' beside a reward function (there is no model score to normalise)."""
  for i, (stats, match) in enumerate((
      ({"mean": 1.0}, r"mean=1\.0 without std; OpenRLHF's reward statistics are the two"),
      ({"std": 2.0}, r"std=2\.0 without mean"),
      ({"mean": 1.0, "std": 0.0}, r"std=0\.0; expected a finite number > 0"),
      ({"mean": "1", "std": 1.0}, r"mean='1'; expected a finite number \(OpenRLHF's"),
      ({"mean": True, "std": 1.0}, r"mean=True; expected a finite number"))):
    rm = _openrlhf_rm(tmp_path, f"bad{i}", **stats)
    cfg = tiny_config(**{"reward.kind": "model", "reward.model_checkpoint": rm})
    with pytest.raises(ValueError, match=r"config\.json: " + match):
      _model_rewards(cfg, tok)
  with pytest.raises(ValueError, match=r"config\.reward\.model_normalize='yes': expected one of "
                                       r"\['auto', 'on', 'off'\]"):
    tiny_config(**{"reward.model_normalize": "yes"})
  with pytest.raises(ValueError, match=r"config\.reward\.model_normalize='on': expected 'auto' "
                                       r"or 'off' when reward\.kind='function'"):
    tiny_config(**{"reward.model_normalize": "on"})
  # A reward function has no model scores: Rewards refuses a normalisation beside one.
  with pytest.raises(ValueError, match=r"model_norm=\(0\.0, 1\.0\) normalises a reward model's"):
    Rewards(fn=len, name="f", model_norm=(0.0, 1.0))


def test_a_reward_model_under_openrlhf_s_own_value_head_prefix_is_accepted(tmp_path):
  """OpenRLHF's --value_head_prefix may be any name, recorded in config.json: a reward model
  whose head is `reward_head.weight` was refused as having 'no trained scalar head'."""
  import json
  import safetensors.numpy
  rm = _openrlhf_rm(tmp_path)
  weights = safetensors.numpy.load_file(os.path.join(rm, "model.safetensors"))
  weights["reward_head.weight"] = weights["model.embed_tokens.weight"][7:8].copy()
  safetensors.numpy.save_file(weights, os.path.join(rm, "model.safetensors"))
  cfg = tiny_config(**{"reward.kind": "model", "reward.model_checkpoint": rm})
  with pytest.raises(ValueError, match=r"has no trained scalar head \(a tensor score\.weight / "
                     r"value_head\.weight / v_head\.summary\.weight\)"):
    build.reward_model_config(cfg)  # config.json names value_head, which it lacks
  with open(os.path.join(rm, "config.json")) as f:
    hf = json.load(f)
  hf["value_head_prefix"] = "reward_head"
  with open(os.path.join(rm, "config.json"), "w") as f:
    json.dump(hf, f)
  assert build.reward_model_config(cfg).head == "scalar"


def test_a_format_term_beside_a_reward_model_is_said(tok, tmp_path, caplog):
  """configs/ppo_hf.py with reward.kind='model' (docs/own_model.md's table) kept the preset's
  reward.format='gsm8k_format': 0.1 x its 0-or-1 score was added to every reward model score
  without a word (only the unused reward.function was warned of)."""
  import logging
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer.validate import validate
  import safetensors.numpy
  rm = _openrlhf_rm(tmp_path, "plain")
  weights = safetensors.numpy.load_file(os.path.join(rm, "model.safetensors"))
  weights["value_head.weight"] = weights["model.embed_tokens.weight"][7:8].copy()
  safetensors.numpy.save_file(weights, os.path.join(rm, "model.safetensors"))
  model = {"reward.kind": "model", "reward.model_checkpoint": rm}
  fmt = {"reward.format": "gsm8k_format", "reward.format_weight": 0.1}
  said = "reward: the reward model's score + 0.1 x 'gsm8k_format' (config.reward.format;"
  for overrides, logged in ((fmt, True), ({}, False)):
    caplog.clear()
    with caplog.at_level(logging.INFO):
      _model_rewards(tiny_config(**model, **overrides), tok)
    assert (said in caplog.text) == logged, caplog.text
  # The warning of the verifier left beside the model names the function alone: the `reward:`
  # line above says what the format adds (test_trainer_paths: once a start).
  for overrides in (fmt, {}):
    cfg = tiny_config(**model, **overrides, **{"reward.function": "gsm8k"})
    _, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      validate(build.resolve_config(cfg, tokenizer), mesh_lib.make_mesh(
          mesh_lib.MeshConfig(data=8)))
    assert ("config.reward.function='gsm8k' not used: reward.kind='model': the reward model "
            "scores every sample\n" in caplog.text), caplog.text
