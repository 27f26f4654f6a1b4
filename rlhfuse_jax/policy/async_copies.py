"""Where asynchronous PPO keeps copies of the models: one rule for the trainer and the planners.

The trainer (trainer/config.AsyncPPOConfig, trainer/loop.PPOTrainer._snapshot), plan_search's
memory rows (sim/plan_search.plan_memory) and plan_check's programs
(experiments/plan_programs.PlanConfig) each decided these for themselves, with one formula
written three times; a change to one would have let the planners size a layout the trainer does
not hold.
"""
from __future__ import annotations

# The staleness k of a plan's asynchronous split ("async" of a plan.json, sim/plan_search.py)
# that does not state its own: plan_search's default k. The trainer's mapping of a plan file
# (trainer/plan_file.py) and plan_search's memory rows (sim/plan_search.keeps_actor_copy) each
# wrote the literal 1: changed in one, a hand-written split would have run at one k and been
# sized for another.
SPLIT_STALENESS = 1
# Whether a plan's split that does not say ("colocated" absent) runs both groups on all the
# devices: no, it is a split (generation on its generation_devices, training on the rest), as
# the trainer maps it (trainer/plan_file.py) and docs/usage.md's plan file describes it
# (plan_search writes the key on every split). Until 2026-12-07 plan_search's readers took such
# a split as colocated: a hand-written 4 / 4 split that the trainer ran without a copy of the
# actor was sized with one and timed serially.
SPLIT_COLOCATED = False


def split_colocated(split) -> bool:
  """Whether a plan's asynchronous split (its "async" entry, a mapping, or None where the plan
  has none) leaves generation on all the devices: no split, or one whose "colocated" is true
  (SPLIT_COLOCATED where it does not say)."""
  return split is None or bool(split.get("colocated", SPLIT_COLOCATED))


def keeps_actor_copy(staleness: int, generation_devices: int) -> bool:
  """Whether the training devices keep a copy of the actor for each next batch's generation,
  beside the update and through that generation: asynchronous (staleness > 0) without a
  generation group (generation_devices 0). With a group, the copy is the group's actor."""
  return staleness > 0 and not generation_devices


def shares_group_buffers(model_shards: int, stages: int = 1) -> bool:
  """Whether an instance placed from a generation group's whole copy of a model (replicated
  over the group's data-only mesh) holds that copy's own buffers rather than new ones: where it
  keeps every leaf whole on one device (`model_shards` 1, one inference stage of `stages`),
  jax's device_put hands it the group's buffer of each leaf (measured 2026-12-07, jax 0.10.2,
  8 CPU devices: at gen_tp 1 all 307,456 bytes of ppo_tiny's actor on each instance were the
  group's; at gen_tp 2, 1,280 of 154,368, the norms). Split over devices, it gets new ones."""
  return model_shards == 1 and stages == 1
