"""Each formula of the forecast against a hand-computed case, the published figures, and the CLI."""

import dataclasses
import json

import pytest

from vescale_plugins.forecast import ForecastSettings, forecast, forecast_world_size, load_hardware, resolve_model
from vescale_plugins.forecast.__main__ import main, parse_args
from vescale_plugins.forecast.calibrate import calibrate, fit_alpha_beta
from vescale_plugins.forecast.comm_model import all_reduce_s, collective_s
from vescale_plugins.forecast.compute import activation_bytes, block_activation_elements, training_flops_per_token
from vescale_plugins.forecast.hardware import GPUS
from vescale_plugins.forecast.layouts import plan_unit_layouts, rank_payloads
from vescale_plugins.forecast.memory import ADAMW8BIT_BYTES_PER_ELEMENT, forecast_memory, optimizer_bytes_per_element
from vescale_plugins.forecast.model import ModelSpec
from vescale_plugins.forecast.step_time import _exposed
from vescale_plugins.observe.record import zero_stage_bytes_per_parameter
from vescale_plugins.planner import Layout
from vescale_plugins.tools.model_catalog import CATALOG, CONFIGS, ModelUnits, Unit, model_from_config

# A dense Llama whose every dim divides 8 ranks: no padding for either engine.
TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


def _tiny_spec():
    return ModelSpec("tiny", model_from_config("tiny", TINY), TINY)


# -- communication -------------------------------------------------------------------


def test_ring_collective_time_by_hand():
    # One node of 4 ranks, 4 MB: 3 steps of (10 us + 1 MB / 1 GB/s).
    node = dataclasses.replace(GPUS["h100"], intra_node_latency_s=1e-5, intra_node_bandwidth=1e9)
    assert collective_s(4e6, 4, node) == pytest.approx(3 * (1e-5 + 1e-3))
    assert all_reduce_s(4e6, 4, node) == pytest.approx(6 * (1e-5 + 1e-3))
    assert collective_s(4e6, 1, node) == 0.0


def test_groups_inside_a_node_use_nvlink():
    # 16 ranks on two nodes of 8: 14 NVLink steps, one network step, the network's bandwidth.
    h100 = GPUS["h100"]
    assert collective_s(8e6, 8, h100) == pytest.approx(
        7 * (h100.intra_node_latency_s + 1e6 / h100.intra_node_bandwidth)
    )
    across = 14 * h100.intra_node_latency_s + h100.inter_node_latency_s + 8e6 * 15 / 16 / h100.inter_node_bandwidth
    assert collective_s(8e6, 16, h100) == pytest.approx(across)


def test_alpha_beta_fit_recovers_the_constants():
    alpha, beta, n = 2e-5, 3e9, 2
    sizes = [2**k for k in range(16, 25, 2)]
    times = [(n - 1) * (alpha + b / n / beta) for b in sizes]
    fitted_alpha, fitted_beta = fit_alpha_beta(sizes, times, n)
    assert fitted_alpha == pytest.approx(alpha)
    assert fitted_beta == pytest.approx(beta)
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_alpha_beta([1, 2], [0.2, 0.1], n)


@pytest.mark.distributed
def test_calibrate_writes_a_hardware_file_the_forecast_loads(tmp_path):
    """A short sweep on 3 gloo processes (figures vary by machine: only their sanity is checked;
    the ring is fitted at the ranks measured, which become a node)."""
    path = tmp_path / "cpu.json"
    figures = calibrate(str(path), sizes_bytes=[2**12, 2**24], repeats=3, timeout_s=240, ranks=3)
    hardware = load_hardware("h100", str(path))
    assert hardware.gpus_per_node == 3
    assert "3 ranks" in hardware.name
    assert hardware.intra_node_bandwidth == figures["intra_node_bandwidth"] > 0
    assert hardware.peak_flops_fp32 > 0
    assert hardware.memory_bandwidth > 0
    assert not hardware.overlaps_communication
    assert set(figures["measured"]["timings"]) == {
        "fsdp2_all_gather",
        "fsdp2_reduce_scatter",
        "vescale_all_gather",
        "vescale_reduce_scatter",
    }


def test_calibrate_needs_two_ranks(tmp_path, capsys):
    with pytest.raises(ValueError, match="--calibrate-ranks 1: collectives need at least 2 ranks"):
        calibrate(str(tmp_path / "cpu.json"), ranks=1)
    with pytest.raises(SystemExit):
        parse_args(["--calibrate", str(tmp_path / "cpu.json"), "--calibrate-ranks", "1"])
    assert "--calibrate-ranks 1: collectives need at least 2 ranks" in capsys.readouterr().err


def test_exposed_communication_under_one_unit_prefetch():
    # Forward: G0 (0.5) + max(0, G1 - F0) = 0.5 + 2. Backward: G1 (3) first, then while unit 1
    # computes (2 s) the gather of unit 0 (0.5) is hidden; while unit 0 computes (2 s) the
    # reduce-scatter of unit 1 (1) is hidden; the last reduce-scatter R0 (1) is exposed.
    assert _exposed([1.0, 1.0], [2.0, 2.0], [0.5, 3.0], [1.0, 1.0]) == pytest.approx(6.5)


# -- layouts and memory -----------------------------------------------------------------


def test_rank_payloads_by_hand():
    # Tensor 0: elements [0, 6), tensor 1: [8, 11); shards of 4 over 3 ranks.
    layout = Layout((6, 3), (1, 1), 3, 1, 4, (0, 8), 3)
    assert rank_payloads(layout) == [4, 2, 3]
    assert rank_payloads(layout, [8.0, 1.0]) == [32, 16, 3]


def test_optimizer_bytes_per_element():
    assert optimizer_bytes_per_element("adamw", "mlp.up_proj.weight", (8, 4)) == 8
    assert (
        optimizer_bytes_per_element("adamw8bit", "mlp.up_proj.weight", (8, 4))
        == ADAMW8BIT_BYTES_PER_ELEMENT
        == 2 + 8 / 1024
    )
    assert optimizer_bytes_per_element("muon", "mlp.up_proj.weight", (8, 4)) == 4
    for name, shape in (
        ("input_layernorm.weight", (8,)),
        ("embed_tokens.weight", (16, 8)),
        ("lm_head.weight", (16, 8)),
    ):
        assert optimizer_bytes_per_element("muon", name, shape) == 8
    with pytest.raises(ValueError, match="--optimizer 'sgd'"):
        optimizer_bytes_per_element("sgd", "w", (2, 2))


def _state_without_step_counters(spec, world, engine):
    tensors = sum(u.count * len(u.params) for u in spec.units.units)
    m = forecast_memory(spec, world, "bf16-mixed", "adamw", (0, 0))[engine]
    assert m.padding_elements == 0
    return m.sharded_state - 4 * tensors  # torch's 4-byte AdamW step counter per tensor


def test_zero3_16_bytes_per_parameter_to_the_byte():
    """The seed's ZeRO-3/FSDP state model, bf16-mixed AdamW: 16 bytes per parameter over the
    group, to the byte, wherever nothing pads: Llama-3-70B under FSDP2 (every dim 0 divides
    8 and 64), and a stack of 8 Linear(1024, 1024) under both engines."""
    llama = resolve_model("Llama-3-70B")
    for world in (8, 64):
        assert _state_without_step_counters(llama, world, "fsdp2") == 16 * llama.units.numel // world
        assert (
            16 * llama.units.numel // world
            == zero_stage_bytes_per_parameter(world)["ZeRO-3 / FSDP"] * llama.units.numel
        )
    stack = ModelSpec("linears", ModelUnits("linears", (Unit("linear", 8, (("weight", (1024, 1024)),)),)), {})
    for engine in ("vescale", "fsdp2"):
        assert _state_without_step_counters(stack, 8, engine) == 16 * 8 * 1024 * 1024 // 8


def test_fsdp2_pads_gpt_oss_experts_to_256_ranks():
    """GPT-OSS-120B at 256 ranks, FSDP2's Shard(0) padding by hand: 128 experts (and the
    128-row router) fill half the ranks; 2880 rows pad to 12 x 256 = 3072; 64 sinks to 256;
    the 201088-row vocabulary to 786 x 256."""
    spec, world = resolve_model("GPT-OSS-120B"), 256
    layer = (
        (256 - 64)  # sinks
        + 192 * 4096
        + 192  # o_proj weight and bias
        + 128 * 2880
        + 128  # router weight and bias
        + 128 * 2880 * 5760
        + 128 * 5760  # gate_up_proj and its bias
        + 128 * 2880 * 2880
        + 128 * 2880  # down_proj and its bias
        + 2 * 192  # the two norms
    )
    vocab = (786 * 256 - 201088) * 2880
    total = 36 * layer + vocab + 192 + vocab
    memory = forecast_memory(spec, world, "bf16-mixed", "adamw", (0, 0))
    assert memory["fsdp2"].padding_elements == total // world
    assert memory["vescale"].padding_elements < memory["fsdp2"].padding_elements / 2


def test_gpt_oss_at_256_gpus_of_80_gb():
    """The paper's case: FSDP2 runs out of memory on 256 x 80 GB, veScale-FSDP fits."""
    spec = resolve_model("GPT-OSS-120B")
    for gpu in ("h100", "a100"):
        entry = forecast_world_size(spec, load_hardware(gpu), 256, ForecastSettings())
        assert entry["engines"]["fsdp2"]["oom"]
        assert not entry["engines"]["vescale"]["oom"]


def test_hsdp_shards_over_the_group_and_all_reduces_across_replicas():
    spec, h100 = resolve_model("Llama-3-8B"), load_hardware("h100")
    hybrid = forecast_world_size(spec, h100, 64, ForecastSettings(replicas=8))
    flat = forecast_world_size(spec, h100, 8, ForecastSettings())
    assert hybrid["shard_group"] == 8
    for engine in ("vescale", "fsdp2"):
        assert hybrid["engines"][engine]["memory"] == flat["engines"][engine]["memory"]
        # The same reduce-scatter inside the node, plus an all-reduce across 8 nodes.
        assert (
            hybrid["engines"][engine]["step"]["reduce_scatter_s"] > flat["engines"][engine]["step"]["reduce_scatter_s"]
        )
    with pytest.raises(ValueError, match="--hsdp 3 does not divide 64"):
        forecast_world_size(spec, h100, 64, ForecastSettings(replicas=3))


def test_quantized_collectives_move_about_half_the_bytes_and_add_their_kernels():
    spec, h100 = resolve_model("Llama-3-8B"), load_hardware("h100")
    exact = forecast_world_size(spec, h100, 1024, ForecastSettings())["engines"]
    weights = forecast_world_size(spec, h100, 1024, ForecastSettings(comm="int8"))["engines"]
    both = forecast_world_size(spec, h100, 1024, ForecastSettings(comm="int8-grads"))["engines"]
    slow = forecast_world_size(spec, h100, 1024, ForecastSettings(comm="int8", quant_bytes_per_s=1e9))["engines"]
    assert weights["fsdp2"] == exact["fsdp2"]  # FSDP2's figures unchanged
    v, w, b = exact["vescale"]["step"], weights["vescale"]["step"], both["vescale"]["step"]
    # Half the bytes (bf16 to int8 and scales), the ring's latency unchanged.
    assert 0.5 * v["all_gather_s"] < w["all_gather_s"] < 0.7 * v["all_gather_s"]
    assert w["reduce_scatter_s"] == v["reduce_scatter_s"]
    assert b["reduce_scatter_s"] < 0.5 * v["reduce_scatter_s"]  # fp32 reductions: about a quarter of the bytes
    assert v["copy_s"] < w["copy_s"] < b["copy_s"] < slow["vescale"]["step"]["copy_s"]


def test_muon_root_holds_its_largest_matrix():
    spec = _tiny_spec()
    memory = forecast_memory(spec, 8, "bf16-mixed", "muon", (0, 0))
    # The largest hidden matrix is 128 x 64 (embedding and head go to AdamW): 3 fp32 copies.
    assert memory["vescale"].optimizer_transient == 3 * 4 * 128 * 64
    adamw = forecast_memory(spec, 8, "bf16-mixed", "adamw", (0, 0))
    assert memory["vescale"].optimizer_state < adamw["vescale"].optimizer_state


# -- compute -----------------------------------------------------------------------------


def test_flops_per_token_by_hand():
    spec, seq = _tiny_spec(), 32
    q, kv, h, inter, vocab = 64, 32, 64, 128, 256
    block_matmuls = h * q + 2 * h * kv + q * h + 3 * h * inter
    expected = 2 * (6 * block_matmuls + 6 * seq * q) + 6 * vocab * h  # the embedding is a lookup
    assert training_flops_per_token(spec, seq, activation_checkpointing=False) == expected
    recomputed = 2 * 8 * (block_matmuls + seq * q) + 6 * vocab * h
    assert training_flops_per_token(spec, seq, activation_checkpointing=True) == recomputed


def test_moe_counts_top_k_of_its_experts():
    spec = resolve_model("Mixtral-8x7B")
    dense_like = training_flops_per_token(
        ModelSpec("m", spec.units, {**spec.config, "num_experts_per_tok": 8}), 1, False
    )
    assert training_flops_per_token(spec, 1, False) < dense_like / 3


def test_activation_bytes_by_hand():
    spec, tokens = _tiny_spec(), 10
    h, q, kv, inter, vocab = 64, 64, 32, 128, 256
    per_block = 4 * h + 2 * q + 2 * kv + 4 * inter
    assert block_activation_elements(spec.units.units[1], TINY) == per_block
    logits = vocab * (2 + 8)
    without, with_checkpointing = activation_bytes(spec, tokens, 2)
    assert without == tokens * (2 * 2 * per_block + logits)
    assert with_checkpointing == tokens * ((2 * h + per_block) * 2 + logits)


def test_moe_block_activations_scale_with_top_k():
    config = CONFIGS["Qwen3-30B-A3B"]
    block = next(u for u in CATALOG["Qwen3-30B-A3B"].units if u.name == "decoder_layer")
    h, q, kv, routed = 2048, 32 * 128, 4 * 128, 768
    assert block_activation_elements(block, config) == 4 * h + 2 * q + 2 * kv + 8 * (h + 4 * routed)


# -- inputs: models, hardware, the command line ----------------------------------------------


def test_hf_config_json_gives_the_catalogue_model(tmp_path):
    path = tmp_path / "gpt-oss-120b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**CONFIGS["GPT-OSS-120B"], "model_type": "gpt_oss"}))
    assert resolve_model(str(path)).units.units == CATALOG["GPT-OSS-120B"].units
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        model_from_config("x", {"model_type": "bert"})
    with pytest.raises(ValueError, match="neither a catalogue model"):
        resolve_model("no-such-model")


def test_hardware_file_overrides_fields(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"inter_node_bandwidth": 1e9, "gpus_per_node": 4}))
    hardware = load_hardware("h100", str(path))
    assert hardware.inter_node_bandwidth == 1e9
    assert hardware.gpus_per_node == 4
    assert hardware.peak_flops_bf16 == GPUS["h100"].peak_flops_bf16
    path.write_text(json.dumps({"nvlink": 1}))
    with pytest.raises(ValueError, match=r"unknown hardware fields \['nvlink'\]"):
        load_hardware("h100", str(path))
    with pytest.raises(ValueError, match="--gpu 'v100'"):
        load_hardware("v100")


def test_cli_writes_tables_json_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "f.json", tmp_path / "f.png"
    assert (
        main(
            [
                "--model",
                "Llama-3-8B",
                "--gpus",
                "8,64",
                "--gpu",
                "h200",
                "--optimizer",
                "adamw8bit",
                "--json",
                str(out),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert [e["world_size"] for e in result["world_sizes"]] == [8, 64]
    assert plot.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "Llama-3-8B on 64 x H200" in printed
    assert "tokens/s per GPU" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "8,x"], "comma-separated integers"),
        (["--gpus", "64", "--hsdp", "3"], "--hsdp 3 does not divide --gpus [64]"),
        (["--mfu", "1.5"], "--mfu 1.5"),
    ],
)
def test_cli_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_largest_model_at_16k_ranks_plans_identical_units_once():
    spec = resolve_model("DeepSeek-V3-671B")
    result = forecast(spec, load_hardware("h100"), [16384], ForecastSettings())
    entry = result["world_sizes"][0]
    assert (
        entry["engines"]["vescale"]["memory"]["padding_elements"]
        < entry["engines"]["fsdp2"]["memory"]["padding_elements"]
    )
    moe = next(u for u in spec.units.units if u.name == "moe_decoder_layer")
    assert plan_unit_layouts(moe, 16384) is plan_unit_layouts(moe, 16384)
