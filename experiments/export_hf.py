r"""Exports a kept checkpoint of a train_ppo run as a Hugging Face checkpoint, after the run.

  python -m experiments.export_hf --workdir=/tmp/ppo_hf --step=best:val/reward_mean
  python -m experiments.export_hf --workdir=/tmp/ppo_hf --step=50 --out=/tmp/ppo_hf_50
  python -m experiments.export_hf --workdir=/tmp/ppo_hf --model=critic

--step: an iteration with a kept checkpoint (`ls WORKDIR/checkpoints`; config.checkpoint.keep
decides how many stay), `latest` (the default), or `best:METRIC` (`best:min:METRIC` for a loss):
the kept iteration whose METRIC in metrics.jsonl is highest (lowest), ties to the later one.
The run is rebuilt from its own config.json (or the config.K.json of the start that wrote the
checkpoint: no --config to repeat), on the devices its mesh needs, the checkpoint restored and
checked, and the actor written to --out (default WORKDIR/hf_export_<step>) as
checkpoint.export_hf writes it (the tokenizer and chat template the run read, the family of
--family, else the run's checkpoint.export_hf, else `auto`), beside it first and renamed into
place whole. Nothing is trained, no prompt is read (its prompt files may be gone), and the run's
checkpoints, metrics, config records, result.json and hf_export/ stay as they are; the export's
rlhfuse_export.json says which iteration and model it holds. The chosen iteration (and, for
best:..., the metric's value) is logged and printed as one JSON line on stdout, with the model.

--model=critic exports the run's critic instead (a PPO run's, algo.estimator='gae'; the
critic-free estimators train none: refused), to WORKDIR/hf_export_critic_<step> by default,
as a <Family>ForSequenceClassification (its value head as `score.weight`; --family, else `auto`:
init.critic_checkpoint's family, else the one its shape implies), with the run's tokenizer
files, the generation config and special ids of init.critic_checkpoint when the critic started
from one, and a pad_token_id (the run's pad token where that checkpoint gave none), without
which transformers refuses batches of more than one sequence. transformers' `score` layer has
no bias: a non-zero value bias is written as `score.bias`, which rlhfuse_jax's loader reads back
but transformers ignores (its values are the critic's minus that bias: a warning says so, and
the JSON line's value_bias gives it). An export of the other model at --out is refused, not
replaced.

A run still training in the workdir holds its lock: the export is refused. A write that fails
(a full disk) exits 3, as train_ppo's failed save or export does, in one line naming the export;
nothing of it is left and the run is untouched. A file the export copies from the run's inputs
that is gone since (its tokenizer) exits 1, naming the file and its config field.
Single-process (no --distributed).

Docs: docs/usage.md ("Real checkpoints and tokenizers"), docs/own_model.md.
"""
from __future__ import annotations

import json
import os
import sys

from absl import flags, logging

from experiments import config_files
from rlhfuse_jax import checkpointing
from rlhfuse_jax.trainer import export as export_lib
from rlhfuse_jax.trainer import hf_export
from rlhfuse_jax.trainer import hooks
from rlhfuse_jax.trainer.config import EXPORT_HF_CHOICES

_WORKDIR = flags.DEFINE_string("workdir", None, "The train_ppo run's workdir.", required=True)
_STEP = flags.DEFINE_string(
    "step", "latest", "A kept checkpoint's iteration, 'latest', or 'best:METRIC' / "
    "'best:min:METRIC' (the kept iteration whose logged METRIC is highest / lowest).")
_OUT = flags.DEFINE_string("out", "", "Where to write the export; empty: "
                           "WORKDIR/hf_export_<step> (WORKDIR/hf_export_critic_<step> for the "
                           "critic). An earlier export of this run's same model there is "
                           "replaced; another run's or the other model's is refused.")
_FAMILY = flags.DEFINE_enum("family", "", list(EXPORT_HF_CHOICES),
                            "HF family; empty: the run's checkpoint.export_hf for the actor, "
                            "else auto; auto for the critic.")
_MODEL = flags.DEFINE_enum("model", "actor", list(hf_export.MODELS),
                           "Which model to export: the actor, or the critic (a run that trains "
                           "one: algo.estimator='gae'), as a *ForSequenceClassification.")


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  workdir = os.path.normpath(_WORKDIR.value)
  try:
    result = export_lib.export(workdir, _STEP.value, _OUT.value, _FAMILY.value,
                               model=_MODEL.value)
  except hooks.LogWriteError as e:  # one line, not OSError's (exit 1, naming no file)
    logging.error("%s; the run in %s is as it was: once the cause is fixed, the same command "
                  "writes the export again", e, workdir)
    sys.exit(checkpointing.EXIT_SAVE_FAILED)  # (train_ppo's for a failed save or export)
  logging.info("exported the %s of %s as a HF %s checkpoint: %s (the run's config: %s)",
               result["model"], result["chosen"], result["family"], result["out"],
               result["config"])
  sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
  # Its errors' tracebacks go to the temp directory: nothing is written into the run's workdir.
  config_files.run(main, traceback_in_workdir=False)
