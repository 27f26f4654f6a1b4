r"""PPO from a Hugging Face checkpoint on a GSM8K-format dataset, end to end on a CPU.

  python -m experiments.train_ppo --config=configs/ppo_hf.py --workdir=/tmp/ppo_hf

Everything a run on your own model needs, at toy size: an HF model directory
(configs/data/tiny_llama3_chat: a random 2-layer Llama-3-style model with llama3 RoPE scaling,
its tokenizer and chat template), JSONL prompts with GSM8K answers under `question` / `answer`
(configs/data/tiny_gsm8k, 256 train + 64 validation problems), the gsm8k verifier plus a format
reward, a validation pass every eval_every iterations (val/reward_mean) and, at the end, the
actor exported as an HF checkpoint (WORKDIR/hf_export) that transformers loads. All of it is
made by configs/data/make_tiny_example.py. The model is random: its reward stays near chance
(docs/own_model.md says what the run shows). Variant: `configs/ppo_hf.py:grpo` (critic-free,
4 samples per prompt).

`configs/ppo_hf.py:reward_model`: a reward model scores the responses instead of the verifier
(no answers, no format term, no held-out set); give it with --config.reward.model_checkpoint.
The other variants take `_reward_model` as a suffix to the same effect:
`configs/ppo_hf.py:grpo_reward_model`, `configs/ppo_hf.py:ppo_gpu_reward_model`,
`configs/ppo_hf.py:grpo_gpu_reward_model`.

`configs/ppo_hf.py:ppo_gpu` and `configs/ppo_hf.py:grpo_gpu`: the same run at the size of a
~1B model on one 8-GPU host (bf16, fsdp=8, 512-token prompts, 1024 new tokens, fine-tuning
rates); they still point at the tiny model and data, so give them yours. docs/own_model.md has
the commands for Llama-3.2-1B, Qwen3-0.6B and Qwen2.5-1.5B.
"""
import ml_collections

from rlhfuse_jax.trainer import config as config_lib

MODEL_DIR = "configs/data/tiny_llama3_chat"  # relative to the repository root, where runs start
DATA_DIR = "configs/data/tiny_gsm8k"
REWARD_MODEL_SUFFIX = "_reward_model"


def get_config(arg: str = "ppo"):
  c = ml_collections.ConfigDict(config_lib.defaults())
  c.seed = 0
  c.num_iterations = 100  # about a minute for the whole run on a 2-core CPU (docs/own_model.md)

  # The actor's architecture comes from the checkpoint's config.json; these shape fields are
  # the tiny model's own and are replaced by it (the run keeps only max_seq_len, dtypes,
  # attention, remat, scan_layers and fused_projections from here: build.RUN_MODEL_FIELDS).
  c.init.actor_checkpoint = MODEL_DIR
  c.init.tokenizer = f"{MODEL_DIR}/tokenizer.json"
  c.init.critic_checkpoint = MODEL_DIR  # the critic's backbone too; its value head is drawn fresh
  for section in (c.model, c.critic_model):
    section.vocab_size = 0
    section.hidden_size = 64
    section.intermediate_size = 128
    section.num_layers = 2
    section.num_heads = 4
    section.num_kv_heads = 2
    section.max_seq_len = 128  # prompt bucket 80 + 32 new tokens, with room

  c.data.prompts_file = f"{DATA_DIR}/train.jsonl"
  c.data.val_file = f"{DATA_DIR}/val.jsonl"
  c.data.prompt_key = "question"  # GSM8K's field names
  c.data.answer_key = "answer"  # the whole solution, ending in '#### N'
  c.data.chat_template = "auto"  # tokenizer_config.json's, next to init.tokenizer
  c.data.max_prompt_len = 80  # the longest rendered prompt is 69 tokens
  c.data.val_max_prompts = 32
  c.eval_every = 25
  c.log_samples = 2  # two prompts and responses as text per iteration: WORKDIR/samples.jsonl

  c.reward.function = "gsm8k"  # the response's final number against the answer's
  c.reward.format = "gsm8k_format"  # + 0.1 when the response ends with '#### <number>'
  c.reward.format_weight = 0.1

  c.rollout.prompts_per_iteration = 16
  c.rollout.max_new_tokens = 32
  c.rollout.chunk_size = 8
  c.algo.minibatch_size = 16
  c.algo.kl_coef = 0.01
  # A toy run's rates, not a fine-tune's 1e-6. At 1e-3 the reward-less random policy drifted
  # to a KL of ~6 from the reference within 20 iterations; at 1e-4 it stays below 0.85.
  c.optim.actor_lr = 1e-4
  c.optim.critic_lr = 3e-3
  c.optim.warmup_steps = 5
  c.checkpoint.every = 25
  c.checkpoint.export_hf = "auto"  # the checkpoint's own family: llama

  # 'reward_model' is PPO's; '_reward_model' after any other variant clears its verifier too.
  # One name a config: 'ppo_reward_model' was an undocumented second name of 'reward_model'.
  base = "ppo" if arg == "reward_model" else arg.removesuffix(REWARD_MODEL_SUFFIX)
  algo, _, size = base.partition("_")
  if (algo not in ("ppo", "grpo") or size not in ("", "gpu") or
      arg == "ppo" + REWARD_MODEL_SUFFIX):
    raise ValueError(f"configs/ppo_hf.py: unknown variant {arg!r}; expected 'ppo', 'grpo', "
                     "'ppo_gpu', 'grpo_gpu', 'reward_model' (PPO's with a reward model), or "
                     f"'grpo', 'ppo_gpu' or 'grpo_gpu' followed by {REWARD_MODEL_SUFFIX!r} "
                     "('grpo_gpu_reward_model')")
  if algo == "grpo":
    c.algo.estimator = "grpo"
    c.rollout.prompts_per_iteration = 4
    c.rollout.samples_per_prompt = 4
    c.algo.kl_in_reward = False  # GRPO puts the KL in the loss
    c.algo.kl_estimator = "k3"
    c.init.critic_checkpoint = ""  # no critic to initialise (validate warns about one set)
  if size == "gpu":
    _gpu(c, grpo=algo == "grpo")
  if base != arg:  # last: it clears what the size set too (the GPU run's held-out set)
    _reward_model(c)
  return c


def _reward_model(c) -> None:
  """A reward model in place of the verifier (docs/own_model.md): the gsm8k verifier, its format
  term, the answer column and the held-out set (validated on the verifier) are cleared back to
  their defaults, so that none is still used or warned of; the run stops on the empty
  reward.model_checkpoint, naming it, until --config.reward.model_checkpoint=DIR gives one."""
  defaults = config_lib.defaults()
  c.reward.kind = "model"
  c.reward.model_checkpoint = ""  # yours: an HF *ForSequenceClassification directory
  c.reward.function = ""
  c.reward.format = ""
  c.reward.format_weight = defaults["reward"]["format_weight"]
  c.data.answer_key = defaults["data"]["answer_key"]  # read by no verifier: prompts alone do
  c.data.val_file = ""  # a held-out set of your own: --config.data.val_file (and eval_every)
  c.data.val_max_prompts = defaults["data"]["val_max_prompts"]
  c.eval_every = defaults["eval_every"]


def _gpu(c, grpo: bool) -> None:
  """A ~1B model (Llama-3.2-1B, Qwen3-0.6B, Qwen2.5-1.5B) on one host of 8 GPUs."""
  c.num_iterations = 200
  for section in (c.model, c.critic_model):
    section.param_dtype = "bfloat16"
    section.dtype = "bfloat16"
    # GPU: cuDNN fused attention for training and prefill, the Pallas decode kernel on the
    # generation instances; blockwise elsewhere (models/attention.py)
    section.attention = "auto"
    section.remat = "dots"  # keep projections, recompute the rest
    # One layer's gathered weights at a time under FSDP (plan_check hf_gpu/qwen2.5-1.5b: the
    # update unrolled with 8 samples per device at once, 153.5 GB per device; docs/results.md).
    section.scan_layers = True
    section.max_seq_len = 1536  # prompt bucket 512 + 1024 new tokens
  # Every model whole on each of 8 devices' shards (fsdp shards the hidden axis; 1024, 1536
  # and 2048 all divide by 8), the batch split 8 ways.
  c.mesh.data = 1
  c.mesh.fsdp = 8
  # Generation and scoring on 8 one-device instances, each with the whole actor (resharded once
  # per iteration): on the fsdp mesh every decode step all-gathers the weights (plan_check
  # hf_gpu/qwen2.5-1.5b: 4.5 GB per device and step, >= 17 ms on NVLink vs 0.3 ms of HBM reads).
  c.plan.generation = "instances"
  c.plan.generation_tp = 1
  c.data.max_prompt_len = 512  # GSM8K questions under a chat template: well below
  c.data.val_max_prompts = 512
  c.eval_every = 20
  c.rollout.max_new_tokens = 1024
  c.rollout.chunk_size = 64
  # The device tests "all rows done?" every 8 steps: 8x fewer host round trips on GPU (1.8 % per
  # step on an H100 with one test per 128 steps, experiments/results/h100_decode_variants), at
  # most 7 idle steps after the last row stops; the tokens do not change.
  c.rollout.steps_per_check = 8
  c.rollout.prompts_per_iteration = 32 if grpo else 128
  c.rollout.samples_per_prompt = 8 if grpo else 1  # 256 or 128 responses per iteration
  c.algo.minibatch_size = 64
  # 2 of each device's 8 samples through forward + backward at a time, the gradients accumulated
  # (docs/usage.md "Memory at scale"); all 8 at once (scanned) Llama-3.2-1B alone reads 59.1 GB
  # per device (plan_check hf_gpu/llama3.2-1b --config.microbatch_size=8).
  c.algo.microbatch_size = 2
  # The weights gathered and the gradients reduced once per optimizer step, not per micro-batch:
  # plan_check hf_gpu/qwen2.5-1.5b counts 25 GB of collectives per device and step (>= 0.09 s
  # on NVLink, below the dots' 0.24 s at peak) instead of 131 GB (0.53 s), at 46.7 GB per device
  # (with the float32 copy and moments of optim.master_weights; 2026-11-29 (v)).
  c.algo.gradient_sync = "once"
  c.algo.epochs = 1
  c.optim.actor_lr = 1e-6  # fine-tuning a pretrained model
  c.optim.critic_lr = 5e-6
  c.optim.warmup_steps = 10
  # AdamW steps a float32 copy of the bfloat16 weights (at lr 1e-6 steps on the weights
  # themselves mostly round away: docs/usage.md "GPU, TPU and many hosts").
  c.optim.master_weights = True
  c.checkpoint.every = 20
