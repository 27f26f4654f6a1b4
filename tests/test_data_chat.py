"""Chat templates against transformers' apply_chat_template, without transformers.

tests/fixtures/tiny_chat/goldens.json holds what transformers rendered and tokenised for three
templates and seven conversations (tests/make_chat_fixtures.py, run once in a separate venv):
our text and ids must equal it exactly, errors included.
"""
import json
import os

import numpy as np
import pytest

from rlhfuse_jax.data.chat import ChatTemplate, ChatTemplateError
from rlhfuse_jax.data.records import PROMPT_TEXT_KEY, render_prompts
from rlhfuse_jax.data.tokenizer import HFTokenizer

CHAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_chat")
with open(os.path.join(CHAT, "goldens.json"), encoding="utf-8") as _f:
  GOLDENS = json.load(_f)
TEMPLATES = ("chatml", "headers", "inst")
CASES = [(t, c) for t in TEMPLATES for c in GOLDENS["conversations"]]


@pytest.mark.parametrize("template_dir", TEMPLATES)
def test_auto_finds_the_template_and_special_tokens_as_transformers_does(template_dir):
  """'auto' reads tokenizer_config.json's chat_template (chatml, headers) or, in transformers'
  newer layout, chat_template.jinja (inst); the special-token variables are HF's."""
  d = os.path.join(CHAT, template_dir)
  template = ChatTemplate.load("auto", os.path.join(d, "tokenizer.json"))
  assert template.special_tokens == GOLDENS[template_dir]["special_tokens_map"]
  expected = "chat_template.jinja" if template_dir == "inst" else "tokenizer_config.json"
  assert template.name == os.path.join(d, expected)


@pytest.mark.parametrize("template_dir, conversation", CASES)
def test_text_and_ids_equal_transformers(template_dir, conversation):
  d = os.path.join(CHAT, template_dir)
  template = ChatTemplate.load("auto", d)
  tokenizer = HFTokenizer.from_file(d)
  messages = GOLDENS["conversations"][conversation]
  want = GOLDENS[template_dir]["conversations"][conversation]
  if "error" in want:
    with pytest.raises(ChatTemplateError, match=want["error"]):
      template.render(messages)
    return
  text = template.render(messages)
  assert text == want["text"]
  assert tokenizer.encode(text, add_bos=False) == want["ids"]
  # The generation prompt is what the text ends with.
  assert text.endswith({"chatml": "<|im_start|>assistant\n", "inst": "[/INST]",
                        "headers": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[
                            template_dir])


def test_a_string_prompt_is_one_user_message():
  template = ChatTemplate.load("auto", os.path.join(CHAT, "headers"))
  want = GOLDENS["headers"]["conversations"]["user"]["text"]
  assert template.render(GOLDENS["conversations"]["user"][0]["content"]) == want
  assert template.render(GOLDENS["conversations"]["user"], add_generation_prompt=False) == (
      want[:-len("<|start_header_id|>assistant<|end_header_id|>\n\n")])


def test_a_special_token_given_as_none_is_left_undefined():
  # As HF leaves an unset token out of the template's variables: `is defined` is false and
  # it renders as nothing, never as the text 'None'.
  t = ChatTemplate("{% if bos_token is defined %}[{{ bos_token }}]{% endif %}{{ eos_token }}"
                   "{{ messages[0]['content'] }}",
                   special_tokens={"bos_token": None, "eos_token": "</s>"})
  assert t.render("hi") == "</s>hi"


def test_an_empty_conversation_is_refused_not_rendered_as_a_bare_generation_prompt():
  # A template given no messages still writes its generation prompt: the model would be asked
  # to answer nothing.
  t = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")
  assert t.render("hi") == "hi<assistant>"
  with pytest.raises(ChatTemplateError, match="empty conversation"):
    t.render([])


def test_numpy_values_in_messages_reach_the_template_as_plain_numbers():
  # Rows read from parquet may hold numpy scalars (float32 columns are kept as such): a
  # template's tojson and `is number` must see numbers, not their text.
  t = ChatTemplate("{% for m in messages %}{{ m['n'] | tojson }} {{ m['n'] is number }} "
                   "{{ m['ok'] | tojson }}{% endfor %}")
  msg = {"role": "user", "content": "x", "n": np.int64(7), "ok": np.bool_(True)}
  assert t.render([msg]) == "7 True true"


def test_path_forms_and_none(tmp_path):
  """A .jinja file, a tokenizer_config.json, a directory; special tokens from the tokenizer's
  tokenizer_config.json even when the template comes from elsewhere; 'none' is no template."""
  assert ChatTemplate.load("none", os.path.join(CHAT, "headers")) is None
  headers = os.path.join(CHAT, "headers")
  user = GOLDENS["conversations"]["user"]
  want = GOLDENS["headers"]["conversations"]["user"]["text"]
  from_config = ChatTemplate.load(os.path.join(headers, "tokenizer_config.json"), headers)
  assert from_config.render(user) == want
  assert ChatTemplate.load(headers).render(user) == want  # a directory, no tokenizer given
  jinja = tmp_path / "t.jinja"
  with open(os.path.join(headers, "tokenizer_config.json"), encoding="utf-8") as f:
    jinja.write_text(json.load(f)["chat_template"])
  assert ChatTemplate.load(str(jinja), headers).render(user) == want
  # The inst template with the headers tokenizer's specials: BOS is '<|begin_of_text|>'.
  inst = ChatTemplate.load(os.path.join(CHAT, "inst", "chat_template.jinja"), headers)
  assert inst.render(user).startswith("<|begin_of_text|>[INST] ")


def test_special_tokens_missing_from_the_config_come_from_special_tokens_map(tmp_path):
  """transformers reads special_tokens_map.json for a token tokenizer_config.json does not name:
  the inst template's `{{ bos_token }}` is then "<s>", not dropped; a token the config sets to
  null stays unset whatever the map says."""
  import shutil
  d = tmp_path / "inst"
  shutil.copytree(os.path.join(CHAT, "inst"), d)
  with open(d / "tokenizer_config.json", encoding="utf-8") as f:
    config = json.load(f)
  del config["bos_token"]
  with open(d / "tokenizer_config.json", "w", encoding="utf-8") as f:
    json.dump(config, f)
  with open(d / "special_tokens_map.json", "w", encoding="utf-8") as f:
    json.dump({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "unk_token": "<unk>"}, f)
  template = ChatTemplate.load("auto", str(d))
  assert template.render("hi").startswith("<s>[INST] hi [/INST]"), template.render("hi")
  assert template.special_tokens["bos_token"] == "<s>"
  assert "unk_token" not in template.special_tokens  # null in the config


def test_the_tokenizer_takes_its_special_tokens_from_the_map_as_the_template_does(tmp_path):
  """A tokenizer_config.json without eos/bos/pad beside a special_tokens_map.json naming them (a
  legacy save): the tokenizer's EOS is the map's <|eot_id|>, the token the template ends turns
  with (it guessed <|end_of_text|> from its candidate list: generation ran past every turn)."""
  import shutil
  d = tmp_path / "tok"
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  shutil.copytree(os.path.join(repo, "configs", "data", "tiny_llama3_chat"), d)
  with open(d / "tokenizer_config.json", encoding="utf-8") as f:
    config = json.load(f)
  for k in ("bos_token", "eos_token", "pad_token"):
    config.pop(k)
  with open(d / "tokenizer_config.json", "w", encoding="utf-8") as f:
    json.dump(config, f)
  with open(d / "special_tokens_map.json", "w", encoding="utf-8") as f:
    json.dump({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}, f)
  tok = HFTokenizer.from_file(str(d))
  template = ChatTemplate.load("auto", str(d))
  assert template.special_tokens["eos_token"] == "<|eot_id|>"
  assert tok.id_to_token(tok.eos_id) == "<|eot_id|>"
  assert tok.id_to_token(tok.bos_id) == "<|begin_of_text|>"
  # The config still wins where it names a token; null there leaves it unset.
  config["bos_token"] = None
  with open(d / "tokenizer_config.json", "w", encoding="utf-8") as f:
    json.dump(config, f)
  assert HFTokenizer.from_file(str(d)).bos_id is None
  with open(d / "special_tokens_map.json", "w", encoding="utf-8") as f:
    json.dump({"eos_token": "<|no_such_token|>"}, f)
  with pytest.raises(ValueError, match=r"eos_token='<\|no_such_token\|>' \(from .*"
                                       r"special_tokens_map\.json\) is not in the vocabulary"):
    HFTokenizer.from_file(str(d))


def test_named_templates_strftime_and_errors(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
      {"name": "tool_use", "template": "tools"},
      {"name": "default", "template": "{{ strftime_now('%d %b %Y') }}|{{ messages[0].content }}"}
  ]}))
  # A fixed date, not the wall clock: the prompts (and the pool's fingerprint) are the same on
  # every start and every day.
  assert ChatTemplate.load("auto", str(tmp_path)).render("hi") == "01 Jan 2026|hi"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
      {"name": "tool_use", "template": "tools"}]}))
  with pytest.raises(ChatTemplateError, match=r"named templates \['tool_use'\] but none named "
                                              "'default'"):
    ChatTemplate.load("auto", str(tmp_path))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  with pytest.raises(ChatTemplateError, match="chat_template='auto': no chat template next to "
                                              "the tokenizer"):
    ChatTemplate.load("auto", str(tmp_path))
  with pytest.raises(ChatTemplateError, match="init.tokenizer is empty"):
    ChatTemplate.load("auto", "")
  with pytest.raises(ChatTemplateError, match=r"chat_template='/nope\.jinja': no such file"):
    ChatTemplate.load("/nope.jinja")
  (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
  with pytest.raises(ChatTemplateError, match=r"bad\.jinja: not a valid Jinja template"):
    ChatTemplate.load(str(tmp_path / "bad.jinja"))
  # The sandbox: no attribute escapes from a template.
  (tmp_path / "evil.jinja").write_text("{{ messages.__class__.__mro__ }}")
  with pytest.raises(ChatTemplateError, match="SecurityError|UndefinedError"):
    ChatTemplate.load(str(tmp_path / "evil.jinja")).render("hi")


def test_auto_without_a_tokenizer_config_does_not_say_it_looked_inside_one(tmp_path):
  """A tokenizer.json alone in its directory (no tokenizer_config.json): the error said it
  looked for a 'chat_template' entry in a file that does not exist."""
  (tmp_path / "tokenizer.json").write_text("{}")
  config = str(tmp_path / "tokenizer_config.json")
  with pytest.raises(ChatTemplateError) as e:
    ChatTemplate.load("auto", str(tmp_path / "tokenizer.json"))
  assert f"and {config}, which does not exist)" in str(e.value), str(e.value)
  assert "entry in" not in str(e.value), str(e.value)
  # With the file there (and no template in it) the entry is what was looked for.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  with pytest.raises(ChatTemplateError, match=f"and a 'chat_template' entry in {config}\\)"):
    ChatTemplate.load("auto", str(tmp_path / "tokenizer.json"))


def test_generation_blocks_render_their_body(tmp_path):
  """Templates written for assistant-only losses (TRL) mark the assistant's text with
  {% generation %}; transformers renders the body unchanged (its AssistantTracker), so do we
  (the text here is what transformers 5.24 renders for it)."""
  (tmp_path / "t.jinja").write_text(
      "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}"
      "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  template = ChatTemplate.load(str(tmp_path / "t.jinja"), os.path.join(CHAT, "headers"))
  messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "2+2?"}]
  # (trim_blocks, as in transformers, drops the newline after each {% endif %})
  assert template.render(messages) == "<|user|>Hi<|assistant|>Hello<|user|>2+2?<|assistant|>"


def test_render_prompts_names_the_row(tmp_path):
  """render_prompts: chat text under PROMPT_TEXT_KEY; without a template a list of messages is
  an error naming the row; a template's raise_exception names the row and the template."""
  records = [{"prompt": "What is 12 plus 30?", "_source": "a.jsonl:1"},
             {"prompt": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}],
              "_source": "a.jsonl:2"}]
  assert render_prompts(records[:1], None)[0][PROMPT_TEXT_KEY] == "What is 12 plus 30?"
  with pytest.raises(ValueError, match=r"prompt 1 \(a\.jsonl:2\) is a list of messages but "
                                       r"config\.data\.chat_template='none'"):
    render_prompts(records, None)
  inst = ChatTemplate.load("auto", os.path.join(CHAT, "inst"))
  with pytest.raises(ValueError, match=r"prompt 1 \(a\.jsonl:2\): .*chat_template\.jinja: "
                                       "TemplateError: Conversation roles must alternate"):
    render_prompts(records, inst)
  out = render_prompts(records[:1], inst)
  assert out[0][PROMPT_TEXT_KEY] == GOLDENS["inst"]["conversations"]["user"]["text"]
  assert out[0]["prompt"] == records[0]["prompt"]  # the record keeps its prompt


def test_fixture_tokenizer_directories_share_one_vocabulary():
  """The three directories' tokenizer.json are the same file as the top-level one, so one
  model's embedding serves every template in the trainer test."""
  with open(os.path.join(CHAT, "tokenizer.json"), "rb") as f:
    top = f.read()
  for d in TEMPLATES:
    with open(os.path.join(CHAT, d, "tokenizer.json"), "rb") as f:
      assert f.read() == top


def test_a_template_that_never_reads_the_conversation_is_refused(tmp_path):
  """A system prompt given as data.chat_template (any file not .json is read as Jinja): every
  prompt rendered as that text, the questions gone, the run trained on it without a word and
  the export carried it as the model's template. A template must read `messages`."""
  path = tmp_path / "system_prompt.txt"
  path.write_text("You are a helpful math tutor. Answer with #### <number>.\n")
  with pytest.raises(ChatTemplateError, match=r"system_prompt\.txt: never reads `messages` "
                                              r"\(the conversation\)"):
    ChatTemplate.load(str(path))
  with pytest.raises(ChatTemplateError, match="never reads `messages`"):
    ChatTemplate("{{ bos_token }}Answer briefly.")
  # Reading it in any way is enough: a loop, an index, a filter.
  for source in ("{% for m in messages %}{{ m['content'] }}{% endfor %}",
                 "{{ messages[0]['content'] }}", "{{ messages | length }}"):
    ChatTemplate(source)


def _dataset_warnings(caplog, rows, tokenizer_dir: str, template: str = "auto") -> str:
  """The warnings build.build_datasets logs for the prompts file `rows` rendered through
  `template` with the tokenizer in `tokenizer_dir` (a tiny run's config otherwise)."""
  import logging
  from rlhfuse_jax.trainer import build
  from tests.test_trainer import tiny_config
  cfg = tiny_config(**{"init.tokenizer": os.path.join(tokenizer_dir, "tokenizer.json"),
                       "data.prompts_file": str(rows), "data.chat_template": template,
                       "data.max_prompt_len": 64,
                       "reward.function": "tests.test_rewards:answer_length",
                       "rollout.prompts_per_iteration": 4, "algo.minibatch_size": 4})
  task, tok = build.build_task_and_tokenizer(cfg)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    build.build_datasets(cfg, task, tok)
  return caplog.text


def test_prompts_rendered_before_are_warned_of(tmp_path, caplog):
  """Prompts another tool rendered (their text begins with the BOS token) and a chat template
  (config.data.chat_template) rendered them again as a user's message, without a word: two
  BOS tokens and the template's headers twice. Plain questions are not warned of."""
  rows = tmp_path / "p.jsonl"

  def warnings(tokenizer_dir, prompt):
    rows.write_text(json.dumps({"prompt": prompt, "target": "2"}) + "\n")
    return _dataset_warnings(caplog, rows, tokenizer_dir)
  for name in TEMPLATES:
    assert "already begin with" not in warnings(os.path.join(CHAT, name), "What is 1 plus 1?")
  rendered = GOLDENS["headers"]["conversations"]["user"]["text"]
  assert rendered.startswith("<|begin_of_text|>")
  text = warnings(os.path.join(CHAT, "headers"), rendered)
  assert ("1 of the first 1 prompts already begin with the BOS token '<|begin_of_text|>'"
          in text)


def test_prompts_that_end_with_the_assistants_message_are_warned_of(tmp_path, caplog):
  """Chat data made for fine-tuning ends with the assistant's answer: rendered as it was, the
  answer sat in the prompt, followed by a second assistant header, without a word."""
  rows = tmp_path / "p.jsonl"
  chats = [[{"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."}] for i in range(3)]
  chats[1] = chats[1][:1]  # a prompt: the user's turn alone
  rows.write_text("".join(json.dumps({"prompt": c, "target": "2"}) + "\n" for c in chats))
  text = _dataset_warnings(caplog, rows, os.path.join(CHAT, "chatml"))
  assert f"2 of the 3 prompts end with an assistant message (the first: {rows}:1)" in text


def test_a_template_that_opens_no_assistant_turn_is_warned_of(tmp_path, caplog):
  """A chat template that ignores add_generation_prompt (one written for fine-tuning) rendered
  every prompt ending after the user's message, with no assistant header: the policy continued
  the question instead of answering it, without a word. The shipped templates open the turn."""
  rows = tmp_path / "p.jsonl"
  rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1 plus 1?"}],
                              "target": "2"}) + "\n")
  plain = tmp_path / "plain.jinja"
  plain.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")

  for name in TEMPLATES:
    assert "add_generation_prompt" not in _dataset_warnings(caplog, rows,
                                                            os.path.join(CHAT, name))
  text = _dataset_warnings(caplog, rows, os.path.join(CHAT, "chatml"), str(plain))
  assert (f"config.data.chat_template='{plain}' writes nothing for add_generation_prompt"
          in text)


def test_a_prompt_ending_with_the_assistants_words_is_not_said_to_end_with_the_users(caplog):
  """warn_no_generation_prompt said of a template without a generation prompt 'the prompts end
  after the user's message ... the policy continues the user's text' where the first prompt
  ends with an assistant message (a prefill the policy continues: warn_assistant_last's case,
  warned of there). It speaks of prompts that end with the user's (or another non-assistant)
  message only."""
  import logging
  import types
  from rlhfuse_jax.data import chat as chat_lib
  from rlhfuse_jax.trainer import build
  plain = chat_lib.ChatTemplate(
      "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
  cfg = types.SimpleNamespace(data=types.SimpleNamespace(chat_template="plain.jinja"))
  user = [{"role": "user", "content": "What is 1 plus 1?"}]
  prefill = user + [{"role": "assistant", "content": "The answer is"}]
  with caplog.at_level(logging.WARNING):
    assert build.warn_no_generation_prompt(cfg, plain, [{"prompt": user}])
    caplog.clear()
    assert not build.warn_no_generation_prompt(cfg, plain, [{"prompt": prefill}])
  assert "the user's message" not in caplog.text, caplog.text


def test_a_chatml_template_without_a_generation_prompt_is_warned_of(caplog):
  """A ChatML (or Llama 3 headers) template written for fine-tuning, without the
  add_generation_prompt branch: every prompt ended at the closed user turn
  ('...<|im_end|>\\n'), without the '<|im_start|>assistant\\n' that opens the answer, so the
  policy had to write the header itself. The check for a generation prompt looked only for
  prompts ending with the user's own words and said nothing. A template whose user turn closes
  with the cue to answer (Mistral's [/INST], the answer right after it) is not warned of."""
  import logging
  import types
  from rlhfuse_jax.data import chat as chat_lib
  from rlhfuse_jax.trainer import build
  cfg = types.SimpleNamespace(data=types.SimpleNamespace(chat_template="mine.jinja"))
  user = [{"role": "user", "content": "What is 1 plus 1?"}]
  loop = "{% for m in messages %}"
  chatml = loop + "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  headers = (loop + "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
             "{{ m['content'] }}<|eot_id|>{% endfor %}")
  for source, header in ((chatml, "<|im_start|>assistant\n"),
                         (headers, "<|start_header_id|>assistant<|end_header_id|>\n\n")):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      assert build.warn_no_generation_prompt(cfg, chat_lib.ChatTemplate(source),
                                             [{"prompt": user}])
    assert (f"without the header {header!r} that the template writes before an assistant's "
            "message") in caplog.text, caplog.text
  # The answer follows the user's turn directly (or after a space): nothing is missing.
  for answer in ("{{ m['content'] }}</s>", " {{ m['content'] }}</s>"):
    inst = (loop + "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}" +
            answer + "{% endif %}{% endfor %}")
    assert not build.warn_no_generation_prompt(cfg, chat_lib.ChatTemplate(inst),
                                               [{"prompt": user}])
  for name in TEMPLATES:  # (the shipped ones open the assistant's turn, or need not)
    template = ChatTemplate.load("auto", os.path.join(CHAT, name))
    assert not build.warn_no_generation_prompt(cfg, template, [{"prompt": user}])


def test_a_template_file_s_byte_order_mark_is_read_as_nothing(tmp_path, caplog):
  """A chat_template.jinja saved with a UTF-8 byte-order mark (as some editors write it) was
  rendered with it: U+FEFF began every prompt, three byte tokens before the template's own
  text, a prompt the model never saw. It is read as nothing (as a prompts file's), with a
  warning naming the file, for a path and for 'auto'; the export writes the template as the
  run read it, without the mark (transformers would render it)."""
  import logging
  import shutil
  import types
  from rlhfuse_jax.trainer import hf_export
  inst = os.path.join(CHAT, "inst")
  with open(os.path.join(inst, "chat_template.jinja"), encoding="utf-8") as f:
    source = f.read()
  tok_dir = tmp_path / "tok"
  shutil.copytree(inst, tok_dir)
  (tok_dir / "chat_template.jinja").write_bytes(b"\xef\xbb\xbf" + source.encode("utf-8"))
  tokenizer = HFTokenizer.from_file(str(tok_dir))
  want = GOLDENS["inst"]["conversations"]["user"]
  messages = GOLDENS["conversations"]["user"]
  for spec in ("auto", str(tok_dir / "chat_template.jinja")):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      template = ChatTemplate.load(spec, str(tok_dir))
    assert "chat_template.jinja starts with a UTF-8 byte-order mark" in caplog.text
    assert template.source == source
    text = template.render(messages)
    assert text == want["text"]
    assert tokenizer.encode(text, add_bos=False) == want["ids"]
    out = tmp_path / f"export_{spec == 'auto'}"
    out.mkdir()
    cfg = types.SimpleNamespace(init=types.SimpleNamespace(tokenizer=str(tok_dir)),
                                data=types.SimpleNamespace(chat_template=spec))
    hf_export._copy_tokenizer(cfg, tokenizer, str(out))
    assert (out / "chat_template.jinja").read_bytes() == source.encode("utf-8")


def test_the_byte_order_mark_warning_says_that_removing_it_refuses_a_resume(tmp_path, caplog):
  """The warning said the mark is read as nothing, and a user who then removed it from the file
  had the run's resume refused: the resume check hashes the file's bytes (trainer/inputs.py),
  and the file without the mark is other content. The warning now says to leave it while a run
  started with it may resume; the refusal it announces is checked here."""
  import logging
  import types
  from rlhfuse_jax.trainer import inputs
  source = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
  path = tmp_path / "chat.jinja"
  path.write_bytes(b"\xef\xbb\xbf" + source.encode("utf-8"))
  with caplog.at_level(logging.WARNING):
    assert ChatTemplate.load(str(path), str(tmp_path)).source == source
  assert ("starts with a UTF-8 byte-order mark" in caplog.text and
          "Leave it there while a run started with it may resume: its resume check compares the "
          "file's bytes, and refuses the file without the mark as a changed input"
          in caplog.text), caplog.text
  cfg = types.SimpleNamespace(
      init=types.SimpleNamespace(actor_checkpoint="", tokenizer="", critic_checkpoint=""),
      reward=types.SimpleNamespace(model_checkpoint="", kind="function"),
      data=types.SimpleNamespace(prompts_file="", chat_template=str(path)))
  saved = inputs.fingerprints(cfg)
  path.write_bytes(source.encode("utf-8"))  # the mark removed: the same template read
  assert ChatTemplate.load(str(path), str(tmp_path)).source == source
  assert inputs.resume_changes([], saved, inputs.fingerprints(cfg), 3) == ([], [
      "data.chat_template: chat.jinja changed since the checkpoints were written (every prompt "
      "is rendered with it)"])
