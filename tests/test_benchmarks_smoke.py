"""The benchmark harness: ``benchmarks/run.py --quick`` writes every section's JSON and markdown
with the expected fields and positive, finite measurements, and the harness's own arithmetic
(FLOP counts, ratios, exponent fits, tables) matches numbers worked out by hand.

No timing is asserted: the machine is shared, and quick mode's sizes are too small to mean
anything. Ratios are checked to be exactly ours / peer of the rows they come from.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = (
    "generation",
    "reward",
    "update",
    "profile",
    "grpo_step",
    "dp_scaling",
    "scaling",
    "memory",
    "bypass",
    "async",
    "sandbox",
    "lora",
    "real_shape",
)


def _load_common():
    """benchmarks/common.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_common"] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


common = _load_common()


# ----------------------------------------------------------------------------- harness arithmetic


def test_flop_counts_match_hand_computation():
    # llama L2, hidden 64, 4 heads of 16 (d_attn 64), 2 kv heads (k/v width 32), ffn 128, V 512.
    shape = common.ModelShape(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k+v, o, gate+up+down = 36864
    assert shape.matmul_params == 2 * per_layer + 64 * 512 == 106496
    # 6N + 12 L T d_attn at T = 16: 638976 + 24576; forward: 2N + 4 L T d_attn = 212992 + 8192.
    assert common.train_flops_per_token(shape, 16) == 663552.0
    assert common.forward_flops_per_token(shape, 16) == 221184.0
    assert shape.gemm_shapes(32) == [
        (32, 64, 64), (32, 64, 32), (32, 64, 64), (32, 64, 128), (32, 128, 64), (32, 64, 512)
    ]  # fmt: skip
    # Spent FLOPs: body 73728 weights at 10 positions, head 32768 at 3 rows, 7 query-key pairs.
    assert shape.head_params == 32768
    assert common.forward_flops(shape, 10, 3, 7) == 2 * (73728 * 10 + 32768 * 3) + 4 * 2 * 64 * 7 == 1674752
    # Generating 3 tokens for 2 rows after a prefill of 9 positions in 2 rows, 5 prompt columns:
    # 2 steps per row, keys 5 + 1 and 5 + 2; model FLOPs 2 x N per generated token.
    flops = common.generation_flops(shape, 2, (9, 2), 5, 3)
    assert flops == {
        "model": 2 * 106496 * 6,
        "spent": common.forward_flops(shape, 13, 6, 9 * 5 + 2 * (6 + 7)),
    }
    assert common.QWEN25_05B_SHAPE.matmul_params == 493_961_216  # Qwen2.5-0.5B: 494M less norms and biases


def test_fit_exponent_recovers_power_laws():
    assert common.fit_exponent([1, 2, 4, 8], [3, 12, 48, 192]) == pytest.approx(2.0, abs=1e-12)
    assert common.fit_exponent([64, 128, 256], [0.5, 0.5, 0.5]) == pytest.approx(0.0, abs=1e-12)
    assert common.fit_exponent([2, 4], [1.0, math.sqrt(2.0)]) == pytest.approx(0.5, abs=1e-12)
    assert common.fit_exponent([5], [1.0]) is None  # one point fits nothing
    assert common.fit_exponent([4, 4], [1.0, 2.0]) is None  # no spread in x


def test_ratio_and_best_peak():
    assert common.ratio(3.0, 4.0) == 0.75
    assert common.ratio(None, 4.0) is None
    assert common.ratio(3.0, 0.0) is None
    early = {"shapes": [{"m": 1, "k": 2, "n": 3, "gflops": 10.0}, {"m": 4, "k": 5, "n": 6, "gflops": 30.0}]}
    late = {"shapes": [{"m": 1, "k": 2, "n": 3, "gflops": 40.0}, {"m": 4, "k": 5, "n": 6, "gflops": 20.0}]}
    combined = common.best_peak(early, late)
    assert combined["peak_gflops"] == 40.0
    assert sorted(r["gflops"] for r in combined["shapes"]) == [30.0, 40.0]


def test_markdown_table_layout():
    table = common.markdown_table(["impl", "tokens/s"], [{"impl": "a", "tokens/s": 1234.5}, {"impl": "b"}])
    assert table.splitlines() == ["| impl | tokens/s |", "|---|---:|", "| a | 1,234.5 |", "| b | n/a |"]


def test_time_interleaved_alternates_and_warms_up():
    calls = []
    timings = common.time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=2, warmup=1
    )
    assert calls == ["a", "b", "a", "b", "a", "b"]  # warm-ups, then A B A B
    assert [len(t.seconds) for t in timings.values()] == [2, 2]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        common.time_interleaved({"a": lambda: None}, repeats=0)


# ----------------------------------------------------------------------------- the quick run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_results")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    return out, results, proc.stdout


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _rows(results, name):
    section = results["sections"][name]
    assert not section["errors"].get("harness"), section["errors"]
    return {row[section["columns"][0]]: row for row in section["rows"]}


def test_every_section_is_written_with_the_machine(quick_run):
    out, results, stdout = quick_run
    machine = results["machine"]
    assert machine["cpu_model"] and machine["logical_cpus"] >= 1 and machine["torch_threads"] == 1
    assert machine["versions"]["torch"] and machine["versions"]["megatron-core"]
    assert results["quick"] is True and results["threads"] == 1
    assert list(results["sections"]) == list(SECTIONS)
    for name in SECTIONS:
        on_disk = json.loads((out / f"{name}.json").read_text())
        assert on_disk["name"] == name and on_disk["machine"] == machine
        assert (out / f"{name}.md").read_text().startswith("### ")
        assert _positive(on_disk["seconds"])
    summary = (out / "summary.md").read_text()
    assert "## Ratios" in summary and machine["cpu_model"] in summary
    assert "## Ratios (ours / peer)" in stdout


def test_update_section(quick_run):
    _, results, _ = quick_run
    rows = _rows(results, "update")
    ours, peer = rows["verl-megatron"], rows["HF + torch.optim.AdamW"]
    for row in (ours, peer):
        for column in ("tokens/s (best)", "tokens/s (median)", "step_s (best)", "GFLOP/s", common.MFU_MODEL):
            assert _positive(row[column]), (row["impl"], column, row[column])
        assert row[common.MFU_MODEL] <= 100.0
        # 4 sequences of 16 tokens: tokens/s is exactly 64 / seconds.
        assert row["tokens/s (best)"] == pytest.approx(64 / row["step_s (best)"], rel=1e-12)
    section = results["sections"]["update"]
    assert section["extra"]["flops_per_token"] == 663552.0  # see test_flop_counts_match_hand_computation
    # Model FLOPs: 64 tokens x 663552. Spent: 3 x forward_flops(64 positions, head rows, 4 x 16^2
    # pairs): ours' head at the 8 response rows of each sequence, the peer's at 9 (logits_to_keep).
    model, ours_spent, peer_spent = 42467328, 3 * (2 * (73728 * 64 + 32768 * 32) + 524288), 36962304
    assert section["extra"]["flops"] == {
        "verl-megatron": {"model": model, "spent": ours_spent},
        "HF + torch.optim.AdamW": {"model": model, "spent": peer_spent},
    }
    for row, spent in ((ours, ours_spent), (peer, peer_spent)):
        assert row[common.MFU_SPENT] == pytest.approx(row[common.MFU_MODEL] * spent / model, rel=1e-12)
    assert section["ratios"]["tokens/s ours / HF (best)"] == pytest.approx(
        ours["tokens/s (best)"] / peer["tokens/s (best)"], rel=1e-12
    )


def test_grpo_step_section(quick_run):
    _, results, _ = quick_run
    section = results["sections"]["grpo_step"]
    rows = _rows(results, "grpo_step")
    ours = rows["verl-megatron"]
    assert _positive(ours["step_s (best)"])
    assert ours["mean response tokens"] == 8.0  # EOS ignored: every response has response_len tokens
    for stage in ("gen", "old_log_prob", "update_actor"):
        assert _positive(ours[stage])
    on_policy = rows["verl-megatron, on-policy"]  # actor.recompute_old_log_prob=false: no such pass
    assert on_policy["old_log_prob"] is None and _positive(on_policy["update_actor"])
    # Process CPU seconds: per stage (from the trainer's stage marks) within the step's own.
    assert _positive(ours["step CPU s (of the best step)"])
    raw = section["extra"]["raw"]["verl-megatron"]
    for step_cpu, stages in zip(raw["step_cpu_seconds"], raw["stage_cpu_seconds"], strict=True):
        assert set(stages) == {"gen", "reward", "old_log_prob", "adv", "update_actor"}
        assert 0 < sum(stages.values()) <= step_cpu + 1e-6
    for impl, parts in section["extra"]["stage_flops"].items():  # the step's FLOPs by stage
        for kind in ("model", "spent"):
            total = sum(part[kind] for part in parts.values())
            assert total == pytest.approx(section["extra"]["flops"][impl][kind], rel=1e-12)
    peer = rows.get("TRL GRPOTrainer")
    if importlib.util.find_spec("trl") is None:
        assert "TRL GRPOTrainer" in section["errors"]  # the reason is recorded, not swallowed
        return
    assert peer is not None, section["errors"]
    assert _positive(peer["step_s (best)"]) and peer["mean response tokens"] == 8.0
    key = "step time ours / TRL (best; < 1 = ours faster)"
    assert section["ratios"][key] == pytest.approx(ours["step_s (best)"] / peer["step_s (best)"], rel=1e-12)
    key = "step time ours on-policy / TRL (best; same passes as TRL)"
    assert section["ratios"][key] == pytest.approx(
        on_policy["step_s (best)"] / peer["step_s (best)"], rel=1e-12
    )


def test_bypass_section(quick_run):
    _, results, _ = quick_run
    rows = _rows(results, "bypass")
    assert set(rows) == {"off", "parity", "parity+bypass"}, results["sections"]["bypass"]["errors"]
    assert rows["parity"]["logprob diff max"] == 0.0
    assert rows["parity+bypass"]["old_log_prob_cpu_s"] == 0.0 and _positive(
        rows["parity"]["old_log_prob_cpu_s"]
    )
    # Bypass probed at its last step: the probe's own CPU seconds, none for the other variants.
    assert _positive(rows["parity+bypass"]["probe_cpu_s"]) and rows["parity"]["probe_cpu_s"] is None


def test_scaling_section(quick_run):
    out, results, _ = quick_run
    section = results["sections"]["scaling"]
    assert not section["errors"], section["errors"]
    points = [(r["sweep"], r["batch"], r["response_len"]) for r in section["rows"]]
    assert points == [("response_len", 4, 8), ("response_len", 4, 16), ("batch", 2, 8), ("batch", 4, 8)]
    assert all(_positive(r["step_s"]) and _positive(r["gen_s"]) for r in section["rows"])
    for kind in ("response_len", "batch"):
        k = section["ratios"][f"fitted exponent k, step time ~ {kind}^k"]
        assert isinstance(k, float) and math.isfinite(k)
    png = Path(section["extra"]["plot_png"])
    assert png.parent == out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lora_section(quick_run):
    _, results, _ = quick_run
    section = results["sections"]["lora"]
    assert not section["errors"], section["errors"]
    rows = _rows(results, "lora")
    full, lora = rows["full"], rows["LoRA r=4"]
    # Adam: two float32 moments per trainable parameter (+ a step scalar each); nothing for frozen ones.
    for row in (full, lora):
        assert row["state bytes / trainable param"] == pytest.approx(8.0, abs=0.02)
    # Per layer, rank 4: A [4, in] (in 64 for q k v o gate up, 128 for down) and B [out, 4].
    assert (
        lora["trainable params"]
        == 2 * (4 * (6 * 64 + 128) + 4 * (64 + 32 + 32 + 64 + 128 + 128 + 64))
        == 8192
    )
    assert section["ratios"]["optimizer state LoRA / full"] < 0.07
    assert lora["grad buffer MiB"] == pytest.approx(lora["trainable params"] * 4 / 2**20, rel=1e-12)


def test_memory_section(quick_run):
    _, results, _ = quick_run
    rows = _rows(results, "memory")
    whole = "HF forward + log_softmax, whole batch at once"
    assert set(rows) == {"verl-megatron compute_log_prob", "HF forward + log_softmax", whole}
    full_mib = 4 * 64 * 8192 * 4 / 2**20  # B * T * V float32 of the quick config = 8 MiB
    for row in rows.values():
        assert _positive(row["stage peak MiB"])
        assert row["full [B,T,V] logits MiB"] == full_mib
        assert row["peak / full logits"] == pytest.approx(row["stage peak MiB"] / full_mib, rel=1e-12)
    ratios = results["sections"]["memory"]["ratios"]
    ours = rows["verl-megatron compute_log_prob"]["stage peak MiB"]
    for peer in ("HF forward + log_softmax", whole):
        assert ratios[f"stage peak ours / {peer}"] == pytest.approx(
            ours / rows[peer]["stage peak MiB"], rel=1e-12
        )


def test_reward_and_generation_sections(quick_run):
    _, results, _ = quick_run
    reward = results["sections"]["reward"]
    assert (
        reward["rows"] == [] and "skipped in --quick" in reward["notes"][0]
    )  # tests/test_reward_bench.py runs it
    generation = _rows(results, "generation")
    assert len(generation) >= 2  # native engine and HF generate
    for row in generation.values():
        assert any(_positive(v) for k, v in row.items() if "tokens/s" in k), row
        assert _positive(row[common.MFU_MODEL]) and _positive(row[common.MFU_SPENT])
    # Model FLOPs: 2 x 106496 per token of 4 x 8; ours prefills only the real prompt tokens, HF the
    # padded 4 x 8, so ours' spent FLOPs are the smaller.
    flops = results["sections"]["generation"]["extra"]["flops"]
    assert flops["verl-megatron native engine"]["model"] == flops["HF generate"]["model"] == 2 * 106496 * 32
    assert flops["verl-megatron native engine"]["spent"] < flops["HF generate"]["spent"]


def test_profile_section(quick_run):
    _, results, _ = quick_run
    rows = _rows(results, "profile")
    stages = [s for s in rows if s != "total"]
    assert stages == [
        "forward (model)", "log-probs + loss", "backward", "communication",
        "optimizer (clip, step, zero)", "host syncs", "other",
    ]  # fmt: skip
    for side in ("ours", "peer"):
        assert _positive(rows["forward (model)"][f"{side} s"]) and _positive(rows["backward"][f"{side} s"])
        # Exclusive stages: they add up to the update's time, shares to 100 %.
        total = rows["total"][f"{side} s"]
        assert sum(rows[s][f"{side} s"] for s in stages) == pytest.approx(total, rel=1e-9)
        assert sum(rows[s][f"{side} %"] for s in stages) == pytest.approx(100.0, rel=1e-9)
    assert results["sections"]["profile"]["extra"]["host_syncs"]["ours"] > 0


def test_dp_scaling_section(quick_run):
    _, results, _ = quick_run
    section = results["sections"]["dp_scaling"]
    rows = _rows(results, "dp_scaling")
    assert sorted(rows) == [1, 2], section["errors"]
    assert rows[1]["threads / process"] == 1 and rows[2]["threads / process"] == 1  # --threads 1, split
    tokens = 2 * 2 * (8 + 8)  # prompts x group x (prompt_len + response_len) of the quick config
    for world, row in rows.items():
        assert row["tokens/s"] == pytest.approx(tokens / row["step_s (best)"], rel=1e-12)
        assert row["tokens/s per process"] == pytest.approx(row["tokens/s"] / world, rel=1e-12)
    assert section["ratios"]["tokens/s per process dp=2 / dp=1"] == pytest.approx(
        rows[2]["tokens/s per process"] / rows[1]["tokens/s per process"], rel=1e-12
    )


def test_trl_peer_runs_as_one_process(quick_run):
    """Our runtime's RANK/WORLD_SIZE must not turn TRL into a DDP run (find_unused_parameters)."""
    _, results, _ = quick_run
    raw = results["sections"]["grpo_step"]["extra"]["raw"]
    if importlib.util.find_spec("trl") is None:
        assert "TRL GRPOTrainer" not in raw
        return
    assert raw["TRL GRPOTrainer"]["ddp_wrapped"] is False
    assert raw["TRL GRPOTrainer"]["distributed_type"] == "DistributedType.NO"


def test_sandbox_section(quick_run):
    _, results, _ = quick_run
    section = results["sections"]["sandbox"]
    assert not section["errors"], section["errors"]
    rows = {(r["workload"], r["runner"]): r for r in section["rows"]}
    for workload in ("correct programs", "10% hostile"):
        ours, peer = rows[(workload, "sandboxed (ours)")], rows[(workload, "plain subprocess")]
        assert ours["samples"] == peer["samples"] == 10 and ours["mean_score"] == peer["mean_score"]
        assert section["ratios"][f"samples/s {workload}: sandboxed / plain"] == pytest.approx(
            ours["samples_per_s"] / peer["samples_per_s"], rel=1e-12
        )


def test_real_shape_section(quick_run):
    """The quick run of the Qwen2.5-0.5B-shape section (a tiny tied model here): every stage ran,
    every ratio named after issue 32's targets is there and is the one of its stage's rows."""
    _, results, _ = quick_run
    section = results["sections"]["real_shape"]
    assert not section["errors"], section["errors"]
    assert list(section["ratios"]) == [
        "generation tokens/s native / HF generate (best; same weights, sampling)",
        "generation MFU native, model FLOPs (2 x params x tokens/s / matmul peak)",
        "generation MFU native, spent FLOPs (fraction of matmul peak)",
        "generation seconds native cold call (packing included) / best warm call",
        "generation tokens/s native / HF generate, large batch (one call each; batch in config)",
        "generation MFU native, large batch, model FLOPs (fraction of matmul peak)",
        "update tokens/s ours / plain PyTorch + AdamW (best)",
        "update CPU MFU ours, model FLOPs (fraction of matmul peak)",
        "update CPU MFU ours, spent FLOPs (fraction of matmul peak)",
        "GRPO step time ours on-policy / TRL GRPOTrainer (best; same passes)",
        "log-prob stage peak ours / full [B,T,V] float32 logits",
        "log-prob stage tensor peak ours / full [B,T,V] float32 logits (repeats exactly)",
    ]
    assert all(_positive(v) for v in section["ratios"].values()), section["ratios"]
    rows = {(r["stage"], r["impl"]): r for r in section["rows"]}
    assert sorted(rows) == sorted([
        ("generation", "verl-megatron native engine"), ("generation", "HF generate"),
        ("generation", "verl-megatron native engine, cold call (packs every weight)"),
        ("generation, batch 8", "verl-megatron native engine"), ("generation, batch 8", "HF generate"),
        ("update", "verl-megatron"), ("update", "HF + torch.optim.AdamW"),
        ("GRPO step", "verl-megatron, on-policy"), ("GRPO step", "TRL GRPOTrainer"),
        ("log-prob memory", "verl-megatron compute_log_prob"),
        ("log-prob memory", "HF forward + log_softmax, whole batch at once"),
    ])  # fmt: skip
    ratios = section["ratios"]
    gen, upd = ("generation", "verl-megatron native engine"), ("update", "verl-megatron")
    assert ratios["update tokens/s ours / plain PyTorch + AdamW (best)"] == pytest.approx(
        rows[upd]["tokens/s (best)"] / rows[("update", "HF + torch.optim.AdamW")]["tokens/s (best)"],
        rel=1e-12,
    )
    assert ratios["update CPU MFU ours, model FLOPs (fraction of matmul peak)"] == pytest.approx(
        rows[upd][common.MFU_MODEL] / 100, rel=1e-12
    )
    assert ratios[
        "generation MFU native, model FLOPs (2 x params x tokens/s / matmul peak)"
    ] == pytest.approx(rows[gen][common.MFU_MODEL] / 100, rel=1e-12)
    cold = rows[("generation", "verl-megatron native engine, cold call (packs every weight)")]
    assert ratios["generation seconds native cold call (packing included) / best warm call"] == pytest.approx(
        cold["seconds (best)"] / rows[gen]["seconds (best)"], rel=1e-12
    )
    big = {
        impl: rows[("generation, batch 8", impl)] for impl in ("verl-megatron native engine", "HF generate")
    }
    assert ratios[
        "generation tokens/s native / HF generate, large batch (one call each; batch in config)"
    ] == pytest.approx(
        big["verl-megatron native engine"]["tokens/s (best)"] / big["HF generate"]["tokens/s (best)"],
        rel=1e-12,
    )
    for row in big.values():  # the large call's own new tokens (12), not the headline call's (8)
        assert row["tokens/s (best)"] * row["seconds (best)"] == pytest.approx(8 * 12, rel=1e-12), row
    assert any(
        note.startswith("generation, where the time goes") and "cold call" in note
        for note in section["notes"]
    )
    grpo = [
        rows[("GRPO step", impl)]["seconds (best)"]
        for impl in ("verl-megatron, on-policy", "TRL GRPOTrainer")
    ]
    assert ratios["GRPO step time ours on-policy / TRL GRPOTrainer (best; same passes)"] == pytest.approx(
        grpo[0] / grpo[1], rel=1e-12
    )
    assert ratios["log-prob stage peak ours / full [B,T,V] float32 logits"] == pytest.approx(
        rows[("log-prob memory", "verl-megatron compute_log_prob")]["peak / full logits"], rel=1e-12
    )
    assert section["notes"][0].startswith("targets missed: ")
    assert any(note.startswith("update, where the time goes") for note in section["notes"])
    assert any(note.startswith("GRPO step, where the time goes") for note in section["notes"])
    assert set(section["extra"]["stage_seconds"]) == {"generation", "update", "grpo_step", "memory"}
