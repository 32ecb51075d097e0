"""``verl-megatron plan``: exit status 0 when it fits, 3 when it does not, 2 (one line) for bad input."""

from __future__ import annotations

import json
import os

import pytest

from verl_megatron.cli import main
from verl_megatron.errors import ConfigError

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    """A model folder holding only a config.json (no weights, no tokenizer)."""
    path = tmp_path_factory.mktemp("config_only")
    (path / "config.json").write_text(json.dumps(LLAMA))
    return str(path)


def _plan(path: str, *extra: str) -> list[str]:
    return [
        "plan",
        "--config",
        "configs/grpo.yaml",
        f"model.path={path}",
        "parallel.tp=2",
        "parallel.pp=2",
        *extra,
    ]


def test_fits_exits_0_with_json(config_only, capsys):
    assert main([*_plan(config_only), "--gpus", "8", "--gpu-memory", "80GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["layout"]["dp"] == 2 and plan["gpu_bytes"] == 80 * 2**30
    # pp=2: one position per stage (no distributed optimizer: dp ranks hold the same state).
    assert [p["position"]["pp"] for p in plan["positions"]] == [0, 1]
    actor = plan["positions"][0]["roles"]["actor"]
    # bf16 params, fp32 grad buffer and master weights, two fp32 moments (+ 4-byte Adam steps).
    assert actor["grads"] == 2 * actor["params"] and actor["optimizer_master"] == actor["grads"]
    assert set(plan["positions"][0]["roles"]) == {"actor", "reference"}  # grpo.yaml: KL loss, no critic


def test_does_not_fit_exits_3_and_names_savings(config_only, capsys):
    assert main([*_plan(config_only), "--gpus", "8", "--gpu-memory", "64MiB"]) == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "saves" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "6"], "does not divide the world size 6"),
        (["--gpus", "8", "--gpu-memory", "lots"], "--gpu-memory 'lots'"),
        (["--gpus", "0"], "--gpus must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(config_only, capsys, args, message):
    assert main([*_plan(config_only), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_missing_config_json_exits_2(tmp_path, capsys):
    assert main(["plan", "--config", "configs/grpo.yaml", f"model.path={tmp_path}", "--gpus", "1"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def _json_plan(path: str, capsys, *extra: str) -> dict:
    main([*_plan(path), "--gpus", "8", "--gpu-memory", "80GiB", "--json", *extra])
    return json.loads(capsys.readouterr().out)


def test_phases_follow_offload_and_the_engine(config_only, capsys):
    base = _json_plan(config_only, capsys)["positions"][0]
    offloaded = _json_plan(config_only, capsys, "actor.megatron.optimizer_offload=true")["positions"][0]
    actor = base["roles"]["actor"]
    optimizer = actor["optimizer_master"] + actor["optimizer_moments"]
    # The optimizer leaves the GPU for the rollout and the log-probs, and is back for the update.
    assert base["phases"]["rollout"] - offloaded["phases"]["rollout"] == optimizer
    assert base["phases"]["log_probs"] - offloaded["phases"]["log_probs"] == optimizer
    assert base["phases"]["update"] == offloaded["phases"]["update"]
    # Native engine: a KV cache of layers/pp x rows x kv heads/tp x (prompt + response) x head_dim, K and V.
    rows = 128 * 5 // 2  # grpo.yaml: 128 prompts x n=5 over dp=2
    assert base["engine"] == {"kv_cache": 2 * (4 // 2) * rows * (2 // 2) * (512 + 1024) * 16 * 2}
    vllm = _json_plan(config_only, capsys, "rollout.name=vllm", "rollout.gpu_memory_utilization=0.4")
    assert vllm["positions"][0]["engine"] == {"weights_and_kv_cache": int(0.4 * 80 * 2**30)}


def test_unknown_option_is_one_line(capsys):
    assert main(["plan", "--gpus", "2", "--bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--bogus" in err and len(err.splitlines()) == 1, err


def test_planning_leaves_no_process_group_behind(config_only, capsys):
    import torch.distributed as dist

    from verl_megatron.distributed import state

    new_group = dist.new_group
    assert main([*_plan(config_only), "--gpus", "8", "parallel.pp=1"]) == 0
    assert not dist.is_initialized() and not state.is_initialized()
    assert dist.new_group is new_group


def test_readme_plan_command_runs_and_fits(capsys):
    """The README's command, as printed (a shipped config.json of Qwen3-8B at tp=2 on 8 GPUs)."""
    import shlex

    from tests.test_commands import readme_commands

    (command,) = [c for c in readme_commands() if c.startswith("verl-megatron plan")]
    assert main(shlex.split(command)[1:]) == 0
    assert "verdict: FITS" in capsys.readouterr().out


def _quickstart_plan(path: str, capsys, *extra: str) -> tuple[int, str, str]:
    args = ["plan", "--config", "configs/quickstart.yaml", f"model.path={path}", "--gpus", "2", *extra]
    status = main(args)
    out, err = capsys.readouterr()
    return status, out, err


def test_unset_micro_batch_is_derived_as_the_trainer_does(config_only, capsys):
    """quickstart.yaml leaves actor.ppo_micro_batch_size_per_gpu unset: the trainer derives a rank's
    share of a mini-batch (32 prompts x n=8 / dp=2 = 128); the plan is that of the explicit size."""
    status, derived, _ = _quickstart_plan(config_only, capsys, "--json")
    assert status == 0
    status, explicit, _ = _quickstart_plan(
        config_only, capsys, "--json", "actor.ppo_micro_batch_size_per_gpu=128"
    )
    assert status == 0 and json.loads(derived) == json.loads(explicit)
    _, other, _ = _quickstart_plan(config_only, capsys, "--json", "actor.ppo_micro_batch_size_per_gpu=64")
    actor = json.loads(derived)["positions"][0]["roles"]["actor"]
    assert (
        actor["train_activations"] > json.loads(other)["positions"][0]["roles"]["actor"]["train_activations"]
    )


def test_config_the_trainer_refuses_is_bad_input(config_only, capsys):
    status, out, err = _quickstart_plan(config_only, capsys, "actor.ppo_micro_batch_size_per_gpu=3")
    assert status == 2 and not out
    assert len(err.strip().splitlines()) == 1 and "does not divide the 128 samples" in err, err


def test_non_finite_gpu_memory_is_one_line(config_only, capsys):
    """1e400 reads as an infinite float: refused, as the trainer's trainer.memory_check_gpu_memory."""
    from verl_megatron.planner.memory_check import check_memory
    from verl_megatron.trainer.config import load_config

    assert main([*_plan(config_only), "--gpus", "8", "--gpu-memory", "1e400"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --gpu-memory '1e400' must be a positive, finite size", err
    config = load_config(
        "configs/grpo.yaml", [f"model.path={config_only}", "trainer.memory_check_gpu_memory='1e400'"]
    )
    with pytest.raises(
        ConfigError, match=r"^trainer.memory_check_gpu_memory='1e400': expected a positive size"
    ):
        check_memory(config, 8, None)


def test_the_teacher_is_checked_without_this_machines_checks(config_only):
    """The planner's config check (``validate_config(this_machine=False)``) leaves out what only the
    machine that runs the job answers for the teacher as for the student: a sequence-parallel teacher
    at tp=2 needs Transformer Engine and CUDA, which this CPU lacks (the old check refused it with the
    teacher's model check). The trainer's teacher check (this_machine=True) still refuses it here."""
    from verl_megatron.planner.command import _checked
    from verl_megatron.trainer.config import load_config, validate_config
    from verl_megatron.trainer.distill_checks import check_teacher_layout
    from verl_megatron.workers.teacher_config import TeacherConfigError

    overrides = [
        f"model.path={config_only}",
        f"algorithm.distill.teacher.model.path={config_only}",
        "algorithm.distill.teacher.parallel.tp=2",
        "algorithm.distill.teacher.model.sequence_parallel=true",
    ]
    config = _checked(load_config("configs/distill_quickstart.yaml", overrides), 2)
    layout = validate_config(config, 2, this_machine=False)
    assert (layout.tp, layout.pp, layout.dp) == (1, 1, 2)
    assert config.actor.ppo_micro_batch_size_per_gpu == 32 * 8 // 2  # derived for dp=2 by the check
    with pytest.raises(
        TeacherConfigError, match=r"^algorithm\.distill\.teacher\.model\.sequence_parallel=True"
    ):
        check_teacher_layout(config, 2)
    # The teacher's layout is still checked.
    bad = load_config(
        "configs/distill_quickstart.yaml", [*overrides[:2], "algorithm.distill.teacher.parallel.tp=3"]
    )
    with pytest.raises(
        TeacherConfigError,
        match=r"^algorithm\.distill\.teacher\.parallel: .*does not divide the world size 2",
    ):
        validate_config(bad, 2, this_machine=False)
