"""``trainer.memory_check``: the trainer plans every rank's memory at start-up and refuses, with
one line, a job that cannot fit, before any process group, output dir or weights exist. Also:
``trainer.mode`` and ``sft.*`` may not change when a run is resumed."""

from __future__ import annotations

import pytest

from verl_megatron.train import main

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


class _Started(Exception):
    """Raised where the run would start its process group and build (then load) the models."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random llama in HF format (the start-up checks read its weights' header)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "architectures"})).save_pretrained(
        path
    )
    return str(path)


@pytest.fixture
def job(model_dir, tmp_path, monkeypatch):
    """Overrides of a quickstart job on that model; ``init_runtime`` raises _Started, so a run
    whose check passes ends where it would start its process group and load the weights."""
    import verl_megatron.distributed.parallel as parallel

    def started(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(parallel, "init_runtime", started)
    out = tmp_path / "run"
    return [f"model.path={model_dir}", f"trainer.default_local_dir={out}"], out


@pytest.fixture(scope="module")
def peak(model_dir) -> int:
    """The planned peak of that job on one GPU (bytes)."""
    from verl_megatron.planner.command import plan_config
    from verl_megatron.trainer.preflight import prepare_run

    config, _, _ = prepare_run(None, [f"model.path={model_dir}"], 1)
    return plan_config(config, 1, 2**40).peak


def test_a_job_that_cannot_fit_is_refused_with_one_line_before_anything_is_built(job, peak, capsys):
    overrides, out = job
    assert 2**20 < peak < 2**30, peak  # the tiny model's plan: a few MiB
    rc = main([*overrides, "trainer.memory_check_gpu_memory=1MiB"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, (rc, err)
    assert err.startswith(
        "error: trainer.memory_check: this job does not fit: rank 0 (tp 0, pp 0, ep 0, dp 0) needs "
        f"{peak / 2**30:.2f} GiB in the "
    ), err
    assert "more than the 0.00 GiB of one GPU (trainer.memory_check_gpu_memory=1MiB)" in err, err
    assert not out.exists()  # no output dir claimed, no process group, no model built

    # warn: the same line, and the run goes on to build; off: no plan at all.
    with pytest.raises(_Started):
        main([*overrides, "trainer.memory_check_gpu_memory=1MiB", "trainer.memory_check=warn"])
    printed = capsys.readouterr().out
    assert f"warning: {err[len('error: ') :]}" in printed.splitlines(), printed

    import verl_megatron.planner.command as command

    def no_plan(*args, **kwargs):
        raise AssertionError("planned with trainer.memory_check=off")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(command, "plan_config", no_plan)
        import verl_megatron.planner.memory_check as memory_check

        patch.setattr(memory_check, "plan_config", no_plan)
        with pytest.raises(_Started):
            main([*overrides, "trainer.memory_check_gpu_memory=1MiB", "trainer.memory_check=off"])
        with pytest.raises(_Started):  # CPU, no size given: nothing to compare with
            main(overrides)
    assert "memory_check" not in capsys.readouterr().out


def test_a_size_that_fits_passes_and_bad_settings_are_one_line(job, peak, capsys):
    overrides, _ = job
    with pytest.raises(_Started):
        main([*overrides, f"trainer.memory_check_gpu_memory={peak}"])  # exactly the peak fits
    assert "memory_check" not in capsys.readouterr().out
    assert main([*overrides, f"trainer.memory_check_gpu_memory={peak - 1}"]) == 2

    capsys.readouterr()
    for setting, message in [
        ("trainer.memory_check=strict", "error: trainer.memory_check='strict'; expected one of"),
        ("trainer.memory_check=true", "error: trainer.memory_check='True'; expected one of"),
        ("trainer.memory_check_gpu_memory=lots", "error: trainer.memory_check_gpu_memory='lots': expected"),
    ]:
        assert main([*overrides, setting]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and len(err.splitlines()) == 1, err


def test_the_plan_holds_the_distillation_teacher(model_dir):
    """The frozen teacher's weights stay on the GPU (unless algorithm.distill.teacher.offload
    parks them between its forwards), and gkd_jsd holds the teacher's logits [B, Tr, V] of the
    whole batch through the update: both count in the planned peak."""
    import os

    from verl_megatron.planner.command import plan_config
    from verl_megatron.trainer.preflight import prepare_run

    recipe = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "distill_quickstart.yaml")

    def plan(*overrides):
        models = [f"model.path={model_dir}", f"algorithm.distill.teacher.model.path={model_dir}"]
        config, _, _ = prepare_run(recipe, [*models, *overrides], 1)
        return plan_config(config, 1, 2**40, savings=None)

    alone, taught = plan("algorithm.distill.enable=false"), plan()
    # The teacher is the tiny llama, float32: 2 layers of (2 norms, q and o 64x64, k and v 64x32,
    # gate, up and down 64x128), embedding and output 1024x64 (vocab 1000 padded to 128s), final norm.
    teacher_bytes = 4 * (2 * (2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 2 * 1024 * 64 + 64)
    assert teacher_bytes == 820480
    assert taught.worst.roles["teacher"].state.params == teacher_bytes
    assert taught.peak_phase == "update" and taught.peak - alone.peak == teacher_bytes
    assert plan("algorithm.distill.teacher.offload=true").peak == alone.peak  # parked in the update
    jsd = plan("algorithm.distill.loss=gkd_jsd")
    logits = 64 * 8 * 4 * 1000 * 4  # train_batch_size * rollout.n rows, response_length, vocab_size, float32
    assert jsd.peak - taught.peak == logits == 8_192_000
    assert jsd.worst.phases["rollout"] == taught.worst.phases["rollout"]  # computed after the rollout


def test_trainer_mode_and_sft_keys_are_refused_on_resume():
    from verl_megatron.trainer.config import default_config_path, load_config, to_dict
    from verl_megatron.trainer.run_dir import _refused, config_changes

    saved = to_dict(load_config(default_config_path(), []))
    new = to_dict(load_config(default_config_path(), ["trainer.mode=sft", "sft.max_length=512"]))
    changes = config_changes(saved, new)
    assert changes == [("sft.max_length", 1024, 512), ("trainer.mode", "rl", "sft")], changes
    assert all(_refused(key) for key, _, _ in changes)
    for key in ("sft.truncation", "sft.prompt_key", "sft.messages_key", "sft.response_key"):
        assert _refused(key), key
    assert not _refused("trainer.memory_check") and not _refused("trainer.memory_check_gpu_memory")


def test_check_refuses_a_job_that_cannot_fit_as_train_does(job, capsys, monkeypatch):
    """``verl-megatron check`` (launch/*.sh, before torchrun) runs the same memory plan: the same
    line and exit status 2 as train (it passed with status 0); under ``warn`` the warning, status 0."""
    from verl_megatron.cli import main as cli_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    overrides, out = job
    small = [*overrides, "trainer.memory_check_gpu_memory=1MiB"]
    assert main(small) == 2
    refused = capsys.readouterr().err
    assert cli_main(["check", *small]) == 2
    assert capsys.readouterr().err == refused and refused.startswith("error: trainer.memory_check: this job")
    assert cli_main(["check", *small, "trainer.memory_check=warn"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        f"warning: {refused.strip()[len('error: ') :]}",
        "verl-megatron check: the start-up checks pass for 1 process(es)",
    ]
    assert not out.exists()
