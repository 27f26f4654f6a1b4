"""Hardware presets and model shapes: positive, in sane units, consistent with ModelConfig."""
import dataclasses
import json
import re

import pytest

from rlhfuse_jax.sim import hardware, shapes


@pytest.mark.parametrize("name", sorted(hardware.HARDWARE))
def test_presets_positive_and_in_si_units(name):
  hw = hardware.get_hardware(name)
  assert 1e14 <= hw.peak_flops <= 2e15  # 100 TFLOP/s .. 2 PFLOP/s dense bf16
  assert 5e11 <= hw.hbm_bw <= 1e13  # 0.5 .. 10 TB/s
  assert 1e10 <= hw.hbm_bytes <= 2e11  # 10 .. 200 GB
  assert hw.inter_node_bw < hw.intra_node_bw < hw.hbm_bw
  assert hw.devices_per_node >= 1 and hw.source
  # Ridge point (FLOPs per byte at which decode turns compute bound) in the usual 100..400 range.
  assert 100 < hw.peak_flops / hw.hbm_bw < 400


def test_datasheet_values_and_dense_convention():
  h100 = hardware.get_hardware("h100_sxm")
  assert h100.peak_flops == pytest.approx(989.4e12)  # 1979 with sparsity / 2
  assert h100.intra_node_bw == pytest.approx(450e9)  # 900 GB/s bidirectional / 2
  assert hardware.get_hardware("h800_sxm").intra_node_bw < h100.intra_node_bw
  assert hardware.get_hardware("h200_sxm").hbm_bytes > h100.hbm_bytes
  assert hardware.get_hardware("a100_80g_sxm").peak_flops == pytest.approx(312e12)
  assert hardware.get_hardware("tpu_v5e").peak_flops == pytest.approx(197e12)
  assert hardware.get_hardware("tpu_v5p").hbm_bw == pytest.approx(2765e9)
  # Across nodes a ring runs a channel per NIC: min(NVLink, members per node x NIC).
  assert h100.link_bw(8) == h100.intra_node_bw
  assert h100.link_bw(16) == h100.link_bw(256) == pytest.approx(400e9)  # 8 x 50 GB/s
  assert h100.link_bw(4, stride=8) == h100.inter_node_bw  # one member per node
  assert h100.link_bw(8, stride=4) == pytest.approx(100e9)  # two per node
  assert h100.link_bw(2, stride=4) == h100.intra_node_bw  # devices 0 and 4: one node


def test_unknown_and_bad_presets():
  with pytest.raises(ValueError, match="known:.*h100_sxm"):
    hardware.get_hardware("h100")
  with pytest.raises(ValueError, match="hbm_bw"):
    hardware.Hardware(name="x", peak_flops=1e15, hbm_bw=0, hbm_bytes=1e10, intra_node_bw=1e11,
                      inter_node_bw=1e10, devices_per_node=8)


@pytest.mark.parametrize("name,billions", [("llama-7b", 6.74), ("llama-13b", 13.02),
                                           ("llama-33b", 32.53), ("llama-65b", 65.29)])
def test_llama_parameter_counts(name, billions):
  # LLaMA paper Table 2: 6.7B, 13.0B, 32.5B, 65.2B.
  assert shapes.get_shape(name).num_params() / 1e9 == pytest.approx(billions, rel=0.005)


def _bool_model_fields():
  import dataclasses
  from rlhfuse_jax.models import llama
  return [f.name for f in dataclasses.fields(llama.ModelConfig) if isinstance(f.default, bool)]


# Every boolean field of ModelConfig, each on its own (a new one is in the list by itself), and
# the attention's extras together.
@pytest.mark.parametrize("flags", [()] + [(f,) for f in _bool_model_fields()] +
                         [("qkv_bias", "o_bias", "qk_norm")])
def test_shape_agrees_with_model_config_and_the_built_parameters(flags):
  """Every flag is counted alike by ModelConfig.num_params, the simulator's ModelShape and the
  parameter tree the model builds, for both heads (the simulator's copy of the formula missed
  o_proj's bias after ModelConfig's was fixed; a new flag that adds parameters fails here until
  both count it)."""
  import math

  import jax
  from rlhfuse_jax.models import llama
  from rlhfuse_jax.perf import accounting
  for head in ("lm", "scalar"):
    cfg = llama.ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, head=head,
                            **{f: True for f in flags})
    built = sum(math.prod(x.shape) for x in jax.tree.leaves(llama.param_shapes(cfg)))
    shape = shapes.from_model_config(cfg)
    assert built == cfg.num_params() == shape.num_params(), (
        f"{flags}, head {head!r}: the model builds {built} parameters, "
        f"models/param_count.num_params counts {cfg.num_params()} and the simulator's "
        f"sim/shapes.ModelShape {shape.num_params()} (from_model_config): count the field in "
        "param_count.num_params and carry it into ModelShape (docs/architecture.md §8)")
    # 4 heads x 16 = 64 query columns of a 32-wide model: q, k, v, o and the gated MLP
    assert accounting.layer_matmul_params(cfg) == shape.layer_matmul_params() == (
        32 * 16 * (4 + 2 * 2) + 4 * 16 * 32 + 3 * 32 * 64)


def test_kv_bytes_and_flops():
  s = shapes.get_shape("llama-13b")
  assert s.kv_bytes_per_token() == 2 * 40 * 40 * 128 * 2  # K and V, bf16: 819200 bytes
  # Forward of one token with no context is 2 x matmul params; critic head is a vector.
  assert s.forward_flops(1, 0) == 2 * s.matmul_params()
  assert s.as_critic().num_params() < s.num_params()
  with pytest.raises(ValueError, match="known"):
    shapes.get_shape("llama-70b")


def test_tensor_parallel_degrees_must_divide_heads_kv_heads_and_mlp():
  s = shapes.ModelShape(name="33b", vocab_size=32000, hidden_size=6656,
                       intermediate_size=17920, num_layers=60, num_heads=52, num_kv_heads=52)
  assert s.tensor_parallel_error(4) is None
  assert s.tensor_parallel_error(8) == "tp8 does not divide 33b's num_heads=52, num_kv_heads=52"


def test_a_negative_head_dim_is_refused_by_name():
  """head_dim 0 means hidden_size // num_heads; a negative one was taken and made the KV
  cache's bytes per token negative (every KV pool then fits)."""
  with pytest.raises(ValueError, match="head_dim=-64 must be >= 0"):
    shapes.ModelShape(name="x", vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=4, num_kv_heads=4, head_dim=-64)


def test_a_hardware_file_changes_fields_of_its_base_preset(tmp_path):
  """--config.hardware=FILE.json: the GPUs one rents (an A100 40 GB, 4 a node) as a preset
  with some fields replaced; only the presets could be named (reproduce_ablations, plan_search,
  plan_check's HBM budget)."""
  path = tmp_path / "a100_40g_4.json"
  path.write_text(json.dumps({"base": "a100_80g_sxm", "hbm_bytes": 40e9, "devices_per_node": 4}))
  got = hardware.get_hardware(str(path))
  base = hardware.get_hardware("a100_80g_sxm")
  assert (got.name, got.hbm_bytes, got.devices_per_node) == ("a100_40g_4", 40e9, 4)
  assert (got.peak_flops, got.collective_protocols) == (base.peak_flops,
                                                        base.collective_protocols)
  for spec, message in (({"base": "h100"}, r"whose \"base\" is a preset of"),
                        ({"base": "h100_sxm", "hbm_gb": 40}, r"unknown fields \['hbm_gb'\]"),
                        ({"base": "h100_sxm", "hbm_bytes": -1}, r"hbm_bytes=-1 must be a "
                                                                r"positive"),
                        # wrong types: TypeErrors, or a bool taken as 1 byte, inf as free copies
                        ({"base": ["h100_sxm"]}, r"whose \"base\" is a preset of"),
                        ({"base": "h100_sxm", "host_to_device_bw": "fast"},
                         r"host_to_device_bw='fast' must be a positive finite number or None"),
                        ({"base": "h100_sxm", "host_to_device_bw": float("inf")},
                         r"host_to_device_bw=inf must be"),
                        ({"base": "h100_sxm", "hbm_bytes": True}, r"hbm_bytes=True must be a "
                                                                  r"positive"),
                        # a node holds whole devices (4.5 was taken, and spans computed from it)
                        ({"base": "h100_sxm", "devices_per_node": 4.5},
                         r"devices_per_node=4\.5 must be an integer >= 1"),
                        # T/G units for SI ones were taken: the search chose plans on a device
                        # 1e12 times slower (best 8.7e11 s per iteration)
                        ({"base": "h100_sxm", "peak_flops": 989},
                         r"peak_flops=989 FLOP/s, below 1e5: the file's figures are in FLOP/s "
                         r".*h100_sxm's is 9\.89.e\+14"),
                        ({"base": "h100_sxm", "hbm_bw": 3.35}, r"hbm_bw=3\.35 bytes/s, below"),
                        ({"base": "h100_sxm", "inter_node_bw": 400}, r"inter_node_bw=400 "),
                        ({"base": "h100_sxm", "hbm_bytes": 80}, r"hbm_bytes=80 bytes, below")):
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=message):
      hardware.get_hardware(str(path))


def test_a_hardware_file_sets_its_collective_latencies_and_says_which_figures_are_its(tmp_path):
  """A node without NVLink (PCIe L40S-class GPUs) kept its base preset's NCCL NVLink hop
  latencies, which no file field could change, and the reports printed the file's figures
  under the base preset's citation. collective_protocols: null (one collective_latency_s per
  call) or the file's own list; the source names the file's fields and the base's citation."""
  from rlhfuse_jax.sim import report
  from rlhfuse_jax.sim.cost_model import CostModel, Efficiency
  path = tmp_path / "l40s.json"
  spec = {"base": "a100_80g_sxm", "hbm_bytes": 48e9, "intra_node_bw": 32e9,
          "collective_protocols": None}
  path.write_text(json.dumps(spec))
  hw = hardware.get_hardware(str(path))
  assert hw.collective_protocols is None
  assert hw.source == (f"{path}: collective_protocols, hbm_bytes, intra_node_bw; the rest from "
                       "preset a100_80g_sxm (NVIDIA A100 datasheet (80GB SXM), NVIDIA DGX A100 "
                       "datasheet)")
  eff = Efficiency(collective_latency_s=7e-6)
  assert CostModel(hw, eff)._ring_s(32e9, 7, 0, 32e9) == pytest.approx(1.0 + 7e-6)
  lines = "\n".join(report.constants_section(hw.to_dict(), dataclasses.asdict(eff)))
  assert "| collective_protocols | none: efficiency.collective_latency_s per call |" in lines
  assert "| collective_latency_s | 7e-06 |" in lines  # used, not marked unused
  own = {"name": "PCIe", "base_s": 20e-6, "intra_step_s": 5e-6, "inter_step_s": 15e-6,
         "bw_fraction": 1.0}
  path.write_text(json.dumps(dict(spec, collective_protocols=[own], source="my datasheet")))
  hw = hardware.get_hardware(str(path))
  assert hw.collective_protocols == (hardware.CollectiveProtocol(**own),)
  assert hw.source.startswith(f"my datasheet; {path}: collective_protocols, hbm_bytes")
  assert CostModel(hw)._ring_s(0.0, 7, 0, 32e9) == pytest.approx(20e-6 + 7 * 5e-6)
  lines = "\n".join(report.constants_section(hw.to_dict(), {}))
  assert ("collective_protocols (the hardware file's; each collective takes the cheaper) | PCIe: "
          "20 µs a call + 5 µs a ring step inside a node, 15 µs across nodes") in lines
  assert "NCCL" not in lines
  nccl = "\n".join(report.constants_section(hardware.HARDWARE["h100_sxm"].to_dict(), {}))
  assert "NCCL's Ring constants" in nccl and "ring step on NVLink" in nccl
  for value, message in (([dict(own, latency=1)], r"collective_protocols=.*expected null"),
                         ([], r"collective_protocols=\[\]; expected null"),
                         ([dict(own, base_s="fast")], r"'PCIe': base_s='fast' must be a finite"),
                         ([dict(own, bw_fraction=2.0)], r"bw_fraction in \(0, 1\]")):
    path.write_text(json.dumps(dict(spec, collective_protocols=value)))
    with pytest.raises(ValueError, match=message):
      hardware.get_hardware(str(path))


def test_a_bad_hardware_file_is_named_with_its_flag(tmp_path):
  """plan_search / reproduce_ablations named a bad hardware file's field as "hardware 'neg':
  inter_node_bw=-5e9 ...", without the flag that gave the file."""
  from configs import ablations as ablation_config
  from rlhfuse_jax.sim.ablations import AblationConfig
  path = tmp_path / "neg.json"
  path.write_text(json.dumps({"base": "h100_sxm", "inter_node_bw": -5e9}))
  c = ablation_config.get_config()
  c.hardware = str(path)
  with pytest.raises(ValueError, match=(f"^config\\.hardware='{re.escape(str(path))}': hardware "
                                        r"'neg': inter_node_bw=-5000000000\.0 must be a positive")):
    AblationConfig.from_config_dict(c)


def test_a_key_given_twice_in_a_json_input_is_refused_naming_it(tmp_path):
  """Python's json keeps the last of two equal keys silently: an edited hardware file with
  "hbm_bytes" twice ran with the second, the first ignored. Each JSON input a user writes by hand
  (hardware file, lengths file, a checkpoint's config.json for the simulator and the loader,
  tokenizer and side-car objects) names the key instead."""
  from rlhfuse_jax import workdir as wd
  from rlhfuse_jax.models import hf_config
  from rlhfuse_jax.sim import lengths
  twice = '{"base": "h100_sxm", "hbm_bytes": 40e9, "hbm_bytes": 80e9}'
  (tmp_path / "hw.json").write_text(twice)
  with pytest.raises(ValueError, match=r"hw\.json.*the key 'hbm_bytes' appears twice"):
    hardware.get_hardware(str(tmp_path / "hw.json"))
  (tmp_path / "l.json").write_text('{"lengths": [1, 2], "lengths": [3]}')
  with pytest.raises(ValueError, match=r"l\.json.*the key 'lengths' appears twice"):
    lengths.load_lengths(str(tmp_path / "l.json"))
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / "config.json").write_text('{"hidden_size": 8, "hidden_size": 16}')
  with pytest.raises(ValueError, match=r"config\.json.*the key 'hidden_size' appears twice"):
    shapes.from_hf_config(str(tmp_path / "ckpt"), "x")
  with pytest.raises(ValueError, match=r"config\.json.*the key 'hidden_size' appears twice"):
    hf_config.read_json(str(tmp_path / "ckpt" / "config.json"))
  with pytest.raises(ValueError, match=r"config\.json.*the key 'hidden_size' appears twice"):
    wd.read_json_object(str(tmp_path / "ckpt" / "config.json"))
  # Nested objects too; equal keys in different objects are fine.
  (tmp_path / "ok.json").write_text('{"a": {"b": 1}, "c": {"b": 2}}')
  assert wd.read_json_object(str(tmp_path / "ok.json")) == {"a": {"b": 1}, "c": {"b": 2}}
  (tmp_path / "nested.json").write_text('{"a": {"b": 1, "b": 2}}')
  with pytest.raises(ValueError, match=r"the key 'b' appears twice"):
    wd.read_json_object(str(tmp_path / "nested.json"))


def test_a_shape_of_ones_own_keeps_its_name_in_the_setting_label(tmp_path):
  """plan_search.md's title and the ablations' setting labels upper-cased every shape name: a
  user's "q14" read "Q14" ("llama3-8b": "LLAMA3-8B"); the LLaMA-1 presets keep the paper's 13B."""
  from configs import ablations as ablation_config
  from rlhfuse_jax.sim.ablations import AblationConfig
  (tmp_path / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "vocab_size": 256}))
  c = ablation_config.get_config()
  c.shapes, c.pairs, c.max_new_tokens = f"q14={tmp_path}", "q14/llama-13b", "512"
  assert [s["label"] for s in AblationConfig.from_config_dict(c).settings()] == [
      "q14/13B L=512"]


# Real models' config.json fields (their HF repositories) and their parameter counts
# (transformers' num_parameters() of the released checkpoints).
HF_MODELS = {
    "llama3.2-1b": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
                     "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}},
                    1_235_814_400),
    "qwen2.5-1.5b": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                      "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                      "num_hidden_layers": 28, "num_attention_heads": 12,
                      "num_key_value_heads": 2, "tie_word_embeddings": True,
                      "max_position_embeddings": 32768, "sliding_window": 32768,
                      "use_sliding_window": False, "max_window_layers": 21,
                      "torch_dtype": "bfloat16"}, 1_543_714_304),
    "qwen3-0.6b": ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                    "num_hidden_layers": 28, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
                    "max_position_embeddings": 40960, "sliding_window": None,
                    "use_sliding_window": False, "torch_dtype": "bfloat16"}, 596_049_920),
    "mistral-7b": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                    "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "sliding_window": 4096,
                    "max_position_embeddings": 32768, "torch_dtype": "bfloat16"},
                   7_241_732_096),
}


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_config_shapes_of_real_models(name, tmp_path):
  """config.shapes='NAME=PATH': the released models' parameter counts, KV bytes per token
  (2 · layers · kv_heads · head_dim · 2 bytes) and context; Mistral-7B-v0.1's 4096-token
  sliding window is the longest the trainer runs it at (its loader refuses more)."""
  hf, params = HF_MODELS[name]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  s = shapes.from_hf_config(str(tmp_path), name)
  assert s.num_params() == params
  head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
  kv = hf.get("num_key_value_heads")
  assert s.kv_bytes_per_token() == 2 * hf["num_hidden_layers"] * kv * head_dim * 2
  assert s.max_seq_len == (4096 if name == "mistral-7b" else hf["max_position_embeddings"])


# Fields of a model the trainer's loader refuses, each with the message's pattern: the
# simulator took every one of them, and sized a Mixtral-8x7B as a dense Mistral-7B.
REFUSED = {
    "moe": ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
             "num_local_experts": 8}, r"architectures=\['MixtralForCausalLM'\] is not supported"),
    "type": ({"architectures": None, "model_type": "gemma"},
             r"no 'architectures' and model_type='gemma' is not supported"),
    "act": ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; expected 'silu'"),
    "quant": ({"quantization_config": {"quant_method": "awq"}},
              r"quantization_config is set \(quant_method='awq'\)"),
    "rope": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
             r"rope_scaling has rope_type='yarn'"),
    "partial": ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5; only full"),
    "tie": ({"tie_word_embeddings": "false"},
            r"tie_word_embeddings='false' \(str\); expected true or false"),
    "kv": ({"num_key_value_heads": 8.0}, r"num_key_value_heads=8\.0 \(float\); expected an int"),
    "head_dim": ({"head_dim": "64"}, r"head_dim='64' \(str\); expected an integer"),
    "vocab": ({"vocab_size": True}, r"vocab_size=True \(bool\); expected an integer"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_hf_config_refuses_what_the_loader_refuses(case, tmp_path):
  """A config.json the trainer's loader refuses is refused by the simulator's shape too, with
  the loader's message naming the file and the field (models/hf_config.model_fields, which
  both read)."""
  from rlhfuse_jax.models import hf_config
  change, pattern = REFUSED[case]
  hf = {**HF_MODELS["llama3.2-1b"][0], **change}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=r"shape 'mine': .*config\.json: " + pattern):
    shapes.from_hf_config(str(tmp_path), "mine")
  with pytest.raises(ValueError, match=pattern):
    hf_config.model_fields(hf)
  (tmp_path / "config.json").write_text("[]")
  with pytest.raises(ValueError, match=r"config\.json: expected a JSON object, got list"):
    shapes.from_hf_config(str(tmp_path), "mine")


SCALAR_ACTOR = (r"is a \*ForSequenceClassification \(a scalar head, a reward model's or a "
                r"critic's\): the actor needs a language model, a \*ForCausalLM checkpoint")


def test_a_sequence_classification_config_is_refused_as_a_pairs_actor(tmp_path):
  """config.shapes='rm=DIR' of a *ForSequenceClassification (a reward model's config.json)
  as a pair's actor was sized with an LM head (its vocabulary x hidden weights, its generation)
  where the trainer refuses it as init.actor_checkpoint: refused with the trainer's words. As
  a critic it is its scalar-headed self."""
  from configs import ablations as ablation_config
  from rlhfuse_jax.sim.ablations import AblationConfig
  hf = {"architectures": ["LlamaForSequenceClassification"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "pad_token_id": 0}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  assert shapes.from_hf_config(str(tmp_path), "rm").head == "scalar"
  c = ablation_config.get_config()
  c.shapes, c.pairs, c.max_new_tokens = f"rm={tmp_path}", "rm/llama-13b", "512"
  with pytest.raises(ValueError, match=re.escape(
      f"config.pairs: the actor of rm/llama-13b: config.shapes' rm={str(tmp_path)!r} ")
      + SCALAR_ACTOR):
    AblationConfig.from_config_dict(c)
  c.pairs = "llama-13b/rm"
  critic = AblationConfig.from_config_dict(c).shape("rm", "scalar")
  assert critic == shapes.from_hf_config(str(tmp_path), "rm")
  # its ForCausalLM twin is a pair's actor: the same backbone with the LM head
  (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": [
      "LlamaForCausalLM"]}))
  c.pairs = "rm/llama-13b"
  actor = AblationConfig.from_config_dict(c).shape("rm")
  assert actor == dataclasses.replace(critic, head="lm")
  # (the LM head's vocabulary x hidden weights in place of the value head's 64 and its bias)
  assert actor.num_params() - critic.num_params() == 256 * 64 - 65
