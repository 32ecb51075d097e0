"""Nothing a user trained or logged is lost: metrics history, checkpoint integrity, the output-dir
lock, resuming with a changed config, and the guard that stops a run whose weights blow up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from verl_megatron.trainer.tracking import Tracking, read_jsonl_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


# ------------------------------------------------------------------ metrics.jsonl


def _history(path, steps) -> None:
    with open(path, "w") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "actor/pg_loss": 0.1 * step}) + "\n")


# Kills the process at a moment of the resume's rewrite of metrics.jsonl: when the first kept line
# is serialised (the file is open for writing), or just before the finished file is swapped in.
_KILL_DURING_REWRITE = """
import json, os, sys
from verl_megatron.trainer import tracking

where = sys.argv[2]
if where == "serialise":
    real = json.dumps
    def dying_dumps(obj, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 1:
            os._exit(9)
        return real(obj, *a, **k)
    tracking.json.dumps = dying_dumps
else:
    os.replace = lambda *a, **k: os._exit(9)
tracking.Tracking("p", "e", [], sys.argv[1], resume_step=2)
"""


@pytest.mark.parametrize("where", ["serialise", "replace"])
def test_a_kill_while_the_resume_rewrites_metrics_keeps_the_history(tmp_path, where):
    _history(tmp_path / "metrics.jsonl", [0, 1, 2, 3, 4])
    before = (tmp_path / "metrics.jsonl").read_text()
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_DURING_REWRITE, str(tmp_path), where],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_resume_drops_only_the_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _history(path, [0, 1, 2, 3, 4])
    tracker = Tracking("p", "e", [], str(tmp_path), resume_step=2)
    assert [r["step"] for r in read_jsonl_metrics(path)] == [0, 1, 2]
    tracker.log({"actor/pg_loss": 7.0}, step=3)
    assert read_jsonl_metrics(path)[-1] == {"step": 3, "actor/pg_loss": 7.0}
    # Nothing to drop: the file is not rewritten at all (same inode, appended to).
    inode = os.stat(path).st_ino
    Tracking("p", "e", [], str(tmp_path), resume_step=3)
    assert os.stat(path).st_ino == inode and len(read_jsonl_metrics(path)) == 4
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "temporary files left behind"


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _history(path, [0, 1])
    with open(path, "a") as f:
        f.write('{"step": 2, "actor/pg_')
    assert [r["step"] for r in read_jsonl_metrics(path)] == [0, 1]
    Tracking("p", "e", [], str(tmp_path), resume_step=1).log({"x": 1.0}, step=2)
    assert [r["step"] for r in read_jsonl_metrics(path)] == [0, 1, 2]
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON object"):
        read_jsonl_metrics(path)


# ------------------------------------------------------------------ whole runs (tiny quickstart)

QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
TINY = [
    "quickstart.num_digits=2",
    "data.train_batch_size=8",
    "data.max_response_length=3",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.save_freq=1",
    "trainer.export_hf=false",
    "trainer.logger=[console]",
]


def _train(pool, out_dir, *overrides: str, file_limit: int | None = None) -> subprocess.CompletedProcess:
    argv = ["--config", QUICKSTART, *TINY, f"trainer.default_local_dir={out_dir}", *overrides]
    (proc,) = pool.run("tests.helpers:cli_train_job", argv=argv, file_limit=file_limit)
    return proc


def _steps(out_dir) -> list[int]:
    return [r["step"] for r in read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))]


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def two_steps(pool1, tmp_path_factory):
    """A finished run: 2 steps, a checkpoint after each."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    proc = _train(pool1, out, "trainer.total_training_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _copy(src, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _rerun(pool1, two_steps, tmp_path, total_steps: int, *overrides: str) -> tuple:
    """(copy of the two-step run, its metrics file as it was, the process of training the copy
    again to ``total_steps`` with ``overrides``)."""
    out = _copy(two_steps, tmp_path)
    before = (out / "metrics.jsonl").read_text()
    return out, before, _train(pool1, out, f"trainer.total_training_steps={total_steps}", *overrides)


def _flip_a_byte(part) -> str:
    shard = sorted(p for p in os.listdir(part) if p.endswith(".distcp"))[0]
    path = os.path.join(part, shard)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert os.path.getsize(path) == size
    return shard


def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumed(pool1, two_steps, tmp_path):
    out = _copy(two_steps, tmp_path)
    shard = _flip_a_byte(out / "global_step_2" / "actor")
    proc = _train(pool1, out, "trainer.total_training_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: damaged checkpoint")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "global_step_2" in warnings[0] and shard in warnings[0] and "sha256 differs" in warnings[0]
    assert f"resuming from {out / 'global_step_1'} instead" in warnings[0]
    assert "resumed from step 1" in proc.stdout
    assert _steps(out) == [1, 2, 3]

    # Every checkpoint damaged: one error line saying how to choose one, nothing changed.
    for step in (1, 2, 3):  # 2 was saved again by the resumed run
        _flip_a_byte(out / f"global_step_{step}" / "actor")
    before = (out / "metrics.jsonl").read_text()
    proc = _train(pool1, out, "trainer.total_training_steps=4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert line.startswith(f"error: no intact checkpoint under {out}: global_step_3 (")
    assert "trainer.resume_from_path=" in line and "Traceback" not in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before


# Larger than every file of the tiny quickstart but its checkpoint shards (about 640 kB each).
_FILE_LIMIT = 500_000


def test_a_save_past_the_file_size_limit_names_the_cause_and_keeps_the_previous_step(
    pool1, two_steps, tmp_path
):
    from verl_megatron.checkpoint import storage

    out = _copy(two_steps, tmp_path)
    before = storage.read_part_meta(out / "global_step_2" / "actor")
    proc = _train(pool1, out, "trainer.total_training_steps=3", file_limit=_FILE_LIMIT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert "failed: rank 0: RuntimeError: [enforce fail at inline_container.cc" in line, line
    assert "(caused by OSError: [Errno 27] File too large)" in line, line
    assert f"file size limit (ulimit -f) {_FILE_LIMIT} bytes" in line, line
    assert storage.find_latest_checkpoint(out) == out / "global_step_2"
    assert storage.read_part_meta(out / "global_step_2" / "actor") == before


def test_a_run_resumes_past_a_step_without_its_part_marker_with_a_warning(pool1, two_steps, tmp_path):
    from verl_megatron.checkpoint import storage

    out = _copy(two_steps, tmp_path)
    (out / "global_step_2" / "actor" / storage.PART_MARKER).unlink()
    proc = _train(pool1, out, "trainer.total_training_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: damaged checkpoint")]
    assert warnings == [
        f"warning: damaged checkpoint(s) skipped: global_step_2 (checkpoint {out / 'global_step_2'} is damaged: "
        f"actor/{storage.PART_MARKER} is missing); resuming from {out / 'global_step_1'} instead"
    ], proc.stderr[-3000:]
    assert "resumed from step 1" in proc.stdout
    assert _steps(out) == [1, 2, 3]


def test_a_changed_learning_rate_is_applied_and_said_a_changed_batch_size_refused(pool1, two_steps, tmp_path):
    out, before, proc = _rerun(pool1, two_steps, tmp_path, 3, "data.train_batch_size=16")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert line.startswith(
        f"error: resuming {out / 'global_step_2'} with data.train_batch_size=16, "
        "but it was trained with data.train_batch_size=8"
    )
    assert "trainer.resume_allow_changes=true" in line
    assert (out / "metrics.jsonl").read_text() == before and not (out / "global_step_3").exists()

    proc = _train(pool1, out, "trainer.total_training_steps=3", "actor.optim.lr=2e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: actor.optim.lr 0.001 -> 0.002 (applied)" in proc.stdout.splitlines()
    rows = read_jsonl_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["actor/lr"]) for r in rows] == [(1, 1e-3), (2, 1e-3), (3, 2e-3)]
    saved = json.loads((out / "global_step_3" / "config.json").read_text())
    assert (
        saved["actor"]["optim"]["lr"]
        == 2e-3
        == json.loads((out / "config.json").read_text())["actor"]["optim"]["lr"]
    )


def test_a_changed_fixed_kl_coefficient_is_applied_on_resume(pool1, tmp_path):
    out = tmp_path / "run"
    kl = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=fixed"]
    assert (
        _train(
            pool1, out, "trainer.total_training_steps=1", *kl, "algorithm.kl_ctrl.kl_coef=0.001"
        ).returncode
        == 0
    )
    proc = _train(pool1, out, "trainer.total_training_steps=2", *kl, "algorithm.kl_ctrl.kl_coef=0.01")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: algorithm.kl_ctrl.kl_coef 0.001 -> 0.01 (applied)" in proc.stdout.splitlines()
    rows = read_jsonl_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["actor/reward_kl_penalty_coeff"]) for r in rows] == [(1, 0.001), (2, 0.01)]


def test_a_rerun_never_overwrites_an_earlier_run(pool1, two_steps, tmp_path):
    out, before, proc = _rerun(pool1, two_steps, tmp_path, 2, "trainer.resume_mode=disable")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert line.startswith(f"error: trainer.default_local_dir={out} holds checkpoints up to global_step_2")
    assert "trainer.resume_mode=auto" in line

    # Metrics but no checkpoint (a run with save_freq=-1): refused too, whatever the resume mode.
    import shutil

    for step in (1, 2):
        shutil.rmtree(out / f"global_step_{step}")
    for mode in ("auto", "disable"):
        proc = _train(pool1, out, "trainer.total_training_steps=2", f"trainer.resume_mode={mode}")
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = _error_lines(proc)
        assert line.startswith(
            f"error: trainer.default_local_dir={out} holds metrics.jsonl with 2 logged training step(s) "
            "and no checkpoint to resume from"
        )
    assert (out / "metrics.jsonl").read_text() == before


# ------------------------------------------------------------------ the output-dir lock


def test_a_second_run_in_a_locked_directory_is_refused(pool1, tmp_path):
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.run_dir import LOCK_FILE, OutputDirError, claim_output_dir

    out = tmp_path / "run"
    config = load_config(QUICKSTART, [*TINY, f"trainer.default_local_dir={out}"])
    with claim_output_dir(config, rank=0):
        proc = _train(pool1, out, "trainer.total_training_steps=1")
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = _error_lines(proc)
        assert line.startswith(
            f"error: trainer.default_local_dir={out} is in use by another run (pid {os.getpid()} on "
        )
        assert not (out / "metrics.jsonl").exists()
        with (
            pytest.raises(OutputDirError, match="is in use by another run"),
            claim_output_dir(config, rank=0),
        ):
            pass
        # Only rank 0 locks: other ranks pass (they learn rank 0's verdict under torch.distributed).
        with claim_output_dir(config, rank=1):
            pass
    with claim_output_dir(config, rank=0):  # released on exit
        pass
    # A holder that dies without cleaning up (SIGKILL, os._exit) releases it: the kernel drops flocks.
    dying = f"""
import os
from verl_megatron.trainer.config import load_config
from verl_megatron.trainer.run_dir import claim_output_dir
with claim_output_dir(load_config({QUICKSTART!r}, {[*TINY, f"trainer.default_local_dir={out}"]!r}), rank=0):
    os._exit(5)
"""
    proc = subprocess.run(
        [sys.executable, "-c", dying], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 5, proc.stderr[-2000:]
    assert (out / LOCK_FILE).exists()
    with claim_output_dir(config, rank=0):
        pass


def refused_job(out_dir: str) -> str:
    """Runs on every rank of a pool: a run into a directory another process holds."""
    from verl_megatron.train import run
    from verl_megatron.trainer.run_dir import OutputDirError

    try:
        run(QUICKSTART, [*TINY, f"trainer.default_local_dir={out_dir}", "trainer.total_training_steps=1"])
    except OutputDirError as err:
        return str(err)
    return "no error"


def test_every_rank_of_a_distributed_run_refuses_a_locked_directory(pool2, tmp_path):
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.run_dir import claim_output_dir

    out = tmp_path / "run"
    with claim_output_dir(load_config(QUICKSTART, [*TINY, f"trainer.default_local_dir={out}"]), rank=0):
        messages = pool2.run(f"{__name__}:refused_job", out_dir=str(out))
    assert len(messages) == 2 and messages[0] == messages[1], messages
    assert messages[0].startswith(
        f"trainer.default_local_dir={out} is in use by another run (pid {os.getpid()} "
    )


# ------------------------------------------------------------------ the divergence guard


def test_a_blown_up_run_stops_with_a_message_and_keeps_the_last_good_checkpoint(pool1, two_steps, tmp_path):
    from verl_megatron.checkpoint import find_latest_checkpoint
    from verl_megatron.checkpoint.storage import read_part_meta

    out = _copy(two_steps, tmp_path)
    proc = _train(pool1, out, "trainer.total_training_steps=4", "actor.optim.lr=1e6")
    assert proc.returncode == 3, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert line.startswith("error: training diverged at step 3: the actor's weight norm grew ")
    assert "actor.optim.lr=1e+06" in line and "Traceback" not in proc.stderr
    # Step 3 is logged (the blow-up is in the history) but its checkpoint is never published.
    assert _steps(out) == [1, 2, 3]
    assert find_latest_checkpoint(out) == out / "global_step_2"
    assert read_part_meta(out / "global_step_2" / "actor")["step"] == 2

    # Off: the same run "succeeds" with a destroyed model (what every run did before the guard).
    proc = _train(
        pool1,
        tmp_path / "unguarded",
        "trainer.total_training_steps=1",
        "actor.optim.lr=1e6",
        "trainer.divergence_guard.enable=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------------------ what a resume may change


def test_config_changes_are_classified_per_key():
    from verl_megatron.trainer.config import load_config, to_dict
    from verl_megatron.trainer.run_dir import _refused, config_changes

    saved = to_dict(load_config(QUICKSTART, TINY))
    new = to_dict(
        load_config(
            QUICKSTART,
            [
                *TINY,
                "actor.optim.lr=2e-3",
                "actor.optim.weight_decay=0.1",
                "rollout.n=8",
                "trainer.resume_mode=disable",  # how to resume: never reported
            ],
        )
    )
    # The trainer fills these in from other keys: not a change.
    saved["actor"]["rollout_n"], saved["actor"]["optim"]["total_training_steps"] = 4, 150
    saved["actor"]["ppo_infer_micro_batch_size_per_gpu"] = (
        512  # from rollout.log_prob_micro_batch_size_per_gpu
    )
    changes = config_changes(saved, new)
    assert changes == [
        ("actor.optim.lr", 1e-3, 2e-3),
        ("actor.optim.weight_decay", 0.0, 0.1),
        ("rollout.n", 4, 8),
    ]
    assert [_refused(key) for key, _, _ in changes] == [False, False, True]
    for key in ("data.train_batch_size", "trainer.seed", "model.path", "data.apply_chat_template_kwargs.x"):
        assert _refused(key), key
    for key in ("actor.optim.clip_grad", "parallel.tp", "trainer.total_training_steps", "data.val_files"):
        assert not _refused(key), key


def test_the_guard_stops_on_growth_nan_weights_and_repeated_skips_only():
    import torch

    from verl_megatron.trainer.guard import DivergenceGuard, DivergenceGuardConfig, TrainingDivergedError

    layer = torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.constant_(layer.weight, 0.5)  # norm 2
    guard = DivergenceGuard(DivergenceGuardConfig(), lr=1e-3)
    guard.start([layer])
    with torch.no_grad():
        layer.weight.mul_(3.9)  # just under the default 4x
    guard.check(1, {"actor/skipped_steps": 0.0}, [layer])
    with torch.no_grad():
        layer.weight.mul_(4.1)
    with pytest.raises(
        TrainingDivergedError, match=r"step 2: the actor's weight norm grew 4.1x in one step \(7.8 -> 31.98"
    ):
        guard.check(2, {}, [layer])

    guard = DivergenceGuard(DivergenceGuardConfig(max_nonfinite_steps=2), lr=1e-3)
    guard.start([layer])
    skipped = {"actor/skipped_steps": 1.0, "actor/grad_norm": float("nan")}
    guard.check(1, skipped, [layer])
    guard.check(2, {"actor/skipped_steps": 0.0}, [layer])  # a good step resets the count
    guard.check(3, skipped, [layer])
    with pytest.raises(TrainingDivergedError, match=r"step 4: 2 steps in a row had a non-finite loss"):
        guard.check(4, skipped, [layer])

    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    with pytest.raises(TrainingDivergedError, match=r"step 5: the actor's weights hold NaN/inf"):
        guard.check(5, {}, [layer])
    DivergenceGuard(DivergenceGuardConfig(enable=False), lr=1.0).check(6, skipped, [layer])  # off: no check


def test_the_guard_leaves_the_step_and_message_of_a_divergence(tmp_path):
    import json

    import torch

    from verl_megatron.trainer.guard import DivergenceGuard, DivergenceGuardConfig, TrainingDivergedError

    layer = torch.nn.Linear(4, 4, bias=False)
    marker = tmp_path / "diverged.json"
    guard = DivergenceGuard(DivergenceGuardConfig(), lr=1e-3, marker=marker)
    guard.start([layer])
    guard.check(1, {}, [layer])
    assert not marker.exists()  # a good step leaves none
    with torch.no_grad():
        layer.weight[0, 0] = float("inf")
    with pytest.raises(TrainingDivergedError) as err:
        guard.check(2, {}, [layer])
    assert json.loads(marker.read_text()) == {"step": 2, "error": str(err.value)}
