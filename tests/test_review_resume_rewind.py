"""A resume from an earlier step into a folder holding later steps (a rewind) is refused at start-up."""

from __future__ import annotations

import os

import pytest

from verl_megatron.checkpoint import storage
from verl_megatron.trainer.config import load_config
from verl_megatron.trainer.run_dir import LOCK_FILE, OutputDirError, claim_output_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


def _save(root, step: int) -> None:
    part = storage.start_part(root, step, "actor")
    (part / "w.bin").write_text(f"run X step {step}")
    storage.publish_part(root, step, "actor", {"step": step, "name": "actor"})
    storage.commit_step(root, step, max_ckpt_to_keep=None)


def _config(out, *overrides: str):
    return load_config(
        QUICKSTART, [f"trainer.default_local_dir={out}", "trainer.max_actor_ckpt_to_keep=2", *overrides]
    )


def _tree(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def test_a_rewind_into_a_folder_with_later_steps_is_refused_and_nothing_moves(tmp_path):
    out = tmp_path / "run"
    for step in range(10, 101, 10):
        _save(out, step)
    before = _tree(out)
    config = _config(
        out, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'global_step_50'}"
    )
    with pytest.raises(OutputDirError) as info, claim_output_dir(config, rank=0):
        pass
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"trainer.resume_from_path={out / 'global_step_50'} resumes step 50, ")
    assert f"trainer.default_local_dir={out} holds later complete checkpoints " in line
    assert "global_step_60, global_step_70, global_step_80, ... global_step_100 (5 steps)" in line
    assert "Choose another trainer.default_local_dir, or move those steps out of" in line
    assert "trainer.resume_mode=auto" in line
    assert _tree(out) == before  # nothing deleted or moved

    # A checkpoint elsewhere resumed into this folder: the same refusal.
    other = tmp_path / "other"
    _save(other, 30)
    config = _config(
        out, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={other}/global_step_30"
    )
    pattern = r"resumes step 30, .* global_step_40, global_step_50, global_step_60, \.\.\. global_step_100 \(7 steps\)"
    with pytest.raises(OutputDirError, match=pattern), claim_output_dir(config, rank=0):
        pass


def test_resuming_the_newest_step_and_auto_still_work(tmp_path):
    out = tmp_path / "run"
    for step in (10, 20):
        _save(out, step)
    for overrides in (
        ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'global_step_20'}"],
        ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={out}"],  # a root: its newest step
        ["trainer.resume_mode=auto"],
    ):
        with claim_output_dir(_config(out, *overrides), rank=0) as notes:
            assert len(notes) == 1 and "global_step_20 has no saved config" in notes[0], (overrides, notes)
