"""HFTokenizer on a tiny byte-level BPE that the test trains itself (no network, no fixture)."""
import json
import os

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rlhfuse_jax.data.tokenizer import HFTokenizer, Tokenizer

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "reinforcement learning from human feedback trains a policy",
    "the critic predicts the value of each token",
    "pipelines have bubbles; fusion fills them",
] * 4


def _train_bpe(directory, specials=("<s>", "</s>", "<pad>")):
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(_CORPUS, trainer=trainer)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "tokenizer.json")
  tok.save(path)
  return path


def _write_config(directory, **config):
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)


def test_round_trip_and_special_ids_guessed_from_vocabulary(tmp_path):
  path = _train_bpe(str(tmp_path))
  tok = HFTokenizer.from_file(path)
  assert isinstance(tok, Tokenizer)
  backend = tokenizers.Tokenizer.from_file(path)
  assert tok.bos_id == backend.token_to_id("<s>")
  assert tok.eos_id == backend.token_to_id("</s>")
  assert tok.pad_id == backend.token_to_id("<pad>")
  assert tok.vocab_size == backend.get_vocab_size()
  for text in ["the quick brown fox", "fusion fills bubbles!", "unseen wörds ünïcode 123 \t x"]:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id  # a BOS token exists and no config says otherwise
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text  # specials skipped
    assert tok.encode(text, add_bos=False) == ids[1:]
  texts = ["the dog", "a policy", ""]
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
  # Trained merges make common words shorter than their byte count.
  assert len(tok.encode("the", add_bos=False)) == 1


def test_truncation_and_padding_saved_in_the_file_are_not_applied(tmp_path):
  """A tokenizer.json saved after a call with truncation/padding keeps them, and the library
  applies them on every encode: prompts would be cut silently or padded with ids counted as
  prompt tokens. Encoding ignores them, as transformers does per call."""
  path = _train_bpe(str(tmp_path))
  reference = HFTokenizer.from_file(path)
  backend = tokenizers.Tokenizer.from_file(path)
  backend.enable_truncation(max_length=2)
  backend.enable_padding(pad_id=reference.pad_id, pad_token="<pad>")
  backend.save(path)
  tok = HFTokenizer.from_file(path)
  texts = ["the dog", "the critic predicts the value of each token"]
  assert len(reference.encode(texts[1], add_bos=False)) > 2
  assert tok.encode(texts[1]) == reference.encode(texts[1])
  assert tok.encode_batch(texts) == [reference.encode(t) for t in texts]
  assert backend.truncation is not None  # the caller's object is left as it was
  wrapped = HFTokenizer(backend, eos_id=reference.eos_id)
  assert wrapped.encode(texts[1], add_bos=False) == reference.encode(texts[1], add_bos=False)
  assert backend.truncation is not None and backend.padding is not None


def test_config_file_overrides_and_explicit_arguments(tmp_path):
  path = _train_bpe(str(tmp_path))
  # HF writes tokens either as strings or as AddedToken dicts; null means "no such token".
  _write_config(str(tmp_path), bos_token=None, eos_token={"content": "<pad>"}, pad_token="</s>")
  tok = HFTokenizer.from_file(str(tmp_path))  # a directory works too
  backend = tok.backend
  assert tok.bos_id is None and not tok.add_bos
  assert tok.eos_id == backend.token_to_id("<pad>")
  assert tok.pad_id == backend.token_to_id("</s>")
  assert tok.encode("the dog")[0] != backend.token_to_id("<s>")

  tok = HFTokenizer.from_file(path, eos_token="</s>", bos_token="<s>", add_bos=False)
  assert tok.eos_id == backend.token_to_id("</s>") and tok.bos_id == backend.token_to_id("<s>")
  assert tok.encode("dog") == tok.encode("dog", add_bos=False)

  _write_config(str(tmp_path), bos_token="<s>", eos_token="</s>", add_bos_token=False)
  tok = HFTokenizer.from_file(path)
  assert tok.bos_id is not None and not tok.add_bos
  assert tok.pad_id == tok.backend.token_to_id("<pad>")  # not in config: guessed


@pytest.mark.parametrize("processor, adds", [
    (None, True),  # no post-processor: the BOS the vocabulary names (LLaMA-class default)
    ("byte_level", False),  # GPT-2 / SmolLM style: transformers adds nothing
    ("template", True),  # Llama-3 style TemplateProcessing "<s> $A"
    ("sequence", True),  # ByteLevel then TemplateProcessing, as newer tokenizer.json files hold
    ("template_eos", False),  # a template that appends EOS only
])
def test_bos_follows_the_post_processor_when_the_config_is_silent(tmp_path, processor, adds):
  """tokenizer_config.json names a bos_token but no add_bos_token: encode prepends BOS as
  transformers' fast tokenizer would, by the file's post-processor."""
  path = _train_bpe(str(tmp_path))
  backend = tokenizers.Tokenizer.from_file(path)
  bos, eos = backend.token_to_id("<s>"), backend.token_to_id("</s>")
  template = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
  backend.post_processor = {
      None: None, "byte_level": processors.ByteLevel(trim_offsets=False), "template": template,
      "sequence": processors.Sequence([processors.ByteLevel(trim_offsets=False), template]),
      "template_eos": processors.TemplateProcessing(single="$A </s>",
                                                    special_tokens=[("</s>", eos)])}[processor]
  backend.save(path)
  _write_config(str(tmp_path), bos_token="<s>", eos_token="</s>")
  tok = HFTokenizer.from_file(path)
  assert tok.add_bos == adds
  assert (tok.encode("the dog")[0] == bos) == adds
  # The post-processor itself never runs: one BOS at most (ours), no EOS the template appends.
  assert tok.encode("the dog").count(bos) == int(adds)
  assert not {bos, eos} & set(tok.encode("the dog", add_bos=False))
  if processor is not None:  # what the library's own post-processor puts first
    assert (backend.encode("the dog").ids[0] == bos) == adds


def test_pad_falls_back_to_eos(tmp_path):
  path = _train_bpe(str(tmp_path), specials=("<|endoftext|>",))
  tok = HFTokenizer.from_file(path)
  assert tok.eos_id == tok.backend.token_to_id("<|endoftext|>")
  assert tok.pad_id == tok.eos_id
  assert tok.bos_id is None and tok.encode("dog") == tok.encode("dog", add_bos=False)


def test_generation_config_eos_ids_also_end_a_response(tmp_path):
  """generation_config.json's eos_token_id (an id or a list, as Llama 3 Instruct's and Qwen2.5
  Instruct's list two or three) adds stop ids after the tokenizer's own EOS; the argument
  overrides the file; a bad entry names the file."""
  path = _train_bpe(str(tmp_path), specials=("<s>", "</s>", "<pad>", "<|eot|>", "<|eom|>"))
  _write_config(str(tmp_path), eos_token="<|eot|>")
  ids = {t: tokenizers.Tokenizer.from_file(path).token_to_id(t) for t in ("</s>", "<|eot|>",
                                                                          "<|eom|>")}
  assert HFTokenizer.from_file(path).stop_ids == (ids["<|eot|>"],)  # no generation_config
  # Without one, a model config.json's eos_token_id, as transformers and vLLM read it (the
  # original Llama 3 Instruct layout; it was ignored, and responses ran on past those ids). A
  # config.json that is not a model's (a run's) is not read.
  model = tmp_path / "config.json"
  model.write_text(json.dumps({"model_type": "llama", "eos_token_id": [ids["<|eom|>"]]}))
  assert HFTokenizer.from_file(path).stop_ids == (ids["<|eot|>"], ids["<|eom|>"])
  model.write_text(json.dumps({"model_type": "llama", "eos_token_id": "</s>"}))
  with pytest.raises(ValueError, match=r"config.json: eos_token_id='</s>'; expected a token"):
    HFTokenizer.from_file(path)
  model.write_text(json.dumps({"seed": 0, "eos_token_id": [ids["<|eom|>"]]}))
  assert HFTokenizer.from_file(path).stop_ids == (ids["<|eot|>"],)
  model.write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                               "eos_token_id": [ids["<|eom|>"]]}))
  gen = tmp_path / "generation_config.json"
  gen.write_text(json.dumps({"eos_token_id": [ids["</s>"], ids["<|eom|>"], ids["<|eot|>"]]}))
  tok = HFTokenizer.from_file(path)
  assert tok.eos_id == ids["<|eot|>"]  # the one targets end with stays the tokenizer's
  assert tok.stop_ids == (ids["<|eot|>"], ids["</s>"], ids["<|eom|>"])
  gen.write_text(json.dumps({"eos_token_id": ids["</s>"]}))  # over config.json's
  assert HFTokenizer.from_file(path).stop_ids == (ids["<|eot|>"], ids["</s>"])
  assert HFTokenizer.from_file(path, extra_eos_ids=()).stop_ids == (ids["<|eot|>"],)
  gen.write_text(json.dumps({"eos_token_id": True}))  # JSON true is no token id (not id 1)
  with pytest.raises(ValueError, match="generation_config.json: eos_token_id=True; expected"):
    HFTokenizer.from_file(path)
  gen.write_text(json.dumps({"eos_token_id": ["</s>"]}))
  with pytest.raises(ValueError, match="generation_config.json: eos_token_id=.*expected a token"):
    HFTokenizer.from_file(path)
  gen.write_text(json.dumps({"eos_token_id": [10 ** 6]}))  # named as that file's, not tokenizer's
  with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id has \[1000000\], "
                     r"outside the vocabulary of .*tokenizer.json \(\[0, "):
    HFTokenizer.from_file(path)
  size = tokenizers.Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
  gen.write_text(json.dumps({"eos_token_id": [size]}))  # one past the last id
  with pytest.raises(ValueError, match=rf"generation_config.json: eos_token_id has \[{size}\]"):
    HFTokenizer.from_file(path)
  gen.write_text(json.dumps({"eos_token_id": [size - 1]}))  # the last id is a token
  assert HFTokenizer.from_file(path).stop_ids == (ids["<|eot|>"], size - 1)
  gen.write_text(json.dumps({"eos_token_id": [10 ** 6]}))
  with pytest.raises(ValueError, match="extra_eos_ids has 1000000; expected token ids in"):
    HFTokenizer.from_file(path, extra_eos_ids=(10 ** 6,))  # the argument's own check


def test_missing_and_malformed_files_name_the_path(tmp_path):
  missing = str(tmp_path / "nope" / "tokenizer.json")
  with pytest.raises(FileNotFoundError, match="nope/tokenizer.json"):
    HFTokenizer.from_file(missing)

  bad = tmp_path / "bad" / "tokenizer.json"
  bad.parent.mkdir()
  bad.write_text('{"model": {"type": "BPE", ')
  with pytest.raises(ValueError, match=r"bad/tokenizer\.json: not a valid tokenizer\.json"):
    HFTokenizer.from_file(str(bad))
  # The directory's other JSON, named instead of tokenizer.json: said so, not a parse error.
  config = tmp_path / "bad" / "tokenizer_config.json"
  config.write_text('{"eos_token": "</s>", "chat_template": "{{ messages }}"}')
  with pytest.raises(ValueError, match=r"bad/tokenizer_config\.json is a tokenizer_config\.json "
                     r".*the tokenizer is the tokenizer\.json beside it"):
    HFTokenizer.from_file(str(config))

  # A SentencePiece tokenizer.model (a Llama 2 download without tokenizer.json) named, or
  # beside the missing tokenizer.json: said what it is and how to write the file the run reads,
  # not "stream did not contain valid UTF-8" alone.
  sp_dir = tmp_path / "llama2"
  sp_dir.mkdir()
  (sp_dir / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\xff\xfe")
  convert = (r"the run reads the `tokenizers` library's tokenizer\.json, which transformers "
             r"writes from it: AutoTokenizer\.from_pretrained\(DIR\)\.save_pretrained\(DIR\)")
  with pytest.raises(ValueError, match=r"llama2/tokenizer\.model: not a valid tokenizer\.json "
                     r"\(.*\); .*tokenizer\.model looks like a SentencePiece model: " + convert):
    HFTokenizer.from_file(str(sp_dir / "tokenizer.model"))
  for named in (sp_dir, sp_dir / "tokenizer.json"):
    with pytest.raises(FileNotFoundError, match=r"not found: .*llama2/tokenizer\.json; .*llama2/"
                       r"tokenizer\.model is there: " + convert):
      HFTokenizer.from_file(str(named))

  good_dir = tmp_path / "good"
  path = _train_bpe(str(good_dir))
  (good_dir / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"good/tokenizer_config\.json"):
    HFTokenizer.from_file(path)
  # Not UTF-8 (a latin-1 export): the decoder's error named no file.
  (good_dir / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xe9"}')
  with pytest.raises(ValueError, match=r"good/tokenizer_config\.json: not a valid "
                                       r"tokenizer_config\.json \('utf-8' codec can't "):
    HFTokenizer.from_file(path)

  _write_config(str(good_dir), eos_token="<nonexistent>")
  with pytest.raises(ValueError, match=r"eos_token='<nonexistent>'.*not in the vocabulary"):
    HFTokenizer.from_file(path)

  _write_config(str(good_dir), eos_token=3)
  with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token"):
    HFTokenizer.from_file(path)


def test_missing_eos_is_a_clear_error(tmp_path):
  """The error said "pass eos_token=", an argument train_ppo's user cannot give, and, for a
  tokenizer_config.json whose eos_token is null, "none of [...] in the vocabulary" of one that
  holds <|im_end|>: it names the file's entry to set."""
  path = _train_bpe(str(tmp_path), specials=("<unk>",))
  fix = (r"; set eos_token in .*/tokenizer_config\.json to the token that ends a response "
         r"\(HFTokenizer\.from_file's eos_token= in Python\)$")
  with pytest.raises(ValueError, match=r"cannot find an EOS token \(no eos_token in "
                     r"tokenizer_config\.json or special_tokens_map\.json and none of \['</s>'.*"
                     r"in the vocabulary\)" + fix):
    HFTokenizer.from_file(path)
  null = tmp_path / "null"
  chatml = _train_bpe(str(null), specials=("<|im_end|>",))
  _write_config(str(null), eos_token=None)
  with pytest.raises(ValueError, match=r"cannot find an EOS token \(.*null/tokenizer_config\.json "
                     r"sets eos_token to null\)" + fix):
    HFTokenizer.from_file(chatml)
  _write_config(str(null), eos_token="<|im_end|>")
  assert HFTokenizer.from_file(chatml).eos_id == HFTokenizer.from_file(chatml).backend.token_to_id(
      "<|im_end|>")
  tok = HFTokenizer.from_file(path, eos_token="<unk>")
  assert tok.eos_id == tok.backend.token_to_id("<unk>")
