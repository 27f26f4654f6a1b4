"""Scoring on a pipeline of stages (inference/stages.py) equals the whole model's scorer: the
reference log-probs, critic values and reward scores, for unrolled and scanned parameters, a
tied LM head, grouped-query attention, padded rows and 2 or 4 stages; each stage holds only its
layers (and the embedding or head where it is used)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.inference import scoring
from rlhfuse_jax.inference import stages
from rlhfuse_jax.models import llama
from rlhfuse_jax.models import sequences
from rlhfuse_jax.parallel import mesh as mesh_lib

ACTOR = llama.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
                          num_heads=4, num_kv_heads=2, max_seq_len=64, dtype="float32")
CRITIC = ACTOR.replace(head="scalar")
MB, P, T = 6, 5, 7


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  prompt = rng.integers(1, 48, (MB, P)).astype(np.int32)
  plens = rng.integers(1, P + 1, MB).astype(np.int32)
  resp = rng.integers(1, 48, (MB, T)).astype(np.int32)
  rlens = rng.integers(0, T + 1, MB).astype(np.int32)
  rlens[0], plens[0] = T, P
  tokens = np.asarray(sequences.build_sequences(prompt, plens, resp, rlens, pad_id=0))
  return tokens, plens, rlens


def _pipelined(cfg, params, kind, pp, tokens, plens, rlens, temperature=1.0):
  x = tokens
  for s in range(pp - 1):
    x = stages.hidden(cfg, stages.stage_params(cfg, params, pp, s), x, pp=pp, first=s == 0)
  return np.asarray(stages.scores(cfg, stages.stage_params(cfg, params, pp, pp - 1), x, tokens,
                                  plens, rlens, kind=kind, pp=pp, num_response=T,
                                  temperature=temperature))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("variant", ["unrolled", "scanned", "tied"])
def test_stages_score_as_the_whole_model(pp, variant):
  actor = ACTOR.replace(tie_embeddings=variant == "tied", scan_layers=variant == "scanned")
  critic = CRITIC.replace(scan_layers=variant == "scanned", score_pad_id=0)
  ap = jax.tree.map(jnp.asarray, llama.host_random_params(actor, 0))
  cp = jax.tree.map(jnp.asarray, llama.host_random_params(critic, 1))
  tokens, plens, rlens = _batch()
  want = {"reference": scoring.response_logprobs(actor, ap, tokens, plens, T, 0.7),
          "critic": scoring.critic_values(critic, cp, tokens, plens, T),
          "reward": scoring.reward_model_scores(critic, cp, tokens, plens, rlens)}
  got = {"reference": _pipelined(actor, ap, "reference", pp, tokens, plens, rlens, 0.7),
         "critic": _pipelined(critic, cp, "critic", pp, tokens, plens, rlens),
         "reward": _pipelined(critic, cp, "reward", pp, tokens, plens, rlens)}
  for k in want:
    np.testing.assert_allclose(got[k], np.asarray(want[k]), rtol=1e-5, atol=1e-5, err_msg=k)
  assert np.ptp(got["reward"]) > 0 and np.ptp(got["reference"]) > 0  # not a constant


def test_each_stage_holds_its_own_layers_and_the_ends_their_tables():
  cfg = ACTOR.replace(num_layers=4)
  params = llama.host_random_params(cfg, 0)
  parts = [stages.stage_params(cfg, params, 4, s) for s in range(4)]
  assert [sorted(p) for p in parts] == [["embed", "layers"], ["layers"], ["layers"],
                                        ["head", "layers"]]
  for s, p in enumerate(parts):  # stage s holds layers s (one per stage), in order
    for got, want in zip(jax.tree.leaves(p["layers"]["block"]),
                         jax.tree.leaves(params[f"layers_{s}"]), strict=True):
      np.testing.assert_array_equal(got[0], want)
  whole = sum(x.nbytes for x in jax.tree.leaves(params))
  sizes = [stages.stage_nbytes(cfg, params, 4, s) for s in range(4)]
  assert sum(sizes) == whole  # every weight once
  tied = cfg.replace(tie_embeddings=True)
  tp = llama.host_random_params(tied, 0)
  assert sorted(stages.stage_params(tied, tp, 2, 1)) == ["embed", "head", "layers"]
  assert sorted(stages.stage_params(tied.replace(head="scalar"), tp, 2, 1)) == ["head", "layers"]


def test_a_split_that_does_not_divide_the_layers_is_refused():
  with pytest.raises(ValueError, match=r"fusion.inference_pp=3: must divide the 4 layers"):
    stages.check_split(ACTOR, 3, "config.fusion.inference_pp")
  with pytest.raises(ValueError, match=r"expected an integer >= 1"):
    stages.check_split(ACTOR, 0, "config.fusion.inference_pp")


def test_the_last_stage_on_tensor_devices_holds_one_copy_of_its_share_of_the_logits():
  """The last stage's reference log-probs with the vocabulary split over `tensor` (an instance
  of gen_tp devices): its temporaries are one float32 copy of each device's V/tp columns of the
  logits, half of tensor 1's. Through log_softmax they were two copies (1.00x tensor 1's)."""
  cfg = ACTOR.replace(vocab_size=16384, num_layers=2)
  pp, rows, seq, t = 2, 4, 48, 32
  one = 4.0 * rows * t * cfg.vocab_size  # float32 logits [rows, T, V]
  shapes = jax.eval_shape(lambda p: stages.stage_params(cfg, p, pp, pp - 1),
                          llama.param_shapes(cfg))
  temps = {}
  for tp in (1, 2):
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=tp), jax.devices()[:tp])
    params = mesh_lib.abstract(shapes, stages.stage_shardings(cfg, shapes, pp, pp - 1, mesh))
    rep = mesh_lib.replicated(mesh)
    x = jax.ShapeDtypeStruct((rows, seq, cfg.hidden_size), jnp.float32, sharding=rep)
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=rep)
    lens = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rep)
    low = stages.scores.lower(cfg, params, x, tokens, lens, lens, kind="reference", pp=pp,
                              num_response=t, mesh=mesh)
    temps[tp] = low.compile().memory_analysis().temp_size_in_bytes
    assert temps[tp] == pytest.approx(one / tp, rel=0.1), (tp, temps[tp] / one)
  assert temps[2] < 0.6 * temps[1], temps
