"""Cheap tests from a sixth mutation audit (data/, models/hf_loader.py, trainer/async_ppo.py,
trainer/sim_plan.py, sim/plan_search.py: 176 hand-made mutants, 100 killed by the suite, 3
equivalent) and from an audit of trainer/ (loop, ppo, update, hooks, build, evaluation: the
sections so named, mutant ids Lnn, Pnn, Unn, Hnn, Bnn, Enn): each test fails under the plausible
bug named in its docstring (the audit's mutant id) that the rest of the suite let through, and
passes on the code as it is."""
import json
import os

import numpy as np
import pytest

from rlhfuse_jax.data import chat
from rlhfuse_jax.data import records
from rlhfuse_jax.data import rewards
from rlhfuse_jax.data import tasks
from rlhfuse_jax.data import verifiers


# data/verifiers.py, data/rewards.py --------------------------------------------------------------

def test_a_math_solution_answer_is_graded_by_its_last_box_only():
  """A MATH solution as the answer is graded by its last \\boxed{} alone, like the response: its
  boxes are not joined into a set ({5, 12} != 12). (V11)"""
  answer = "\\boxed{5} is wrong; the answer is \\boxed{12}"
  assert verifiers.math_answer("so \\boxed{12}", answer, {}) == 1.0


def test_every_reward_function_that_reads_the_answer_requires_one():
  """The registered reward functions that fail on a record without an answer are exactly
  NEEDS_ANSWER, so a dataset lacking one is refused when it is loaded, not at the first
  reward. (V12, W6)"""
  tok = tasks.make_task("repeat").tokenizer
  ids, lens = np.array([[3, 2]]), np.array([2])
  for name, fn in rewards.REWARD_FUNCTIONS.items():
    try:
      fn([{"prompt": "p"}], ids, lens, tok)
      reads = False
    except ValueError as e:
      reads = True
      # Refused for the missing answer, not another ValueError on the way (gsm8k parsing
      # str(None) failed with "holds no number"). Said how: a new verifier's author (an
      # AttributeError on None.strip()) got only the two messages it was not.
      assert ("needs a string 'target'" in str(e) or
              "needs the sample's answer as a string" in str(e)), (
          f"reward function {name!r} fails without an answer, but not by refusing the missing "
          f"answer: read it through verifiers._required(answer) (a verifier), or check "
          f"record['target'] as rewards.target_ids does. It raised: {e}")
    assert reads == (name in rewards.NEEDS_ANSWER), (
        f"reward function {name!r} {'fails' if reads else 'does not fail'} without an answer "
        f"but is {'not ' if reads else ''}in rewards.NEEDS_ANSWER: "
        f"{'add' if reads else 'remove'} it there (a verifier: in verifiers.NEEDS_ANSWER)")


# data/records.py ---------------------------------------------------------------------------------

def test_a_null_prompt_is_a_missing_prompt(tmp_path):
  """A row whose prompt is null is refused, with the hint to set prompt_key (R6); named as null,
  not as a missing field beside a key list that holds it (a review's 2026-12-01 finding)."""
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"prompt": None, "question": "q"}) + "\n")
  with pytest.raises(ValueError, match=r"d.jsonl:1: prompt field 'prompt' is null on this row "
                                       r"\(keys: \['prompt', 'question'\]\).*prompt_key"):
    records.load_records(str(path))


def test_float16_answers_read_back_as_written(tmp_path):
  """A float16 parquet column's 0.1 is '0.1', not its widening 0.0999755859375. (R11)"""
  # pyarrow is a requirement (requirements.txt): without it this fails rather than skips.
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  table = pa.table({"prompt": ["a", "b"],
                    "f16": pa.array(np.array([0.1, 2.5], np.float16), pa.float16())})
  pq.write_table(table, str(tmp_path / "h.parquet"))
  got = records.load_records(str(tmp_path / "h.parquet"), answer_key="f16")
  assert [r["target"] for r in got] == ["0.1", "2.5"]


# data/chat.py ------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["{% set ns = namespace(_x=1) %}{{ messages }}",
                                    "{% set ns = namespace(a=1) %}{% set ns._x = 2 %}"
                                    "{{ messages }}"])
def test_a_template_cannot_store_underscore_attributes_in_a_namespace(source):
  """namespace() refuses underscore-prefixed attributes, single underscore included. (C3, C9)"""
  with pytest.raises(chat.ChatTemplateError, match="underscore"):
    chat.ChatTemplate(source).render("hi")


def test_a_negative_response_length_is_refused():
  """response_extent refuses a length below 0 as it refuses one past T (a negative length
  otherwise scores 0 silently). (W1)"""
  with pytest.raises(ValueError, match=r"response_lengths must lie in \[0, T=2\]"):
    rewards.response_extent(np.array([[5, 2]]), np.array([-1]), 2)


def test_exact_match_strips_the_target_too():
  """exact_match compares whitespace-stripped text on both sides: a dataset's target with a
  trailing newline still matches. (W4)"""
  tok = tasks.make_task("repeat").tokenizer
  ids = np.array([tok.encode("1 1", add_bos=False) + [tok.eos_id]])
  got = rewards.exact_match([{"target": " 1 1\n"}], ids, np.array([ids.shape[1]]), tok)
  np.testing.assert_array_equal(got, [1.0])


def test_target_match_with_a_target_longer_than_the_response_budget():
  """A target longer than the generated width T (max_new_tokens below the target's length)
  scores the matching prefix over the target's length, without a shape error. (W8)"""
  tok = tasks.make_task("repeat").tokenizer
  one = tok.encode("1", add_bos=False)[0]
  got = rewards.target_match([{"target": "1 1 1"}], np.array([[one, one]]), np.array([2]), tok)
  np.testing.assert_allclose(got, [2 / 4])  # 2 right of 4 target ids (3 symbols + EOS)


def test_a_target_that_is_not_text_is_named_by_record():
  """A record whose 'target' is a number (not text) is refused naming the record, before the
  tokenizer sees it. (W9)"""
  tok = tasks.make_task("repeat").tokenizer
  with pytest.raises(ValueError, match=r"record 0 needs a string 'target'.*got int"):
    rewards.target_match([{"target": 12}], np.array([[2]]), np.array([1]), tok)


class _WordTokenizer:
  """id i decodes to WORDS[i]; 0 is EOS."""
  WORDS = ["<eos>", "a", "</think>", " 5"]
  eos_id, stop_ids, vocab_size, special_ids = 0, (0,), 4, frozenset({0})

  def decode(self, ids, skip_special_tokens=True):
    return "".join(self.WORDS[i] for i in ids)


def test_a_per_sample_reward_sees_the_whole_record_with_its_rendered_prompt():
  """think_format through the registered batch function: the record handed to it keeps
  _prompt_text, so a prompt that opened the think block is honoured. (W10)"""
  ids, lens = np.array([[1, 2, 3, 0]]), np.array([4])  # "a</think> 5" + EOS
  record = {"prompt": "q", records.PROMPT_TEXT_KEY: "<|user|>q<|assistant|><think>\n"}
  got = rewards.REWARD_FUNCTIONS["think_format"]([record], ids, lens, _WordTokenizer())
  np.testing.assert_array_equal(got, [1.0])


def test_a_negative_epoch_in_a_saved_stream_position_is_refused():
  """load_state_dict refuses epoch < 0 by name (it would fail later, inside numpy). (P8)"""
  from rlhfuse_jax.data import prompts
  tok = tasks.make_task("repeat").tokenizer
  ds = prompts.PromptDataset([{"prompt": "1 #2 ="}], tok, batch_size=1, max_prompt_len=4)
  with pytest.raises(ValueError, match="epoch=-1"):
    ds.load_state_dict({**ds.state_dict(), "epoch": -1})


# data/tasks.py -----------------------------------------------------------------------------------

def test_a_task_with_one_symbol_is_refused():
  """num_symbols must be 2..10: one symbol makes every prompt of repeat/count_up the same. (T1)"""
  with pytest.raises(ValueError, match="num_symbols=1: expected 2..10"):
    tasks.make_task("repeat", num_symbols=1)


def test_make_task_applies_overrides_to_a_task_config():
  """make_task(TaskConfig, **overrides) replaces those fields. (T7)"""
  task = tasks.make_task(tasks.TaskConfig(name="repeat"), num_symbols=3)
  assert task.config.num_symbols == 3


@pytest.mark.parametrize("name", ["repeat", "count_up"])
def test_every_symbol_starts_some_prompt(name):
  """The first symbol is drawn uniformly from all num_symbols, the last one included. (T8)"""
  recs = tasks.make_task(name, num_symbols=3).make_prompts(200, 0)
  assert {r["symbol"] for r in recs} == {0, 1, 2}


def test_a_numpy_integer_seed_is_a_seed():
  """make_prompts takes a numpy integer as a seed, like an int. (T9)"""
  task = tasks.make_task("sort")
  assert task.make_prompts(4, np.int64(7)) == task.make_prompts(4, 7)


# data/tokenizer.py -------------------------------------------------------------------------------

def _word_level():
  import tokenizers
  from tokenizers import models, pre_tokenizers
  tok = tokenizers.Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "a": 3}))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return tok


@pytest.mark.parametrize("kw, match", [
    (dict(eos_id=-1), r"eos_id=-1 is outside the vocabulary"),
    (dict(eos_id=2, pad_id=-1), r"pad_id=-1 is outside the vocabulary"),
    # One past the last of the 4 ids: the embedding has no such row.
    (dict(eos_id=4), r"eos_id=4 is outside the vocabulary \[0, 4\)"),
    (dict(eos_id=2, bos_id=4), r"bos_id=4 is outside the vocabulary \[0, 4\)"),
    (dict(eos_id=2, extra_eos_ids=(True,)), r"extra_eos_ids has True"),
    (dict(eos_id=2, add_bos=True), r"add_bos=True but the tokenizer has no bos_id"),
])
def test_special_ids_are_checked_when_the_tokenizer_is_made(kw, match):
  """Negative ids, a bool among extra_eos_ids and add_bos without a BOS are refused at
  construction, not at the first encode or stop check. (K1, K2, K4)"""
  from rlhfuse_jax.data.tokenizer import HFTokenizer
  with pytest.raises(ValueError, match=match):
    HFTokenizer(_word_level(), **kw)


def test_the_pad_id_defaults_to_the_eos_id():
  """Without a pad id the tokenizer pads with EOS (as documented), not with id 0. (K3)"""
  from rlhfuse_jax.data.tokenizer import HFTokenizer
  assert HFTokenizer(_word_level(), eos_id=2).pad_id == 2


def test_added_tokens_that_are_not_special_stay_in_decoded_responses():
  """special_ids holds the added tokens marked special only: a non-special added token (Qwen's
  <think>) is text, kept by decode_responses, not a U+FFFD separator. (K10)"""
  from rlhfuse_jax.data.tokenizer import HFTokenizer
  raw = _word_level()
  raw.add_special_tokens(["</s>"])
  raw.add_tokens(["<think>"])
  tok = HFTokenizer(raw, eos_id=2)
  think = tok.token_to_id("<think>")
  assert tok.special_ids == frozenset({2})
  text, = rewards.decode_responses(np.array([[think, 3, 2]]), np.array([3]), tok)
  assert "\ufffd" not in text and "<think>" in text


def test_a_negative_generation_config_eos_id_names_the_file(tmp_path):
  """generation_config.json's eos_token_id must be ids >= 0; the error names that file. (K7)"""
  from rlhfuse_jax.data.tokenizer import HFTokenizer
  _word_level().save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, -1]}))
  with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id=\[2, -1\]"):
    HFTokenizer.from_file(str(tmp_path), eos_token="</s>")


def test_an_eos_in_the_base_vocabulary_is_found_without_a_config(tmp_path):
  """With no tokenizer_config.json, a well-known EOS name in the base vocabulary (not an added
  token) is the EOS. (K13)"""
  from rlhfuse_jax.data.tokenizer import HFTokenizer
  _word_level().save(str(tmp_path / "tokenizer.json"))
  assert HFTokenizer.from_file(str(tmp_path)).eos_id == 2


# data/lengths.py ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [(dict(min_len=0), "min_len=0: expected >= 1"),
                                       (dict(kind="lognormal", sigma=0.0), "sigma=0.0"),
                                       (dict(kind="lognormal", mu=float("inf")), "mu=inf")])
def test_length_distribution_refusals_at_their_limits(kw, match):
  """min_len 0, sigma 0 and an infinite mu are refused. (L1, L3, L4)"""
  from rlhfuse_jax.data.lengths import LengthDistribution
  with pytest.raises(ValueError, match=match):
    LengthDistribution(**kw)


@pytest.mark.parametrize("kind", ["uniform", "lognormal"])
def test_a_length_distribution_of_one_length(kind):
  """min_len == max_len is a valid, constant distribution. (L2)"""
  from rlhfuse_jax.data.lengths import LengthDistribution
  got = LengthDistribution(kind=kind, min_len=3, max_len=3).sample(np.random.default_rng(0), 5)
  np.testing.assert_array_equal(got, 3)


# models/hf_loader.py -----------------------------------------------------------------------------

_FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _llama_hf_config():
  with open(os.path.join(_FIXTURES, "tiny_llama", "config.json")) as f:
    return json.load(f)


def test_llama3_rope_with_equal_band_factors_is_refused_naming_the_config():
  """low_freq_factor == high_freq_factor (the band edges' division by zero) is refused by the
  loader itself, naming config.json's field, not only later by ModelConfig. (M3)"""
  from rlhfuse_jax.models import hf_loader
  hf = dict(_llama_hf_config(), rope_parameters={
      "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0,
      "high_freq_factor": 2.0, "original_max_position_embeddings": 64})
  with pytest.raises(ValueError, match=r"^ckpt/config.json: rope_parameters has factor=8.0, "
                                       r"low_freq_factor=2.0, high_freq_factor=2.0"):
    hf_loader.config_from_hf(hf, "ckpt/config.json")


def test_the_transformers_5_dtype_wins_over_a_legacy_torch_dtype():
  """config.json with both `dtype` (transformers 5) and a different legacy `torch_dtype`: the
  model's dtype is `dtype`'s. (M8)"""
  from rlhfuse_jax.models import hf_loader
  hf = dict(_llama_hf_config(), dtype="bfloat16", torch_dtype="float32")
  cfg = hf_loader.config_from_hf(hf)
  assert (cfg.param_dtype, cfg.dtype) == ("bfloat16", "bfloat16")


def test_a_boolean_pad_token_id_is_refused():
  """pad_token_id=true is not token 1. (M12)"""
  from rlhfuse_jax.models import hf_loader
  hf = dict(_llama_hf_config(), architectures=["LlamaForSequenceClassification"],
            pad_token_id=True)
  with pytest.raises(ValueError, match="pad_token_id=True"):
    hf_loader.config_from_hf(hf)


def test_nonfinite_bfloat16_weights_in_a_checkpoint_are_refused(tmp_path):
  """A NaN in a bfloat16 tensor (the usual checkpoint dtype; numpy does not count bfloat16 as
  floating) names the file and the tensor. (M13)"""
  import shutil
  import ml_dtypes
  import safetensors.numpy
  from rlhfuse_jax.models import hf_loader
  dst = str(tmp_path / "ckpt")
  shutil.copytree(os.path.join(_FIXTURES, "tiny_qwen2"), dst)
  path = os.path.join(dst, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  name = "model.layers.0.mlp.up_proj.weight"
  tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)
  tensors[name].flat[5] = np.nan
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=rf"tensor {name} holds 1 non-finite"):
    hf_loader.load_hf_params(dst, hf_loader.load_hf_config(dst))


def test_a_fresh_value_head_is_drawn_at_the_models_init_scale():
  """A scalar head for a checkpoint without score.weight is drawn as llama.init_params draws it
  (normal with std 0.02), not at unit scale: the critic's first values stay near 0. (M18)"""
  import jax
  from rlhfuse_jax.models import hf_loader
  ckpt = os.path.join(_FIXTURES, "tiny_llama")
  cfg = hf_loader.load_hf_config(ckpt, head="scalar")
  w = hf_loader.load_hf_params(ckpt, cfg, rng=jax.random.key(3))["head"]["value_head"]
  assert 0.01 < float(np.std(w)) < 0.04


def test_a_llama_with_attention_biases_exports_as_llama():
  """q/k/v and o biases (attention_bias=true) are HF Llama, not Qwen2 (q/k/v only). (M20)"""
  from rlhfuse_jax.models import hf_loader
  cfg = hf_loader.config_from_hf(dict(_llama_hf_config(), attention_bias=True))
  assert hf_loader.hf_family(cfg) == "llama"
  assert hf_loader.hf_config_dict(cfg)["attention_bias"] is True


def test_a_reward_models_pad_id_of_zero_is_exported():
  """score_pad_id 0 (Llama-2-style <unk>/<pad> = 0) is written as pad_token_id and read back:
  dropping it would make the reward model score the last token, padding included. (M21)"""
  from rlhfuse_jax.models import hf_loader
  hf = dict(_llama_hf_config(), architectures=["LlamaForSequenceClassification"],
            pad_token_id=0)
  cfg = hf_loader.config_from_hf(hf)
  assert cfg.score_pad_id == 0
  out = hf_loader.hf_config_dict(cfg)
  assert out["pad_token_id"] == 0 and hf_loader.config_from_hf(out).score_pad_id == 0


def test_load_hf_params_head_argument_picks_the_tree():
  """load_hf_params(head='scalar') on an LM config returns a value head (the argument wins
  over cfg.head). (M23)"""
  import jax
  from rlhfuse_jax.models import hf_loader
  ckpt = os.path.join(_FIXTURES, "tiny_llama")
  params = hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt), head="scalar",
                                    rng=jax.random.key(0))
  assert "value_head" in params["head"] and "lm_head" not in params["head"]


def test_max_positions_defaults_like_the_config(tmp_path):
  """A config.json without max_position_embeddings: max_positions (what validate checks a run's
  context against) is config_from_hf's 2048. (M24)"""
  from rlhfuse_jax.models import hf_loader
  hf = _llama_hf_config()
  hf.pop("max_position_embeddings", None)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  assert hf_loader.max_positions(str(tmp_path)) == 2048 == hf_loader.config_from_hf(hf).max_seq_len
  # A value that is not an integer is refused as config_from_hf refuses it, naming the file
  # (null raised a bare TypeError, which the trainer's load_named does not name either).
  for value, match in ((None, "null"), ("4096", "'4096' \\(str\\)")):
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, max_position_embeddings=value)))
    with pytest.raises(ValueError, match=f"config.json: max_position_embeddings={match}"):
      hf_loader.max_positions(str(tmp_path))


def test_two_architectures_are_refused():
  """architectures must name exactly one class. (M25)"""
  from rlhfuse_jax.models import hf_loader
  hf = dict(_llama_hf_config(),
            architectures=["LlamaForCausalLM", "LlamaForSequenceClassification"])
  with pytest.raises(ValueError, match="architectures=.* is not supported"):
    hf_loader.config_from_hf(hf)


def test_rope_type_wins_over_the_legacy_type_key():
  """A rope object with both `rope_type` and a legacy `type` is read by `rope_type`, as
  transformers does. (M28)"""
  from rlhfuse_jax.models import hf_loader
  hf = _llama_hf_config()
  hf.pop("rope_parameters", None)
  hf.update(rope_theta=5e5, rope_scaling={
      "rope_type": "llama3", "type": "default", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
  assert hf_loader.config_from_hf(hf).rope_type == "llama3"


def test_a_config_without_a_dtype_is_float32():
  """No dtype and no torch_dtype: float32, transformers' default. (M29)"""
  from rlhfuse_jax.models import hf_loader
  hf = _llama_hf_config()
  for k in ("dtype", "torch_dtype"):
    hf.pop(k, None)
  cfg = hf_loader.config_from_hf(hf)
  assert (cfg.param_dtype, cfg.dtype) == ("float32", "float32")


def test_a_score_bias_of_the_wrong_shape_is_refused(tmp_path):
  """score.bias must be [1] (num_labels 1), like score.weight's rows. (M30)"""
  import jax
  import safetensors.numpy
  from rlhfuse_jax.models import hf_loader
  ckpt = os.path.join(_FIXTURES, "tiny_llama")
  cfg = hf_loader.load_hf_config(ckpt, head="scalar")
  params = hf_loader.load_hf_params(ckpt, cfg, rng=jax.random.key(0))
  params["head"]["value_bias"] = np.full((1,), 0.5, np.float32)
  out = str(tmp_path / "rm")
  hf_loader.save_hf_checkpoint(params, cfg, out)
  path = os.path.join(out, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  tensors["score.bias"] = np.full((2,), 0.5, tensors["score.bias"].dtype)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"score.bias has shape \[2\]"):
    hf_loader.load_hf_params(out, hf_loader.load_hf_config(out))


# sim/plan_search.py ------------------------------------------------------------------------------

def test_pipelined_generation_reserves_kv_for_the_longest_prompt():
  """The memory check sizes every slot for the longest prompt + max_new_tokens (a slot must
  hold any sample), not the mean: one 20k-token prompt among short ones does not fit one
  H100 with 13B. (Q2)"""
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  from rlhfuse_jax.sim.shapes import get_shape
  cost, actor = CostModel(get_hardware("h100_sxm")), get_shape("llama-13b")
  prompts = np.array([1] * 7 + [20000])
  ok = ps.pipelined_generation(cost, actor, 1, 1, 1, 1, np.full(8, 2500), np.full(8, 4), 16)
  assert ok["gen_s"] > 0  # the mean's worth of KV fits
  with pytest.raises(ValueError):
    ps.pipelined_generation(cost, actor, 1, 1, 1, 1, prompts, np.full(8, 4), 16)


def test_pipelined_generation_steps_only_the_rows_still_generating():
  """Decode step k (k >= 1) runs the rows with more than k tokens to make: rows needing 2 and
  5 tokens run together at step 1, the long one alone at steps 2..4. (Q6)"""
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  from rlhfuse_jax.sim.shapes import get_shape
  cost, actor = CostModel(get_hardware("h100_sxm")), get_shape("llama-13b")
  got = ps.pipelined_generation(cost, actor, 1, 1, 1, 1, np.array([100, 100]),
                                np.array([2, 5]), 8)
  st = ps.stage_shape(actor, 1)
  want = cost.prefill_s(st, 1, [100, 100]) + float(cost.decode_step_s(st, 1, 2, 101 + 101))
  want += sum(float(cost.decode_step_s(st, 1, 1, 100 + k)) for k in range(2, 5))
  assert got["gen_s"] == pytest.approx(want, rel=1e-9)


def test_pipelined_generation_ends_with_its_slowest_replica():
  """Replicas run side by side: the batch's generation time is the slowest replica's (here the
  one holding the 9-token response), not their mean. (Q8)"""
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  from rlhfuse_jax.sim.shapes import get_shape
  cost, actor = CostModel(get_hardware("h100_sxm")), get_shape("llama-13b")
  both = ps.pipelined_generation(cost, actor, 2, 1, 1, 1, np.array([100, 100]),
                                 np.array([2, 9]), 16)
  slow = ps.pipelined_generation(cost, actor, 1, 1, 1, 1, np.array([100]), np.array([9]), 16)
  assert both["replicas"] == 2 and both["gen_s"] == pytest.approx(slow["gen_s"], rel=1e-12)


def test_a_forward_pipeline_pays_its_fill():
  """inference_stage_s on a pp-stage forward pipeline: its micro-batches' stage times plus a
  fill of pp - 1 of the longest. Two micro-batches of one 100-token sequence, pp 2: 3 stage
  times. (Q10)"""
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  from rlhfuse_jax.sim.shapes import get_shape
  cost, actor = CostModel(get_hardware("h100_sxm")), get_shape("llama-13b")
  one = float(cost.inference_s([ps.stage_shape(actor, 2)], 1, np.array([100.0])))
  got = ps.inference_stage_s(cost, (actor,), 2, 1, 2, np.array([100, 100]), 1, False)
  assert got == pytest.approx(3 * one, rel=1e-12)


def _small_7b_workload(batch):
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim.lengths import LengthSpec
  from rlhfuse_jax.sim.shapes import get_shape
  return it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-7b", "scalar"),
                     num_devices=8, global_batch=batch, minibatch=batch, max_new_tokens=16,
                     prompt=LengthSpec(kind="uniform", min_len=8, max_len=16),
                     response=LengthSpec(kind="uniform", min_len=1, max_len=16))


def test_runnable_instances_get_the_rounded_up_share_of_the_batch():
  """With sim.trainer_runnable an instance plan gets ceil(batch / instances) slots, what
  trainer_refusal demands: 36 prompts on 8 instances need 5 slots each, not 4. (Q12)"""
  import dataclasses
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  cost = CostModel(get_hardware("h100_sxm"))
  wl = _small_7b_workload(36)
  opt = dataclasses.replace(it.SimOptions(trainer_runnable=True), gen_tps=(1,))
  prompts, resp = wl.sample_lengths()
  gens = ps.generation_candidates(cost, wl, opt, prompts, resp, {}, pps=())
  assert [c.plan.slots for c in gens if c.plan.mode == "instances"] == [5]


def test_pipeline_generation_candidates_try_g_of_pp_and_2pp():
  """Each generation pipeline is tried with G = pp and G = 2 pp groups. (Q13)"""
  import dataclasses
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  cost, wl = CostModel(get_hardware("h100_sxm")), _small_7b_workload(32)
  opt = dataclasses.replace(it.SimOptions(), gen_tps=(1,))
  prompts, resp = wl.sample_lengths()
  gens = ps.generation_candidates(cost, wl, opt, prompts, resp, {}, pps=(2,))
  assert sorted(c.plan.groups for c in gens if c.plan.mode == "pipeline") == [2, 4]


def test_a_colocated_rescore_runs_the_actor_then_the_critic():
  """Async PPO's rescore on a colocated training layout: the actor's forward pipeline, then
  the critic's, on the same devices (a sum, not a max). (Q17)"""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  cost, wl = CostModel(get_hardware("h100_sxm")), _small_7b_workload(32)
  opt = it.SimOptions()
  seq = np.full(32, 64.0)
  plan = {"placement": "colocated", "devices": 8, "tp": 2, "actor_pp": 2, "critic_pp": 1}
  a = ps.inference_stage_s(cost, (wl.actor,), 8, 2, 2, seq, opt.inference_microbatch, False)
  c = ps.inference_stage_s(cost, (wl.critic,), 8, 2, 1, seq, opt.inference_microbatch, False)
  assert ps.rescore_s(cost, wl, plan, seq, opt) == pytest.approx(a + c, rel=1e-12)


def _refusal_case():
  """13B actor and critic on 16 devices, batch 32, mini-batch 16, and a plan the trainer runs."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim.lengths import LengthSpec
  from rlhfuse_jax.sim.shapes import get_shape
  wl = it.Workload(actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar"),
                   num_devices=16, global_batch=32, minibatch=16, max_new_tokens=64,
                   prompt=LengthSpec(kind="uniform", min_len=8, max_len=64),
                   response=LengthSpec(kind="uniform", min_len=1, max_len=64))
  ok = {"generation": {"mode": "instances", "tp": 2, "pp": 1, "groups": 1, "slots": 4},
        "inference": {"tp": 2, "pp": 1},
        "training": {"placement": "colocated", "tp": 2, "actor_pp": 2, "critic_pp": 1}}
  return wl, ok


def test_trainer_refusal_rules_at_their_edges():
  """trainer_refusal's rules where the existing hand-made cases do not reach: a colocated plan
  needs no batch split over the devices (Q19); Pc must divide Pa (Q20); G >= pp (Q23);
  inference pp must divide the instances (Q24; it had to be 1 until the trainer scored on
  pipelines of instances); slots are the rounded-up share of a batch that does not
  divide over the instances (Q22); a critic with fewer KV heads than tp devices trains
  (Megatron-style split, Q21)."""
  import dataclasses
  from rlhfuse_jax.sim import plan_search as ps
  wl, ok = _refusal_case()
  assert ps.trainer_refusal(dataclasses.replace(wl, global_batch=24, minibatch=8),
                            {**ok, "generation": {**ok["generation"], "slots": 3}}) is None
  gqa = dataclasses.replace(wl, critic=dataclasses.replace(wl.critic, num_kv_heads=1))
  assert ps.trainer_refusal(gqa, ok) is None
  pipe = {"mode": "pipeline", "tp": 1, "pp": 8, "groups": 4, "slots": 32}
  split = {"generation_devices": 8, "training_devices": 8, "staleness": 1, "colocated": False}
  for change, match in [
      ({"training": {**ok["training"], "critic_pp": 4}}, "Pa/Pc=2/4"),
      ({"generation": pipe, "async": split}, "pp8, G=4"),
      # (pipelines of instances since 2026-12-05 (bm): pp must divide the 8 instances)
      ({"inference": {"tp": 2, "pp": 3}}, "inference pipelines of pp3 on 8 instances"),
  ]:
    why = ps.trainer_refusal(wl, {**ok, **change})
    assert why is not None and match in why, (change, why)
  assert ps.trainer_refusal(wl, {**ok, "inference": {"tp": 2, "pp": 2}}) is None
  # on hosts of 4 devices: 2 tp2 instances a host (process), which pp 4 cannot pair up
  why = ps.trainer_refusal(wl, {**ok, "inference": {"tp": 2, "pp": 4}}, host_devices=4)
  assert why is not None and "pp4 on 4 generation devices a process (4 hosts of 4" in why, why
  assert ps.trainer_refusal(wl, {**ok, "inference": {"tp": 2, "pp": 2}}, host_devices=4) is None
  # an instance wider than a host: named as the instance's error, not a pipeline's
  wide = {**ok, "generation": {**ok["generation"], "tp": 8, "slots": 16},
          "inference": {"tp": 8, "pp": 1}}
  assert ps.trainer_refusal(wl, wide) is None
  why = ps.trainer_refusal(wl, wide, host_devices=4)
  assert why is not None and why.startswith("generation instances of tp8 on 4 generation "
                                            "devices a process (4 hosts of 4"), why
  # an asynchronous group of 8 of the 16 devices on 2 hosts of 8: 4 devices, 2 tp2 instances a
  # process (trainer/async_ppo.split_devices), which pp 4 cannot pair up either
  split8 = {"generation_devices": 8, "training_devices": 8, "staleness": 1, "colocated": False}
  group = {**ok, "async": split8, "generation": {**ok["generation"], "slots": 8}}
  assert ps.trainer_refusal(wl, {**group, "inference": {"tp": 2, "pp": 2}}, 8) is None
  why = ps.trainer_refusal(wl, {**group, "inference": {"tp": 2, "pp": 4}}, 8)
  assert why is not None and "pp4 on 4 generation devices a process (2 hosts" in why, why
  odd = dataclasses.replace(wl, critic=dataclasses.replace(wl.critic, num_layers=30))
  why = ps.trainer_refusal(odd, {**ok, "inference": {"tp": 2, "pp": 4}})
  assert why is not None and why.endswith(f": not {odd.critic.name}'s)"), why
  why = ps.trainer_refusal(dataclasses.replace(wl, global_batch=36, minibatch=12), ok)
  assert why is not None and "4 slots per instance for a batch of 36 on 8 instances" in why


def test_runnable_stops_at_top_k():
  """_runnable returns the first top_k plans the checks let through, no more. (Q25)"""
  import dataclasses
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  wl, ok = _refusal_case()
  opt = dataclasses.replace(it.SimOptions(), trainer_runnable=True)
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  cost = CostModel(get_hardware("h100_sxm"))
  # (instances of tp4: at tp2 the three frozen 13B models do not fit beside the training state)
  ok = {**ok, "generation": {**ok["generation"], "tp": 4, "slots": 8},
        "inference": {"tp": 4, "pp": 1}}
  assert ps.trainer_refusal(wl, ok) is None
  assert ps._memory_refusal(cost, wl, opt, ok) is None  # pylint: disable=protected-access
  got = ps._runnable(cost, wl, opt, [ok] * 5, None, 2, {})  # pylint: disable=protected-access
  assert len(got) == 2


# trainer/sim_plan.py -----------------------------------------------------------------------------

def test_the_workload_takes_the_micro_batch_and_clips_responses_to_the_budget(tmp_path):
  """sim_plan.workload: the caller's micro-batch (experiments/plan_search passes its own) is
  the workload's (S5); target lengths past rollout.max_new_tokens are clipped to it, in the
  length file and the report (S1, S6)."""
  from configs import ppo_tiny
  from rlhfuse_jax.trainer import build, sim_plan
  from rlhfuse_jax.trainer.config import TrainConfig
  c = ppo_tiny.get_config()
  c.rollout.max_new_tokens = 5  # 'repeat' targets are 2..9 tokens with the EOS
  cfg = TrainConfig.from_config_dict(c)
  task, tok = build.build_task_and_tokenizer(cfg)
  cfg = build.resolve_config(cfg, tok)
  wl, info = sim_plan.workload(cfg, task, tok, 8, str(tmp_path), micro_batch=4)
  assert wl.micro_batch == 4 and wl.max_new_tokens == 5
  assert (info["response_lengths"]["min"], info["response_lengths"]["max"]) == (2, 5)
  assert np.loadtxt(tmp_path / "response_lengths.txt").max() == 5


def test_the_plan_check_counts_an_async_plans_generation_group(tmp_path):
  """PlanCheck validates an asynchronous plan against its generation group's devices (2 of 6
  here: 32 slots each for 64 samples), not the training group's 4. (S7)"""
  import jax
  from configs import ppo_tiny
  from rlhfuse_jax.trainer import build, sim_plan
  from rlhfuse_jax.trainer.config import TrainConfig
  c = ppo_tiny.get_config()
  _, tok = build.build_task_and_tokenizer(TrainConfig.from_config_dict(c))
  check = sim_plan.PlanCheck(c, jax.devices()[:6], tok, str(tmp_path))
  plan = {"generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 16},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "tp": 1, "actor_pp": 1, "critic_pp": 1},
          "async": {"generation_devices": 2, "training_devices": 4, "staleness": 1,
                    "colocated": False}}
  assert "generation_slots=16: expected >= 32" in check(plan)
  assert check({**plan, "generation": {**plan["generation"], "slots": 32}}) is None
  assert not os.path.exists(check.path)  # the plan file is removed after each check


def test_the_plan_check_keeps_the_plan_fields_the_config_pins(tmp_path):
  """A config that pins config.plan.generation_slots: the check writes only plan.file into
  the config's plan section, so a plan with other slots is refused as the trainer refuses it.
  (S9)"""
  import jax
  from configs import ppo_tiny
  from rlhfuse_jax.trainer import build, sim_plan
  from rlhfuse_jax.trainer.config import TrainConfig
  c = ppo_tiny.get_config()
  _, tok = build.build_task_and_tokenizer(TrainConfig.from_config_dict(c))
  c.plan.generation_slots = 64
  check = sim_plan.PlanCheck(c, jax.devices(), tok, str(tmp_path))
  plan = {"generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 8},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "tp": 1, "actor_pp": 1, "critic_pp": 1}}
  assert "config.plan.generation_slots=64 conflicts with config.plan.file" in check(plan)


def test_the_workload_takes_the_callers_seed(tmp_path):
  """sim_plan.workload's seed (experiments/plan_search passes config.seed) is the workload's,
  which draws its lengths. (S10)"""
  from configs import ppo_tiny
  from rlhfuse_jax.trainer import build, sim_plan
  from rlhfuse_jax.trainer.config import TrainConfig
  cfg = TrainConfig.from_config_dict(ppo_tiny.get_config())
  task, tok = build.build_task_and_tokenizer(cfg)
  cfg = build.resolve_config(cfg, tok)
  assert sim_plan.workload(cfg, task, tok, 8, str(tmp_path), seed=3)[0].seed == 3


# trainer/async_ppo.py ----------------------------------------------------------------------------

def test_behaviour_weights_clip_the_log_ratio_and_count_response_tokens_only():
  """behaviour_weights: an extreme log-ratio is clipped to exp(20) (no inf that would make the
  loss NaN without a cap, A3); the dropped fraction is over the response tokens, padding left
  out (A7); with no response token the max is 1 (A6)."""
  from rlhfuse_jax.trainer import async_ppo
  w, stats = async_ppo.behaviour_weights(np.array([[0.0, 0.0]]), np.array([[-800.0, 0.0]]),
                                         np.array([[1.0, 1.0]]), 0.0)
  assert np.all(np.isfinite(w)) and w[0, 0] == pytest.approx(np.exp(20.0), rel=1e-6)
  assert np.isfinite(stats["async/behaviour_weight_mean"])
  prox = np.log(np.array([[3.0, 1.0, 1.0, 1.0]]))
  _, stats = async_ppo.behaviour_weights(prox, np.zeros((1, 4)), np.array([[1, 1, 0, 0]]), 2.0)
  assert stats["async/behaviour_dropped_frac"] == pytest.approx(0.5)  # 1 of 2 response tokens
  _, stats = async_ppo.behaviour_weights(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)),
                                         2.0)
  assert stats["async/behaviour_weight_max"] == 1.0


def _small_13b_16():
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim.lengths import LengthSpec
  from rlhfuse_jax.sim.shapes import get_shape
  return it.Workload(actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar"),
                     num_devices=16, global_batch=32, minibatch=16, max_new_tokens=64,
                     prompt=LengthSpec(kind="uniform", min_len=8, max_len=64),
                     response=LengthSpec(kind="uniform", min_len=1, max_len=64))


def test_a_uniform_layout_keeps_the_frozen_models_over_all_its_devices():
  """sim.offload_frozen=False: a uniform (tp, pp) layout holds the frozen reference and reward
  model over its tp * pp devices (a pipeline's stages each hold their layers), so tp1 pp4 and
  tp1 pp8 fit 13B + 13B on 16 H100s. (Q29)"""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  wl = _small_13b_16()
  opt = it.SimOptions(gen_tps=(1, 2, 4, 8), offload_frozen=False)
  prompts, resp = wl.sample_lengths()
  rej = {}
  got = ps.uniform_candidates(CostModel(get_hardware("h100_sxm")), wl, opt, prompts, resp,
                              float((prompts + resp).mean()), rej)
  layouts = {(c.plan["tp"], c.plan["pp"]) for c in got}
  assert {(1, 4), (1, 8)} <= layouts, rej


def test_every_plan_costs_the_sum_of_its_stages():
  """Each top plan's iteration_s is its reshard + generation + inference + training, with the
  resharding of a plan on the training layout itself 0 (it must be ranked by that too). (Q30)"""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  from tests.test_sim_plan_search import small_workload
  wl = small_workload()
  res = ps.search(CostModel(get_hardware("h100_sxm")), wl, it.SimOptions(), top_k=2000)
  assert any(p["predicted"]["reshard_s"] == 0.0 for p in res["top"])
  for p in res["top"]:
    q = p["predicted"]
    assert q["iteration_s"] == pytest.approx(
        q["reshard_s"] + q["gen_s"] + q["inf_s"] + q["train_s"], rel=1e-12), p["summary"]


def test_an_async_split_picks_its_training_plan_with_the_rescore(monkeypatch):
  """Without trainer restrictions a split's training plan is the fastest *with* its rescore:
  1.0 s + 1.0 s of rescoring loses to 1.1 s + 0.1 s. (Q27)"""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  plan = lambda tp: {"placement": "colocated", "devices": 4, "tp": tp, "actor_pp": 1,  # noqa: E731
                     "critic_pp": 1}
  trains = [ps.Candidate(plan(1), 1.0, {"train_s": 1.0}),
            ps.Candidate(plan(2), 1.1, {"train_s": 1.1})]
  monkeypatch.setattr(ps, "training_candidates", lambda *a, **k: list(trains))
  monkeypatch.setattr(ps, "rescore_s", lambda cost, wl, p, seq, opt: 1.0 if p["tp"] == 1 else 0.1)
  wl = _small_7b_workload(32)
  sync_best = {"predicted": {"gen_s": 500.0, "inf_s": 0.0, "reshard_s": 0.0, "train_s": 500.0,
                             "iteration_s": 1000.0},
               # (its layouts: the colocated option's memory is checked, with the actor's copy)
               "generation": {"mode": "instances", "tp": 4, "pp": 1, "groups": 1, "slots": 8},
               "inference": {"tp": 4, "pp": 1},
               "training": {"placement": "colocated", "tp": 4, "actor_pp": 1, "critic_pp": 1}}
  res = ps.async_search(CostModel(get_hardware("h100_sxm")), wl, it.SimOptions(gen_tps=(1,)),
                        1, sync_best, split_unit=4)
  best = res["best"]
  assert not best["async"]["colocated"] and best["training"]["tp"] == 2
  assert best["predicted"]["train_s"] == pytest.approx(1.2)


def test_resharding_into_copies_smaller_than_a_node_pays_the_nvlink_fan_out():
  """On H800s (400 GB/s NVLink) a tp-1 generation copy spreads a node's copy to every device
  over NVLink, slower than its share of the scale-out network: reshard_s is that fan-out.
  (Q32)"""
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  cost, wl = CostModel(get_hardware("h800_sxm")), _small_13b_16()
  w = wl.actor.weight_bytes()
  fan_out = cost.p2p_s(w, cross_node=False)
  assert fan_out > cost.p2p_s(w / cost.hw.devices_per_node, cross_node=True)
  assert ps.reshard_s(cost, wl, 1) == pytest.approx(fan_out, rel=1e-12)


def test_the_stage_lists_shown_are_those_beside_the_best_plans_inference(monkeypatch):
  """With the frozen models kept on the devices, the reported generation and training lists
  are the ones beside the best plan's inference layout, not beside the fastest inference's
  (here tp 1, beside whose 92 GB of frozen weights nothing fits). (Q33)"""
  import dataclasses
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  from rlhfuse_jax.sim.lengths import LengthSpec
  from rlhfuse_jax.sim.shapes import get_shape
  wl = dataclasses.replace(_small_13b_16(), actor=get_shape("llama-33b"), global_batch=64,
                           minibatch=32, max_new_tokens=256,
                           response=LengthSpec(kind="uniform", min_len=1, max_len=256))
  infs = [ps.Candidate(ps.InferencePlan(1), 0.01, {"inf_s": 0.01}),
          ps.Candidate(ps.InferencePlan(4), 0.2, {"inf_s": 0.2})]
  monkeypatch.setattr(ps, "inference_candidates", lambda *a, **k: list(infs))
  res = ps.search(CostModel(get_hardware("h100_sxm")), wl,
                  it.SimOptions(gen_tps=(1, 2, 4, 8), offload_frozen=False))
  assert res["best"]["inference"]["tp"] == 4
  best = res["best"]["predicted"]
  assert res["stages"]["training"] and res["stages"]["training"][0][1] <= best["train_s"]
  assert any(s == pytest.approx(best["gen_s"] + best["reshard_s"])
             for _, s in res["stages"]["generation"])


def test_the_generation_group_is_data_parallel_whatever_the_training_mesh():
  """async_ppo.meshes: the training mesh is config.mesh over the training group; the
  generation group is data-parallel over its own devices (tensor-parallel training does not
  make the generation copy tensor-parallel). (A13)"""
  import jax
  from configs import ppo_tiny
  from rlhfuse_jax.trainer import async_ppo
  from rlhfuse_jax.trainer.config import TrainConfig
  c = ppo_tiny.get_config()
  c.async_ppo.staleness, c.async_ppo.generation_devices, c.mesh.tensor = 1, 4, 2
  train, gen = async_ppo.meshes(TrainConfig.from_config_dict(c), jax.devices()[:8])
  assert dict(train.shape)["tensor"] == 2 and train.devices.size == 4
  assert gen.devices.size == 4 and dict(gen.shape)["data"] == 4
  assert all(v == 1 for k, v in dict(gen.shape).items() if k != "data")


def test_an_in_flight_batchs_side_car_is_plain_json():
  """Generated.side_car turns numpy scalars and arrays in the stage's metrics into JSON values
  (the checkpoint's meta is JSON). (A12)"""
  from rlhfuse_jax.trainer import async_ppo
  z = np.zeros((1, 1))
  g = async_ppo.Generated(iteration=3, version=2, tokens=z, prompt_lens=z, response_tokens=z,
                          response_lens=z, logprobs=z, ref_logp=z, values=z, scores=z,
                          metrics={"t": np.float32(1.5), "n": np.int64(4), "h": np.arange(2),
                                   "nested": {"x": [np.float64(0.25)]}})
  back = json.loads(json.dumps(g.side_car()))
  assert back == {"iteration": 3, "version": 2,
                  "metrics": {"t": 1.5, "n": 4, "h": [0, 1], "nested": {"x": [0.25]}},
                  "ref_logp": True, "targets": None, "reward_terms": {}}


# trainer/loop.py (an eighth audit, of trainer/: mutant ids Lnn) ----------------------------------

def _fake_trainer(**fields):
  """What a PPOTrainer method reads of the trainer, nothing built (a SimpleNamespace), with the
  trainer's own mini-batch gather (_minibatch: host arrays sliced and put with `_put`)."""
  import types
  from rlhfuse_jax.trainer import loop
  fake = types.SimpleNamespace(_row_takers={}, **fields)
  # pylint: disable-next=protected-access
  fake._minibatch = lambda data, idx: loop.PPOTrainer._minibatch(fake, data, idx)
  return fake


def test_each_epoch_of_each_iteration_deals_the_rows_into_new_mini_batches():
  """PPOTrainer._dispatch_training: every epoch hands each of the rollout's rows to exactly one
  mini-batch, and every epoch of every iteration deals them anew (docs: mini-batch shuffles
  derive from (seed, iteration) and the epoch). Seeded by (seed, iteration) alone, each later
  epoch repeated the first one's mini-batches, in the same order. (L4)"""
  import types
  from rlhfuse_jax.trainer import loop
  seen = []

  def update(actor, critic, mb):
    seen.append(frozenset(np.asarray(mb["row"]).tolist()))
    return actor, critic, {}
  epochs, rows, size = 3, 16, 4
  fake = _fake_trainer(
      cfg=types.SimpleNamespace(seed=5, algo=types.SimpleNamespace(
          epochs=epochs, minibatch_size=size, balance_tokens=False)),
      update=update, _put=np.asarray, actor=None, critic=None, _compiled_update=True)
  partitions = []
  for iteration in (0, 1):
    seen.clear()
    out = loop.PPOTrainer._dispatch_training(  # pylint: disable=protected-access
        fake, iteration, {"row": np.arange(rows)}, np.full(rows, 7))
    assert len(out) == epochs * rows // size
    for e in range(epochs):
      epoch = seen[e * rows // size:(e + 1) * rows // size]
      assert sorted(r for mb in epoch for r in mb) == list(range(rows))  # each row once
      partitions.append(frozenset(epoch))
  # 6 dealings of 16 rows into 4 groups of 4: two equal by chance has odds ~4e-6.
  assert len(set(partitions)) == len(partitions)


def test_an_iterations_metrics_average_its_updates_and_count_its_steps():
  """PPOTrainer._metrics by hand: a training metric is the mean over the iteration's updates
  (the finite ones: a skipped step's NaN is left out), the rollout figures are those of its
  scores and lengths, a critic-free run logs no critic/ metric, and actor/lr is the schedule at
  the iteration's last optimizer step (updates x iterations so far, 0-based). Averaged over the
  first update alone, the figures were that update's. (L13, L8, L9, L12)"""
  import types
  from rlhfuse_jax.trainer import async_ppo
  from rlhfuse_jax.trainer import loop
  t, eos = 4, 2
  lens = np.array([4, 1, 4, 2], np.int32)
  response = np.array([[5, 5, 5, 5], [eos, 0, 0, 0], [5, 5, 5, eos], [5, eos, 0, 0]], np.int32)
  gen = async_ppo.Generated(
      iteration=2, version=2, tokens=np.zeros((4, 3 + t), np.int32),
      prompt_lens=np.full(4, 3, np.int32), response_tokens=response, response_lens=lens,
      logprobs=np.zeros((4, t), np.float32), ref_logp=np.zeros((4, t), np.float32),
      values=np.zeros((4, t), np.float32), scores=np.array([1.0, 0.0, 0.5, 0.5], np.float32),
      metrics={})
  fake = _fake_trainer(
      cfg=types.SimpleNamespace(guard=types.SimpleNamespace(on_nonfinite="skip_update"),
                                rollout=types.SimpleNamespace(max_new_tokens=t)),
      update=types.SimpleNamespace(schedule_metrics={}, actor_lr=lambda step: 0.01 * step,
                                   critic_lr=lambda step: 0.02 * step),
      sampling=types.SimpleNamespace(is_stop=lambda ids: ids == eos),
      _model_states=dict)
  # pylint: disable=protected-access
  fake._truncated = lambda g: loop.PPOTrainer._truncated(fake, g)
  fake._lrs = lambda *args: loop.PPOTrainer._lrs(fake, *args)
  train = [{"actor/pg_loss": np.float32(v), "critic/vf_loss": np.float32(2 * v)}
           for v in (1.0, np.nan, 5.0)]
  for use_critic in (True, False):
    fake.use_critic = use_critic
    m = loop.PPOTrainer._metrics(fake, 2, gen, train, {"kl/ref_mean": np.float32(0.25)}, {})
    assert m["actor/pg_loss"] == 3.0 and m["kl/ref_mean"] == 0.25
    assert ("critic/vf_loss" in m) == use_critic
    if use_critic:
      assert m["critic/vf_loss"] == 6.0
    assert m["reward/mean"] == 0.5 and m["reward/std"] == pytest.approx(np.sqrt(0.125))
    assert m["response_length/mean"] == 2.75 and m["response_length/max"] == 4
    assert m["response_length/clip_ratio"] == 0.25  # row 0 only: row 2 ended on its EOS
    assert m["gen/response_lengths"] == [4, 1, 4, 2]
    # 3 updates in each of iterations 0, 1, 2: the last is optimizer step 8 (0-based).
    assert m["actor/lr"] == pytest.approx(0.08)
    assert m.get("critic/lr") == (pytest.approx(0.16) if use_critic else None)


def test_the_validation_pass_keys_fold_the_training_iterations_key():
  """PPOTrainer._generate samples iteration i with the key the validation pass after iteration
  i folds VALIDATION_STREAM into (evaluation.py: the two streams meet only at the uid
  0x7A11D of that one iteration). A generation key of another iteration's (i + 1) broke that
  and repeated, at iteration i, the validation stream of iteration i - 1. (L3)"""
  import types
  import jax
  from rlhfuse_jax.trainer import evaluation
  from rlhfuse_jax.trainer import loop
  keys = []
  z = np.zeros((1, 1))

  def rollout(params, prompts, key):
    keys.append(key)
    return types.SimpleNamespace(
        batch=types.SimpleNamespace(tokens=z, prompt_lens=z[0], response_tokens=z),
        rollout=types.SimpleNamespace(response_lens=z[0], logprobs=z), ref_logp=z, values=z,
        scores=z[0], metrics={})
  fake = _fake_trainer(cfg=types.SimpleNamespace(seed=11), rollout=rollout,
                       _prompts=lambda iteration: types.SimpleNamespace(records=None))
  data = lambda k: np.asarray(jax.random.key_data(k))  # noqa: E731
  for i in (0, 1, 4):
    g = loop.PPOTrainer._generate(fake, i, None, version=i)  # pylint: disable=protected-access
    assert g.iteration == i and g.version == i
    np.testing.assert_array_equal(
        data(jax.random.fold_in(keys[-1], evaluation.VALIDATION_STREAM)),
        data(evaluation.validation_key(11, i)))


def test_token_balancing_evens_out_each_data_shards_tokens():
  """PPOTrainer._dispatch_training with algo.balance_tokens: each mini-batch's rows are ordered
  so that its contiguous split over the mesh's 4 data shards gives every shard the least
  possible most-tokens load (a brute force over the pairings); unbalanced, a shard often drew
  two long rows while another drew two short ones. (L5)"""
  import types
  import jax
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer import loop
  seen = []

  def update(actor, critic, mb):
    seen.append(np.asarray(mb["row"]))
    return actor, critic, {}
  counts = np.array([100] * 8 + [1] * 8)
  fake = _fake_trainer(
      cfg=types.SimpleNamespace(seed=0, algo=types.SimpleNamespace(
          epochs=4, minibatch_size=8, balance_tokens=True)),
      mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4]),
      update=update, _put=np.asarray, actor=None, critic=None, _compiled_update=True)
  loop.PPOTrainer._dispatch_training(  # pylint: disable=protected-access
      fake, 0, {"row": np.arange(16)}, counts)

  def pairings(rows):
    if not rows:
      yield []
      return
    for j in range(1, len(rows)):
      rest = rows[1:j] + rows[j + 1:]
      for p in pairings(rest):
        yield [(rows[0], rows[j])] + p
  assert len(seen) == 8
  for rows in seen:
    c = counts[rows]
    best = min(max(c[a] + c[b] for a, b in p) for p in pairings(list(range(8))))
    assert max(c[2 * s] + c[2 * s + 1] for s in range(4)) == best, c


def test_each_epoch_counts_in_the_updates_flops():
  """PPOTrainer._train_flops_metrics: algo.epochs passes over the rollout do epochs times the
  useful work in the same time, and the padded count grows alike, so the useful share stays.
  (The suite's runs have one epoch: the useful count without its epochs factor went
  unnoticed, and its share fell with each epoch.) (L25)"""
  import dataclasses
  import types
  from configs import ppo_tiny
  from rlhfuse_jax.trainer import async_ppo
  from rlhfuse_jax.trainer import loop
  from rlhfuse_jax.trainer.config import TrainConfig
  cfg = TrainConfig.from_config_dict(ppo_tiny.get_config())
  t = cfg.rollout.max_new_tokens
  gen = async_ppo.Generated(
      iteration=0, version=0, tokens=np.zeros((2, 5 + t), np.int32),
      prompt_lens=np.array([2, 5], np.int32), response_tokens=np.zeros((2, t), np.int32),
      response_lens=np.array([1, t], np.int32), logprobs=None, ref_logp=None, values=None,
      scores=None, metrics={})
  out = {}
  for epochs in (1, 3):
    fake = _fake_trainer(
        cfg=dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, epochs=epochs)),
        use_critic=True, mesh=types.SimpleNamespace(devices=np.array(
            [types.SimpleNamespace(device_kind="cpu")])))
    out[epochs] = loop.PPOTrainer._train_flops_metrics(  # pylint: disable=protected-access
        fake, 2.0, gen)
  assert out[3]["perf/train_flops_per_s"] == pytest.approx(3 * out[1]["perf/train_flops_per_s"])
  assert out[3]["perf/train_useful_frac"] == pytest.approx(out[1]["perf/train_useful_frac"])
  assert 0 < out[1]["perf/train_useful_frac"] < 1


def test_each_logged_sample_shows_its_own_prompt_and_reward():
  """loop.sample_rows (config.log_samples): row b holds sample b's prompt (its own tokens, up
  to its own prompt length), response, reward and length. The first sample's prompt length
  cut every prompt, or its reward stood for every row, unnoticed. (L15, L16)"""
  from rlhfuse_jax.trainer import async_ppo
  from rlhfuse_jax.trainer import loop
  tok = tasks.make_task("repeat").tokenizer
  prompts, responses = ["1 #2 =", "3 #4 #5 #6 ="], ["7", "8 9"]
  p_ids = [tok.encode(p) for p in prompts]
  r_ids = [tok.encode(r, add_bos=False) + [tok.eos_id] for r in responses]
  width, t = max(map(len, p_ids)), 4
  tokens = np.full((2, width + t), tok.pad_id, np.int32)
  response_tokens = np.full((2, t), tok.pad_id, np.int32)
  for b in range(2):
    tokens[b, :len(p_ids[b])] = p_ids[b]
    tokens[b, len(p_ids[b]):len(p_ids[b]) + len(r_ids[b])] = r_ids[b]
    response_tokens[b, :len(r_ids[b])] = r_ids[b]
  lens = np.array([len(r) for r in r_ids], np.int32)
  gen = async_ppo.Generated(
      iteration=0, version=0, tokens=tokens, prompt_lens=np.array([len(p) for p in p_ids]),
      response_tokens=response_tokens, response_lens=lens, logprobs=None, ref_logp=None,
      values=None, scores=np.array([0.25, -1.0], np.float32), metrics={})
  rows = loop.sample_rows(gen, tok, 5)
  assert [r["sample"] for r in rows] == [0, 1]
  assert [r["prompt"] for r in rows] == [tok.decode(p, skip_special_tokens=False)
                                         for p in p_ids]
  assert [r["response"] for r in rows] == responses
  assert [r["reward"] for r in rows] == [0.25, -1.0]
  assert [r["response_length"] for r in rows] == lens.tolist()


def test_async_ppo_generates_no_batch_past_the_last_iteration():
  """PPOTrainer._fill_in_flight (staleness 2): it generates the batches of the iterations
  start, start + 1 that no checkpoint brought, by the policy it starts with, and none for an
  iteration past num_iterations (a resume one iteration before the end, a run shorter than the
  staleness): such a batch was generated for nothing, and the checkpoint listed it in flight.
  (L20)"""
  import types
  from rlhfuse_jax.trainer import loop
  for start, n, brought, want in ((0, 5, (), [0, 1]), (2, 3, (), [2]), (0, 1, (), [0]),
                                  (3, 6, (3,), [4])):
    made = []
    fake = _fake_trainer(
        cfg=types.SimpleNamespace(num_iterations=n,
                                  async_ppo=types.SimpleNamespace(staleness=2)),
        in_flight=dict.fromkeys(brought), _generation_params=lambda: "params",
        _generate=lambda j, params, version: made.append((j, params, version)))
    loop.PPOTrainer._fill_in_flight(fake, start)  # pylint: disable=protected-access
    assert made == [(j, "params", start) for j in want], (start, n)
    assert sorted(fake.in_flight) == sorted(set(want) | set(brought))


def test_a_checkpoints_batches_in_flight_pair_their_arrays_with_their_side_cars():
  """PPOTrainer._state and _meta (async PPO, staleness 2): slot i of the saved arrays and entry i
  of the side-car are the same batch, so a restore (Generated.restore of the pair) gives each
  iteration back its own batch, whatever order the batches were generated in. The suite's
  resume runs have one batch in flight: slots in another order than the side-car's went
  unnoticed, and a resumed run trained iteration 4 on iteration 5's batch. (L22)"""
  import types
  from rlhfuse_jax.trainer import async_ppo
  from rlhfuse_jax.trainer import loop

  def batch(i):
    a = np.full((1, 2), i, np.int32)
    return async_ppo.Generated(iteration=i, version=i - 2, tokens=a, prompt_lens=a[0],
                               response_tokens=a, response_lens=a[0], logprobs=a * 0.5,
                               ref_logp=a * 0.25, values=a * 2.0, scores=a[0] * 1.0,
                               metrics={"i": i})
  fake = _fake_trainer(
      cfg=types.SimpleNamespace(async_ppo=types.SimpleNamespace(staleness=2),
                                optim=types.SimpleNamespace(zero1=False)),
      in_flight={5: batch(5), 4: batch(4)}, _model_states=dict, schedule_iterations=9,
      dataset=types.SimpleNamespace(state_dict=dict), _devices=dict, trained_by=list,
      rollout=None)
  # pylint: disable=protected-access
  state, meta = loop.PPOTrainer._state(fake), loop.PPOTrainer._meta(fake)
  assert [s["iteration"] for s in meta["in_flight"]] == [4, 5]
  for slot, side_car in enumerate(meta["in_flight"]):
    back = async_ppo.Generated.restore(state["in_flight"][str(slot)], side_car)
    want = fake.in_flight[back.iteration]
    assert back.version == want.version and back.metrics == want.metrics
    for k in async_ppo.ARRAYS:
      np.testing.assert_array_equal(getattr(back, k), getattr(want, k), err_msg=k)


def test_a_checkpoint_keeps_the_lr_schedules_horizon_of_the_first_start():
  """PPOTrainer._meta saves the LR schedule's horizon the run started with (2 iterations), not
  this start's num_iterations (4, an extension): saved as 4, a second extension's resume
  stretched the cosine to 4 where the first resume had kept 2. (L32)"""
  import types
  from rlhfuse_jax.trainer import loop
  fake = _fake_trainer(
      cfg=types.SimpleNamespace(num_iterations=4, async_ppo=types.SimpleNamespace(staleness=0),
                                optim=types.SimpleNamespace(zero1=False)),
      schedule_iterations=2, dataset=types.SimpleNamespace(state_dict=lambda: {"epoch": 1}),
      _devices=dict, trained_by=list, rollout=None)
  meta = loop.PPOTrainer._meta(fake)  # pylint: disable=protected-access
  assert meta["schedule_iterations"] == 2 and meta["data"] == {"epoch": 1}


# trainer/evaluation.py (the trainer/ audit: mutant ids Enn) --------------------------------------

def test_the_validation_pass_scores_each_held_out_prompt_once_in_pool_order():
  """HeldOutEval: the pass's batches hold the pool's prompts in order, each prompt's tokens
  beside its record, the last batch filled up from the pool's start; the metrics count each
  prompt once (its score here: its index in the pool). Every batch starting at the pool's start
  scored its first prompts again and again. (E1)"""
  import types
  from rlhfuse_jax.trainer.evaluation import HeldOutEval
  from rlhfuse_jax.trainer.rollout import StageOutputs
  batches = []

  def stage(params, prompts, key):
    index = np.array([r["i"] for r in prompts.records])
    np.testing.assert_array_equal(prompts.tokens[:, 0], 10 + index)
    np.testing.assert_array_equal(prompts.lens, 1 + index)
    batches.append(index.tolist())
    return StageOutputs(rollout=types.SimpleNamespace(response_lens=index + 1), batch=None,
                        ref_logp=None, values=None, scores=index.astype(np.float32),
                        metrics={})

  class Pool:  # what HeldOutEval reads of a PromptDataset
    records = [{"i": k} for k in range(5)]
    tokens = 10 + np.arange(5, dtype=np.int32)[:, None] * np.ones((1, 3), np.int32)
    lengths = 1 + np.arange(5, dtype=np.int32)

    def __len__(self):
      return 5

  m = HeldOutEval(Pool(), rows=2, seed=0)(stage, lambda n: None, iteration=0)
  assert batches == [[0, 1], [2, 3], [4, 0]]
  assert m["val/prompts"] == 5 and m["val/reward_mean"] == 2.0
  assert m["val/response_length_mean"] == 3.0


# trainer/ppo.py (the trainer/ audit: mutant ids Pnn) ---------------------------------------------

def test_rollout_statistics_report_the_advantages_returns_and_values_of_real_tokens():
  """ppo.rollout_statistics by hand: with GAE at gamma = lam = 1 and no KL, a real token's
  return is its sample's score and its advantage the score less the token's value, so
  advantages/mean, returns/mean and critic/values_mean are those means over the real tokens
  (the values on padding, here large, count in none of them). The advantages' mean taken of the
  returns, or the values' of every position, went unnoticed. (P12, P13)"""
  import jax.numpy as jnp
  from rlhfuse_jax.trainer import ppo
  from rlhfuse_jax.trainer.config import AlgoConfig
  algo = AlgoConfig(estimator="gae", kl_coef=0.0, gamma=1.0, lam=1.0, whiten_advantages=False)
  lens = np.array([3, 1, 2])
  mask = (np.arange(3)[None] < lens[:, None]).astype(np.float32)
  scores = np.array([1.0, -2.0, 0.5], np.float32)
  values = np.array([[0.2, 0.9, 9.0], [-1.0, 3.0, 3.0], [1.5, 0.0, 7.0]], np.float32)
  zeros = jnp.zeros((3, 3))
  adv, _, m = ppo.rollout_statistics(algo, 1, jnp.asarray(scores), jnp.asarray(mask), zeros,
                                     zeros, jnp.asarray(values))
  real = mask > 0
  ret = np.broadcast_to(scores[:, None], (3, 3))[real]  # 1, 1, 1, -2, .5, .5
  np.testing.assert_allclose(np.asarray(adv)[real], ret - values[real], atol=1e-6)
  np.testing.assert_allclose(m["advantages/mean"], np.mean(ret - values[real]), atol=1e-6)
  np.testing.assert_allclose(m["returns/mean"], np.mean(ret), atol=1e-6)
  np.testing.assert_allclose(m["critic/values_mean"], np.mean(values[real]), atol=1e-6)


# trainer/update.py (the trainer/ audit: mutant ids Unn) ------------------------------------------

def test_the_guard_skips_max_consecutive_skips_steps_in_a_row_then_applies_the_next():
  """guard_tx under guard.on_nonfinite='skip_update' with max_consecutive_skips=2: two
  non-finite steps in a row leave the parameters as they were (counted), the third is applied
  (the run's guard then stops on its non-finite parameters); a finite step in between starts
  the count again. One skip too many went unnoticed. (U3)"""
  import jax.numpy as jnp
  import optax
  from rlhfuse_jax.trainer import update as update_lib
  from rlhfuse_jax.trainer.config import GuardConfig
  tx = update_lib.guard_tx(GuardConfig(on_nonfinite="skip_update", max_consecutive_skips=2),
                           optax.sgd(1.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  bad, good = {"w": jnp.array([np.nan, 1.0])}, {"w": jnp.array([0.5, 0.5])}
  for grads, want in ((bad, [1.0, 1.0]), (bad, [1.0, 1.0]), (good, [0.5, 0.5]),
                      (bad, [0.5, 0.5]), (bad, [0.5, 0.5])):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["w"], want)
  updates, state = tx.update(bad, state, params)  # the third in a row: applied
  assert np.isnan(np.asarray(optax.apply_updates(params, updates)["w"][0]))
  assert int(state.total_notfinite) == 5


# trainer/hooks.py (the trainer/ audit: mutant ids Hnn) -------------------------------------------

def test_the_watchdog_after_the_last_iteration_waits_for_no_next_one():
  """HangWatchdog.after: after the last iteration (or a stopping one) it waits for the logging,
  save and export; after any other, for those and the next iteration. Told of stops only, its
  timeout after the last iteration named an iteration the run does not have. (H7)"""
  from rlhfuse_jax.trainer import hooks
  dog = hooks.HangWatchdog(600.0, num_iterations=3)
  try:
    dog.after(2, {}, stopping=False)
    assert "then iteration 3" in dog.waiting_for
    dog.after(3, {}, stopping=False)
    assert "iteration 4" not in dog.waiting_for and "export" in dog.waiting_for
    dog.after(1, {}, stopping=True)
    assert "iteration 2" not in dog.waiting_for and "export" in dog.waiting_for
  finally:
    dog.end(failing=False)


def test_checkpoints_are_saved_every_n_iterations_at_the_last_and_when_stopping():
  """Checkpoints.after with checkpoint.every=4 over 6 iterations: saves after iterations 4 and 6
  (the last, which every=4 does not divide: without it the finished run kept iteration 4 and a
  re-run trained 5 and 6 again), and after a stopping iteration (2), each side-car naming its
  iteration. The suite's runs have every | num_iterations, so the last save went unchecked.
  (H2, H1)"""
  import types
  from rlhfuse_jax.trainer import hooks
  saved = []
  ckpts = object.__new__(hooks.Checkpoints)  # no workdir: only after() and what it reads
  ckpts.cfg = types.SimpleNamespace(seed=3, num_iterations=6,
                                    checkpoint=types.SimpleNamespace(every=4))
  ckpts.fingerprint, ckpts.inputs, ckpts.eval = {}, {}, {}
  ckpts.state_fn, ckpts.meta_fn = (lambda: {"w": np.zeros(2, np.float32)}), dict
  ckpts.checkpointer = types.SimpleNamespace(
      save=lambda step, state, meta: saved.append((step, meta["iteration"])))
  for step in range(1, 7):
    ckpts.after(step, {}, stopping=step == 2)
  assert saved == [(2, 2), (4, 4), (6, 6)]


# trainer/build.py (the trainer/ audit: mutant ids Bnn) -------------------------------------------

def test_overlong_prompt_skipping_keeps_a_prompt_of_exactly_max_prompt_len():
  """build.skip_overlong (data.overlong_prompts='skip') leaves out the prompts longer than
  data.max_prompt_len tokens only: one of exactly that many tokens fits the prompt bucket and
  is kept. Dropping it too went unnoticed. (B1)"""
  from rlhfuse_jax.trainer import build
  tok = tasks.make_task("repeat").tokenizer
  texts = ["1 =", "1 #2 =", "1 #2 #3 =", "1 #2 #3 #4 ="]
  lengths = [len(tok.encode(t)) for t in texts]
  assert lengths == sorted(set(lengths))  # four different lengths
  rows = [{records.PROMPT_TEXT_KEY: t} for t in texts]
  kept = build.skip_overlong(rows, tok, lengths[2], None, "training")
  assert [r[records.PROMPT_TEXT_KEY] for r in kept] == texts[:3]
