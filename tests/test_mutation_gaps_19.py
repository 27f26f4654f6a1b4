"""Pins the survivors of a mutation audit of trainer/rollout.py, trainer/inputs.py and
generation/pipelined.py: each test fails under a plausible bug the rest of the suite let through
(the audit report names the mutation each one kills)."""
import types

import numpy as np

from rlhfuse_jax.trainer import inputs


# trainer/inputs.py -------------------------------------------------------------------------------

S = inputs.SAMPLE_BYTES


def _shard_digest(path, data: np.ndarray) -> dict:
  path.write_bytes(data.tobytes())
  return inputs.content_fingerprint("init.actor_checkpoint", str(path))


def test_a_sampled_shard_digest_covers_its_size_and_each_samples_edges(tmp_path):
  """A weight shard over 3 MiB is hashed by its size and the 1 MiB samples at 0, (size - S) // 2
  and size - S. A shard that only grows (zeros appended: every sample still zeros) must change
  the digest, and so must a flip of the middle sample's first byte or of the file's last byte
  (a sample placed a little off misses exactly those bytes)."""
  shard = tmp_path / "model.safetensors"
  zeros = _shard_digest(shard, np.zeros(4 * S, np.uint8))
  assert _shard_digest(shard, np.zeros(5 * S, np.uint8)) != zeros  # the size counts
  data = np.random.default_rng(0).integers(0, 256, 5 * S + 7, np.uint8)
  base = _shard_digest(shard, data)
  for at in ((len(data) - S) // 2, len(data) - 1):
    flipped = data.copy()
    flipped[at] ^= 1
    assert _shard_digest(shard, flipped) != base, at
  # A byte outside the three samples is not read: the sampling is what the docstring says.
  outside = data.copy()
  outside[S + 10] ^= 1
  assert _shard_digest(shard, outside) == base


def test_empty_config_paths_fingerprint_nothing_in_the_working_directory(tmp_path, monkeypatch):
  """An empty path field names no input: it must not fingerprint the files of the working
  directory that happen to carry a template's or tokenizer's names (dirname('') is the
  working directory), or every resume from elsewhere would be refused as 'changed'."""
  monkeypatch.chdir(tmp_path)
  for name in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json", "config.json"):
    (tmp_path / name).write_text("{}")
  cfg = types.SimpleNamespace(
      init=types.SimpleNamespace(actor_checkpoint="", tokenizer="", critic_checkpoint=""),
      reward=types.SimpleNamespace(model_checkpoint="", kind="model"),
      data=types.SimpleNamespace(prompts_file="", chat_template=""))
  assert inputs.fingerprints(cfg) == {}


def test_a_path_change_is_judged_as_a_change_unless_its_content_was_fingerprinted():
  """resume_changes takes a path change off the changes only when the saved fingerprint of that
  field exists and equals this start's. A field neither start fingerprinted (its path held no
  file) stays a config change, even though both sides are 'missing'; and a moved input with
  other content is left to the config-change check alone, not also reported as changed files."""
  fp = {"config.json": "a"}
  saved = {"init.actor_checkpoint": fp}
  change = "init.tokenizer: '/a' -> '/b'"
  assert inputs.resume_changes([change], saved, {"init.actor_checkpoint": fp}, 3) == (
      [change], [])
  moved = "init.actor_checkpoint: '/m' -> '/n'"
  assert inputs.resume_changes([moved], saved, {"init.actor_checkpoint": {"config.json": "b"}},
                               3) == ([moved], [])


def test_a_saved_fingerprint_without_file_names_says_its_files_changed():
  """A saved fingerprint that is no {file: digest} dict (no file names to compare) yields the
  generic 'its files changed' line, not an empty list of names."""
  left, changed = inputs.resume_changes(
      [], {"init.actor_checkpoint": "digest"}, {"init.actor_checkpoint": {"config.json": "b"}}, 3)
  assert left == [] and changed == [
      "init.actor_checkpoint: its files changed since the checkpoints were written (the KL "
      "reference is read from it at every start)"]
