"""The SFT and distillation commands printed in the README and in the recipes' headers run as
written: ``verl-megatron sft`` and the distillation quickstart to the end of step 1 (the teacher a
tiny stand-in at the path the header names), the GPU-scale templates through every start-up check
at their own world size on tiny stand-ins. (tests/test_commands.py holds the inventory.)"""

from __future__ import annotations

import json
import os
import subprocess

from tests.test_commands import _env, _in_pool, _metrics, _split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = "verl-megatron sft"
DISTILL = "verl-megatron train --config configs/distill_quickstart.yaml"
SMALL = ["trainer.total_training_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]


def _args(command: str, out_dir: str) -> tuple[dict[str, str], list[str]]:
    env, words = _split(command)
    return env, [*words, *SMALL, "quickstart.num_digits=2", f"trainer.default_local_dir={out_dir}"]


def _run(command: str, out_dir: str, cwd: str) -> subprocess.CompletedProcess:
    env, args = _args(command, out_dir)
    return subprocess.run(args, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=900)


def test_sft_then_distill_commands_run_to_step_1(tmp_path, pool1):
    from verl_megatron.trainer.quickstart import DIGITS
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    done = _run(SFT, str(tmp_path / "sft"), ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verl-megatron sft: model quickstart tiny llama" in done.stdout
    assert any(r.get("step") == 1 and "train/loss" in r for r in _metrics(str(tmp_path / "sft")))
    # The header's teacher path, relative to where the command runs: a tiny stand-in there.
    work = tmp_path / "work"
    teacher = work / "outputs" / "sft_quickstart" / "hf_export"
    build_tiny_hf_model(teacher, "llama", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, tokenizer=build_char_tokenizer(teacher, alphabet=DIGITS))  # fmt: skip
    os.symlink(os.path.join(ROOT, "configs"), work / "configs")
    # `verl-megatron train` with a config: the console script's main in a one-process pool worker
    # (tests/test_commands.py runs `verl-megatron train` itself as a process), from the same folder.
    _, args = _args(DISTILL, str(tmp_path / "distill"))
    done = _in_pool(pool1, args[1:], "verl_megatron.cli", cwd=str(work))
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(r.get("step") == 1 and "distill/reverse_kl" in r for r in _metrics(str(tmp_path / "distill")))


def test_sft_templates_pass_start_up_checks(tmp_path, no_runtime):
    """configs/sft.yaml's two header lines and the README's: every check at their world size."""
    from verl_megatron.trainer.sft_trainer import prepare_sft
    from verl_megatron.utils.local_assets import build_bpe_tokenizer, build_tiny_hf_model

    model = tmp_path / "model"
    build_tiny_hf_model(model, "qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, tokenizer=build_bpe_tokenizer(model))  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(64)))
    data = [f"data.train_files=[{rows}]", f"data.val_files=[{rows}]"]
    config = os.path.join(ROOT, "configs", "sft.yaml")
    for world, extra in ((1, []), (8, ["trainer.mode=sft", "parallel.tp=2", "parallel.pp=2"])):
        cfg, layout, sizes = prepare_sft(config, [f"model.path={model}", *data, *extra], world)
        assert cfg.trainer.mode == "sft" and layout.dp == world // (layout.tp * layout.pp)
        assert sizes.train_rows == 64
