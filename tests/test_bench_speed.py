"""bench/speed.py and the random-weight model it builds, on CPU with the tiny preset.

The benchmark itself runs on a GPU host, where a broken figure costs device time: here it runs end to end at
toy sizes so that every figure it writes is checked for presence and sanity first.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from qwen4exp.checkpoint.presets import preset_config
from qwen4exp.checkpoint.random_weights import fill_random, random_model
from qwen4exp.checkpoint.writer import write_random_checkpoint
from qwen4exp.engine.draft_length import StepCosts
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.loading import build_model, load_model
from qwen4exp.engine.model.config import ModelConfig
from qwen4exp.engine.request import Request

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_script(name: str):
    if str(BENCH) not in sys.path:      # the scripts import their helpers beside them, as when run from bench/
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_model_equals_the_written_checkpoint_loaded(tmp_path):
    """Same draws, same placement (fused experts, PLE shards) as writer + loader, tensor for tensor."""
    ours = random_model("tiny", dtype=torch.float32, device="cpu", seed=3)
    path = write_random_checkpoint(tmp_path / "ck", "tiny", seed=3, dtype=torch.float32, shard_bytes=1_000_000,
                                   progress=False)
    loaded = load_model(str(path), dtype=torch.float32, device="cpu", progress=False)
    a, b = ours.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different[:5]


def test_every_tensor_is_written_and_seeds_differ():
    config = preset_config("tiny", dtype="float32")
    cfg = ModelConfig.from_dict(config)
    models = []
    for seed in (0, 1):
        model = build_model(cfg, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.fill_(math.nan if tensor.is_floating_point() else -1)
        fill_random(model, config["text_config"], seed, torch.float32)
        state = model.state_dict()
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
        assert all((t >= 0).all() for t in state.values() if not t.is_floating_point())
        models.append(state)
    same = [n for n, t in models[0].items() if t.is_floating_point() and torch.equal(t, models[1][n])]
    assert not same, same[:5]
    constants = [n for n, t in models[0].items() if not t.is_floating_point()]
    assert constants and all(torch.equal(models[0][n], models[1][n]) for n in constants)


def test_random_model_gives_finite_spread_logits():
    speed = load_script("speed")
    model = random_model("tiny", dtype=torch.float32, device="cpu")
    engine = Engine(model, slots=2, context=256, chunk=32)
    probe = speed.LogitsProbe(model)
    request = engine.submit(Request(prompt_ids=list(range(5, 105)), max_tokens=4))
    engine.run_until_idle()
    logits = probe.close()
    assert len(request.output_ids) == 4
    assert logits["checked"] > 0 and logits["finite"] and 1 < logits["std"] < 100


def test_speed_smoke(tmp_path):
    """speed.py end to end at toy sizes, then plot_speed.py on its output."""
    speed = load_script("speed")
    out = tmp_path / "speed.json"
    argv = ["--random-weights", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--out", str(out),
            "--slots", "4", "--chunk", "32", "--restore-spacing", "16", "--prefill", "64,128,4096",
            "--max-prefill", "128", "--ttft-tokens", "128", "--restore-tokens", "48", "--decode-steps", "4",
            "--ttft-prompts", "8,40,4096", "--max-ttft-prompt", "64",
            "--decode-warmup", "1", "--copy-mib", "8", "--matmul-size", "384", "--ceiling-reps", "5",
            "--hf-decode-steps", "3"]
    transformers = importlib.util.find_spec("transformers") is not None
    if transformers:
        argv.append("--compare-transformers")
    returned = speed.main(argv)
    r = json.loads(out.read_text())
    assert r["settings"]["slots"] == 4 and returned["date_utc"] == r["date_utc"]
    for key in ("date_utc", "command", "device_name", "versions"):
        assert r[key]
    assert "commit" in r and r["versions"]["torch"] == torch.__version__

    assert r["ceilings"]["copy"]["bytes_per_s"] > 0 and r["ceilings"]["matmul"]["flops_per_s"] > 0
    s = r["startup"]
    assert 0 < s["model_s"] < s["ready_s"] and s["engine_s"] > 0 and s["first_request_s"] > 0
    assert s["logits"]["finite"] is True

    assert [d["busy"] for d in r["decode"]] == [1, 2, 4]
    for d in r["decode"]:
        assert d["ms_per_step"] > 0 and d["roofline_ms_per_step"] > 0 and 0 < d["ratio"] <= 1.5
        assert d["tokens_per_s"] == pytest.approx(d["busy"] * 1000 / d["ms_per_step"])
        parts = d["roofline_bytes"]
        assert all(parts[k] > 0 for k in ("dense_weights", "routed_experts", "state"))
    # More rows pull more distinct experts, never more than all of them.
    experts = [d["roofline_bytes"]["routed_experts"] for d in r["decode"]]
    assert experts == sorted(experts) and experts[-1] <= 8 * 8 * r["model"]["bytes_per_expert"]

    ran = [p for p in r["prefill"] if "seconds" in p]
    assert [p["tokens"] for p in ran] == [64, 128]
    assert r["prefill"][2] == {"tokens": 4096, "skipped": "over --max-prefill 128"}
    for p in ran:
        assert p["seconds"] > 0 and p["roofline_s"] > 0 and 0 < p["ratio"] <= 1.5
        assert p["flops"]["total"] > p["flops"]["linear"] > 0 and p["flops"]["attention"] > 0

    pc = r["prefix_cache"]
    assert pc["prompt_tokens"] == 128 and pc["cold_ttft_s"] > 0 and pc["warm_ttft_s"] > 0
    assert pc["identical"] is True and pc["cold_cached_tokens"] == 0 and pc["warm_cached_tokens"] >= 96
    assert pc["restore"]["identical"] is True and pc["restore"]["restores"] == 1
    assert 0 < pc["restore"]["restored_tokens"] == pc["restore"]["cached_tokens"] <= 48
    assert pc["restore"]["restore_ms"] > 0

    # Each cold prompt length timed twice plain and once split into parts that add up to its time.
    assert r["first_tokens"]["warm_up_s"] is None                    # the worker warms up on GPUs only
    prompts = r["first_tokens"]["prompts"]
    assert [f["tokens"] for f in prompts] == [8, 40]
    for f in prompts:
        assert f["first_s"] > 0 and f["plain_s"] > 0 and f["finish_reason"] == "length" and f["error"] is None
        assert f["parts_s"]["forward"] > 0 and f["parts_s"]["sampling"] > 0
        assert sum(f["parts_s"].values()) == pytest.approx(f["ttft_s"])
        assert 0 < f["forward_launch_s"] <= f["parts_s"]["forward"]
    # The 40-token prompt crosses a restore point (spacing 16, chunk 32): its chunk's snapshot was captured.
    assert prompts[0]["parts_s"]["capture"] == 0 and prompts[1]["parts_s"]["capture"] > 0

    if transformers:
        h = r["transformers"]
        assert h["decode_ms_per_step"] > 0 and h["prefill_s"] > 0 and h["prefill_tokens"] == 128
        assert h["decode_speedup"] > 0 and h["prefill_speedup"] > 0 and h["our_prefill_source"] == "prefill"
        assert h["greedy_ids_agree"] is True and h["greedy_ids_compared"] >= 4   # float32 on CPU: exact

    plots = load_script("plot_speed").main([str(out), "--out-dir", str(tmp_path / "plots")])
    assert [p.name for p in plots] == ["speed_decode.png", "speed_prefill.png", "speed_ttft.png"]
    assert all(p.stat().st_size > 10_000 for p in plots)


def test_speed_on_a_random_gguf_mix_counts_the_blocks_a_step_reads(tmp_path):
    """--quant builds the mix's quantized weights as random blocks in place; the roofline counts their bytes."""
    from qwen4exp.engine.model.quant_blocks import LAYOUTS

    speed = load_script("speed")
    out = tmp_path / "speed.json"
    r = speed.main(["--random-weights", "--preset", "tiny", "--quant", "ud-q4_k_xl", "--device", "cpu", "--dtype",
                    "float32", "--out", str(out), "--slots", "2", "--chunk", "32", "--restore-spacing", "16",
                    "--prefill", "64", "--ttft-tokens", "64", "--restore-tokens", "32", "--decode-steps", "2",
                    "--ttft-prompts", "8,40", "--decode-warmup", "1", "--busy", "1,2", "--copy-mib", "8",
                    "--matmul-size", "256", "--ceiling-reps", "3"])
    cfg = ModelConfig.from_dict(preset_config("tiny"))
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    # tiny's 64-wide rows take Q8_0 for gate/up (Q4_K needs 256); down rows are Q5_1 but on layers 2 and 4 (Q8_0)
    def row_bytes(qtype: str, values: int) -> int:
        return values // LAYOUTS[qtype][0] * LAYOUTS[qtype][1]

    down = (6 * row_bytes("Q5_1", inter) + 2 * row_bytes("Q8_0", inter)) / 8
    blocks_per_expert = 2 * inter * row_bytes("Q8_0", hidden) + hidden * down
    assert r["model"]["quant"] == "ud-q4_k_xl"
    assert r["model"]["bytes_per_expert"] == blocks_per_expert
    assert r["startup"]["logits"]["finite"] is True
    assert all(d["roofline_bytes"]["routed_experts"] > 0 and d["ms_per_step"] > 0 for d in r["decode"])
    with pytest.raises(SystemExit):
        speed.parse_args(["--checkpoint", "x", "--quant", "q8_0", "--out", "y"])


def test_the_roofline_counts_an_fp8_models_mtp_experts_apart_from_the_routed_ones():
    """An FP8 model keeps its MTP layer's experts as float8 blocks too: they are the head's bytes, not a 49th
    layer of routed experts (which the count check refused)."""
    from qwen4exp.checkpoint.random_weights import random_model

    speed = load_script("speed")
    model = random_model("tiny", dtype="float32", device="cpu", quant="fp8")
    work = speed.Work(model)
    cfg = model.config
    assert work.params["routed"] == cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * \
        cfg.hidden_size
    assert work.params["mtp"] > cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size


def test_the_draft_choice_on_a_measured_step_table_loses_little_and_keeps_what_pays():
    """bench/draft_policy.py over the step costs an H100 measured for the full model's first 24 layers: with drafts
    rarely taken the engine's choice stays within 7% of plain decoding where 3 drafts a step lose half, and with
    drafts mostly taken it keeps (nearly) all that 3 drafts a step gain."""
    policy = load_script("draft_policy")
    results = json.loads((BENCH.parent / "docs/results/mtp_full24_ud_q4_k_xl_costs160_h100_2026-12-06_831ac2a.json")
                         .read_text())
    for slots, entry in results["slots"].items():
        run = entry["oracle_together_accuracy_0.72_adaptive"]
        costs, plain = StepCosts.from_table(run["step_costs_ms"]), int(slots) / (run["plain_ms_per_step"] / 1e3)
        rare = {adaptive: policy.tokens_per_second(costs, int(slots), 0.1, 1500, adaptive) / plain
                for adaptive in (False, True)}
        assert rare[True] > 0.93 and rare[False] < 0.6, (slots, rare)
        likely = {adaptive: policy.tokens_per_second(costs, int(slots), 0.9, 1500, adaptive)
                  for adaptive in (False, True)}
        assert likely[True] > 0.97 * likely[False] > plain, (slots, likely)
