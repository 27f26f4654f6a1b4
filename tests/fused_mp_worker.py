"""One process of the multi-process fused-generation test (tests/test_fused_multiprocess.py),
and the case both sides run: the test runs `run_case` in its own process (8 devices), and

  python -m tests.fused_mp_worker PROCESS_ID NUM_PROCESSES PORT OUT_DIR

runs it as one of NUM_PROCESSES processes on 127.0.0.1 (XLA_FLAGS from the caller: its local
devices), writing OUT_DIR/proc{PROCESS_ID}.npz with every process's view of the outputs.
FUSED_MP_INSTANCES and FUSED_MP_SEED (default G and 0) pick the instance count and batch,
FUSED_MP_EXCHANGE the exchanges' `exchange_on` (default "host").
"""
import json
import os
import sys

import numpy as np

P, T = 6, 16
G, S = 8, 4  # 8 one-device instances of 4 slots: 16 samples dealt 2 per instance
RUNS = (("baseline", False, 0.0), ("early", True, 1.0), ("late", True, 0.5))
FIELDS = ("response_tokens", "response_lens", "logprobs", "stop_reason")
MODELS = ("ref_logp", "values", "rewards")


def batch(b, seed):
  rng = np.random.default_rng(seed)
  lens = rng.integers(1, P + 1, b).astype(np.int32)
  tokens = rng.integers(1, 32, (b, P)).astype(np.int32)
  tokens[np.arange(P)[None] >= lens[:, None]] = 0
  budgets = np.clip(np.rint(rng.lognormal(np.log(5), 1.0, b)), 1, T).astype(np.int32)
  budgets[0] = T  # one sample runs to the end: a tail
  return tokens, lens, budgets


def run_case(g: int = G, seed: int = 0) -> dict:
  """{run name: {field: array}} and {run name + '/metrics': json} of g one-device instances
  (the first g of jax.devices()) on batch(2 * g, seed)."""
  import jax

  from rlhfuse_jax.generation.fused import FusedGenConfig, FusedGenerator
  from rlhfuse_jax.generation.instances import FrozenModels
  from rlhfuse_jax.generation.sampling import SamplingConfig
  from rlhfuse_jax.generation.timeline import KINDS
  from rlhfuse_jax.models import llama

  cfg = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=4, num_kv_heads=2, max_seq_len=64)
  score = cfg.replace(head="scalar")
  actor = llama.host_random_params(cfg, 0)
  params = {"reference": actor, "critic": llama.host_random_params(score, 1),
            "reward": llama.host_random_params(score, 2)}
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=T, chunk_size=3, eos_id=-1)
  config = FusedGenConfig(num_instances=g, slots=S, migration_threshold=0.5,
                          compile_threads=2, exchange_timeout_s=float(
                              os.environ.get("FUSED_MP_TIMEOUT_S", 600)),
                          exchange_on=os.environ.get("FUSED_MP_EXCHANGE", "host"))
  gen = FusedGenerator(cfg, sampling, config, batch_size=2 * g, prompt_len=P,
                       frozen=FrozenModels(reference=cfg, critic=score, reward=score),
                       actor_params=actor, frozen_params=params)
  tokens, lens, budgets = batch(2 * g, seed)
  out = {}
  for name, fuse, rt in RUNS:
    res = gen.run(actor, params, tokens, lens, jax.random.key(3), budgets=budgets, fuse=fuse,
                  rt=rt)
    for f in FIELDS:
      out[f"{name}/{f}"] = getattr(res.rollout, f)
    for m in MODELS:
      out[f"{name}/{m}"] = getattr(res, m)
    keep = {k: v for k, v in res.metrics.items() if not k.startswith("timing_s/")}
    keep["consolidations"] = [{k: c[k] for k in ("step", "kept", "released", "moves",
                                                   "cross_host_moves", "copied_bytes",
                                                   "cross_host_copied_bytes", "cross_host_s")}
                              for c in res.consolidations]
    # This process's own instances' figures (it watched only those): what the overlap, weight
    # load and busy metrics must combine over the processes. [loaded before generation ended,
    # inference s before it ended, all inference s, load s, busy s, instances x own span]
    tl = res.timeline
    keep["local_figures"] = [tl.loaded_before_gen_end] + [
        sum(tl.busy_s(i, kinds, until=until) for i in tl.watched)
        for kinds, until in ((("inference",), tl.gen_end_s), (("inference",), None),
                             (("load",), None), (KINDS, None))] + [
        len(tl.watched) * tl.gen_plus_inf_s]
    keep["own_load_bytes"] = int(res.by_process[jax.process_index()][4])  # its loader's count
    # ... and its own spans and waits, by its own clock: what the migration and stage times and
    # the unfinished curve's times combine over the processes.
    keep["timing"] = {k: v for k, v in res.metrics.items() if k.startswith("timing_s/")}
    keep["own_clock"] = {
        "migration_s": tl.migration_s,
        "same_host_s": tl.per_consolidation_span_s(tl.tagged.get("same_host", [])),
        "cross_host_s": sum(c["cross_host_s"] for c in res.consolidations),
        "compile_s": sum(c["cross_host_compile_s"] for c in res.consolidations),
        "gen_end_s": tl.gen_end_s, "gen_plus_inf_s": tl.gen_plus_inf_s,
        "place_s": res.by_process[jax.process_index()][-len(tl.unfinished_curve) - 1],
        "curve_s": [t for t, _ in tl.unfinished_curve]}
    out[f"{name}/metrics"] = np.asarray(json.dumps(keep))
  # A validation pass's call (trainer/rollout.validation_stage): the reward model alone, the
  # critic's params left out; every process skips the same models.
  res = gen.run(actor, {n: params[n] for n in ("reference", "reward")}, tokens, lens,
                jax.random.key(3), budgets=budgets, rt=0.5, models=["reward"])
  assert res.ref_logp is None and res.values is None, "models=['reward'] ran the others"
  out["rewards_only/rewards"] = res.rewards
  out["rewards_only/response_tokens"] = res.rollout.response_tokens
  # Scoring on pipelines of 2 instances (fusion.inference_pp): 2-layer models, each process's
  # instances forming its own units.
  cfg2 = cfg.replace(num_layers=2)
  score2 = cfg2.replace(head="scalar")
  actor2 = llama.host_random_params(cfg2, 0)
  params2 = {"reference": actor2, "critic": llama.host_random_params(score2, 1),
             "reward": llama.host_random_params(score2, 2)}
  import dataclasses
  gen2 = FusedGenerator(cfg2, sampling, dataclasses.replace(config, inference_pp=2),
                        batch_size=2 * g, prompt_len=P,
                        frozen=FrozenModels(reference=cfg2, critic=score2, reward=score2),
                        actor_params=actor2, frozen_params=params2)
  res = gen2.run(actor2, params2, tokens, lens, jax.random.key(3), budgets=budgets, fuse=True,
                 rt=0.5)
  for f in FIELDS:
    out[f"piped/{f}"] = getattr(res.rollout, f)
  for m in MODELS:
    out[f"piped/{m}"] = getattr(res, m)
  out["piped/load_bytes"] = np.asarray(res.metrics["fusion/weight_load_bytes"])
  out["piped/own_load_bytes"] = np.asarray(res.by_process[jax.process_index()][4])
  return out


def fail_at_round(k: int, how: str) -> None:
  """When the fused loop reaches its k-th round this process dies (`how`='die': exit code 7,
  no clean-up) or hangs ('hang': sleeps, holding its connections open)."""
  import time

  from rlhfuse_jax.generation import fused
  read, calls = fused._Run.read, [0]

  def failing_read(self, *args):
    calls[0] += 1
    if calls[0] == k:
      if how == "die":
        os._exit(7)
      time.sleep(3600)
    return read(self, *args)
  fused._Run.read = failing_read


def main(argv):
  pid, n, port, out_dir = int(argv[1]), int(argv[2]), argv[3], argv[4]
  from rlhfuse_jax.parallel import distributed
  fail = os.environ.get("FUSED_MP_FAIL")  # "PROCESS:ROUND:die|hang" (the test's)
  distributed.initialize(f"127.0.0.1:{port}", n, pid,
                         heartbeat_timeout_s=10 if fail else None)
  if fail and int(fail.split(":")[0]) == pid:
    fail_at_round(int(fail.split(":")[1]), fail.split(":")[2])
  out = run_case(int(os.environ.get("FUSED_MP_INSTANCES", G)),
                 int(os.environ.get("FUSED_MP_SEED", 0)))
  np.savez(os.path.join(out_dir, f"proc{pid}.npz"), **out)


if __name__ == "__main__":
  main(sys.argv)
