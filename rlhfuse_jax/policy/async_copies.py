"""Where asynchronous PPO keeps copies of the models: one rule for the trainer and the planners.

The trainer (trainer/config.AsyncPPOConfig, trainer/loop.PPOTrainer._snapshot), plan_search's
memory rows (sim/plan_search.plan_memory) and plan_check's programs
(experiments/plan_programs.PlanConfig) each decided these for themselves, with one formula
written three times; a change to one would have let the planners size a layout the trainer does
not hold.
"""
from __future__ import annotations


def keeps_actor_copy(staleness: int, generation_devices: int) -> bool:
  """Whether the training devices keep a copy of the actor for each next batch's generation,
  beside the update and through that generation: asynchronous (staleness > 0) without a
  generation group (generation_devices 0). With a group, the copy is the group's actor."""
  return staleness > 0 and not generation_devices

