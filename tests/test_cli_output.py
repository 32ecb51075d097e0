"""What a user sees: --version, a fast plain-text --help, the start-up line, step k/N with the
time left; and rollout.log_prob_micro_batch_size_per_gpu, which must be read or refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib.metadata import version

import pytest

from verl_megatron import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
HEAVY = ("torch", "megatron", "transformers")


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"verl-megatron {version('verl-megatron')}"


def test_help_is_plain_text(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and "usage: verl-megatron" in out and "check-hf PATH" in out


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["--version"]])
def test_help_imports_no_heavy_library(argv):
    code = (
        "import sys\nfrom verl_megatron import cli\n"
        f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY []", result.stdout
    if argv == ["train", "--help"]:
        assert "--config" in result.stdout and "overrides" in result.stdout


class Stop(Exception):
    """Raised where the run would start its runtime: what came before is the start-up output."""


@pytest.fixture
def stop_at_runtime(monkeypatch):
    """``verl-megatron train`` in this process up to its runtime (one process, no torchrun)."""
    import verl_megatron.distributed.parallel as parallel

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(parallel, "init_runtime", stop)
    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)


def test_startup_line_comes_before_the_runtime(stop_at_runtime, capsys, tmp_path):
    with pytest.raises(Stop):
        cli.main(
            [
                "train",
                "parallel.tp=1",
                f"trainer.default_local_dir={tmp_path}",
                "trainer.total_training_steps=7",
            ]
        )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "verl-megatron train: checking configs/quickstart.yaml (default) with 3 override(s)"
    assert lines[1] == (
        "verl-megatron train: model quickstart tiny llama (2 layers, hidden 64) | float32 | "
        "tp=1 pp=1 cp=1 dp=1 (1 process) | synthetic 'reverse' task, batch 64 prompts x 8 samples | "
        f"7 steps | output {tmp_path} | derived actor.ppo_micro_batch_size_per_gpu=256 "
        "(unset: a rank's share of a mini-batch)"
    )


def test_a_run_that_keeps_no_weights_says_so_at_start_up(stop_at_runtime, capsys, tmp_path):
    for export, noted in (("false", True), ("true", False)):
        with pytest.raises(Stop):
            cli.main(["train", f"trainer.default_local_dir={tmp_path}", f"trainer.export_hf={export}"])
        lines = capsys.readouterr().out.splitlines()
        note = [line for line in lines if "keeps no weights" in line]
        assert note == (
            [
                "verl-megatron train: note: trainer.save_freq=-1 and trainer.export_hf=false, so this run keeps "
                "no weights; set trainer.save_freq=N (checkpoints) or trainer.export_hf=true (the final model)"
            ]
            if noted
            else []
        ), lines


def test_startup_line_with_data_counts_epochs():
    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.progress import DataSizes, startup_line

    config = load_config(
        QUICKSTART, ["model.path=/m", "trainer.total_training_steps=null", "trainer.total_epochs=3"]
    )
    layout = ParallelLayout(tp=2, pp=2, vpp=2, dp=2)
    line = startup_line(config, layout, 8, DataSizes(train_rows=200, val_rows=20))
    assert "model /m | float32 | tp=2 pp=2 vpp=2 cp=1 dp=2 (8 processes)" in line
    assert "200 train / 20 val rows, batch 64 prompts x 8 samples | up to 9 steps (3 epochs of 3)" in line


def test_step_clock_eta():
    from verl_megatron.trainer.progress import StepClock, format_duration

    now = [100.0]
    clock = StepClock(total_steps=10, start_step=4, clock=lambda: now[0])
    assert clock.prefix(4) == "step 4/10"  # nothing timed yet
    now[0] += 30.0  # steps 5 and 6 took 15 s each: 4 steps left
    assert clock.eta(6) == pytest.approx(60.0)
    assert clock.prefix(6) == "step 6/10 (eta 1m00s)"
    assert clock.prefix(10) == "step 10/10"
    assert StepClock(None).prefix(3) == "step 3"
    assert [format_duration(s) for s in (0, 59.4, 61, 3600 * 2 + 7 * 60)] == ["0s", "59s", "1m01s", "2h07m"]


def test_console_lines_without_a_terminal_are_plain_with_step_count(tmp_path, capsys):
    from verl_megatron.trainer.tracking import Tracking

    tracker = Tracking("p", "e", ["console"], str(tmp_path), total_steps=3)
    for step in (1, 2, 3):
        tracker.log({"critic/score/mean": 0.5}, step=step)
    tracker.finish(plot=False)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].split(" (eta")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "(eta " in lines[0] and "(eta " not in lines[2]
    assert all("\x1b" not in line for line in lines)  # no terminal codes in a log file


def test_rollout_log_prob_micro_batch_is_read_by_the_actor():
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.components import resolve_worker_configs
    from verl_megatron.trainer.config import load_config, validate_config

    config = load_config(QUICKSTART, ["rollout.log_prob_micro_batch_size_per_gpu=16"])
    assert config.actor.ppo_infer_micro_batch_size_per_gpu is None
    resolved = resolve_worker_configs(config, total_steps=5)
    assert resolved.actor.ppo_infer_micro_batch_size_per_gpu == 16
    assert resolved.actor.infer_micro_batch_size == 16

    def error(overrides):
        with pytest.raises(ConfigError) as err:
            validate_config(load_config(QUICKSTART, overrides), 1)
        return str(err.value)

    assert "keep one" in error(
        ["rollout.log_prob_micro_batch_size_per_gpu=16", "actor.ppo_infer_micro_batch_size_per_gpu=8"]
    )
    assert "set that to true instead" in error(["rollout.log_prob_use_dynamic_bsz=true"])
    assert "actor.ppo_infer_max_token_len_per_gpu" in error(["rollout.log_prob_max_token_len_per_gpu=100"])
    assert "set rollout.log_prob_micro_batch_size_per_gpu" in error(["rollout.log_prob_micro_batch_size=64"])


# fit() of a trainer (class {trainer} of the script) whose second step fails, writing under {out},
# and the threads before and after; the marker starts this trainer's part of the output.
FIT_AND_REPORT = """
OUT = {out!r}
print("TRAINER {trainer}", flush=True)
before = sorted(t.name for t in threading.enumerate())
try:
    {trainer}().fit()
except RuntimeError as err:
    print(f"ERROR {{err}}", flush=True)
print(f"THREADS {{before}} -> {{sorted(t.name for t in threading.enumerate())}}", flush=True)
"""

# fit() of a trainer whose second step fails, on a terminal, with TensorBoard on (a writer thread).
FAILING_RUN = """
import sys, threading
from verl_megatron.trainer.ppo_trainer import PPOTrainer
from verl_megatron.trainer.tracking import Tracking

class FailingTrainer(PPOTrainer):
    def __init__(self):  # no model: only what fit() touches
        self.model_rewards = self.teacher = self.reward_fn = self.val_reward_fn = None
        self.tracker = Tracking("", "", [], "", enabled=False)

    def _fit(self):
        self.tracker = Tracking("p", "e", ["console", "tensorboard"], OUT, total_steps=3)
        self.tracker.log({"critic/score/mean": 0.5}, step=1)
        raise RuntimeError("step 2 failed")
"""


# The same for the SFT trainer: its fit() builds the tracker, the second step fails.
FAILING_SFT_RUN = """
import sys, threading
from types import SimpleNamespace
from verl_megatron.trainer import sft_trainer

sft_trainer.to_dict = lambda config: {}  # a bare namespace stands in for the config

class FailingSFT(sft_trainer.SFTTrainer):
    def __init__(self):  # no model: only what fit() touches
        trainer = SimpleNamespace(
            project_name="p", experiment_name="e", logger=["console", "tensorboard"],
            default_local_dir=OUT, val_before_train=False,
        )
        self.config = SimpleNamespace(trainer=trainer)
        self.runtime = SimpleNamespace(is_main=True)
        self.total_steps, self._staged = 3, None
        self.guard = SimpleNamespace(start=lambda chunks: None, check=lambda *args: None)
        self.actor = SimpleNamespace(chunks=[])

    def _resume(self):
        return 0

    def train_step(self, step):
        if step == 2:
            raise RuntimeError("step 2 failed")
        return {"train/loss": 0.5}
"""


def _on_a_terminal(argv: list[str], timeout_s: float) -> str:
    """What ``argv`` writes to a pseudo-terminal (its stdout and stderr) until it exits."""
    import pty
    import select

    primary, secondary = pty.openpty()
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=secondary, stdout=secondary, stderr=secondary)
    os.close(secondary)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([primary], [], [], 1.0)[0]:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # EIO: the process and its terminal are gone
                    break
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return b"".join(chunks).decode(errors="replace")


TRAINERS = {"ppo": "FailingTrainer", "sft": "FailingSFT"}


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Both trainers' failing fit() one after the other in one process on a terminal (one Python
    start and one import of the trainers for both): each one's output and TensorBoard folder."""
    root = tmp_path_factory.mktemp("failed_runs")
    script = FAILING_RUN + FAILING_SFT_RUN
    for name, trainer in TRAINERS.items():
        script += FIT_AND_REPORT.format(trainer=trainer, out=str(root / name))
    output = _on_a_terminal([sys.executable, "-c", script], timeout_s=240)
    parts = output.split("TRAINER ")[1:]
    assert len(parts) == len(TRAINERS), output[-2000:]
    return {name: (part, str(root / name)) for name, part in zip(TRAINERS, parts)}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_a_failed_run_on_a_terminal_shows_the_cursor_and_closes_the_writers(failed_runs, name):
    output, out_dir = failed_runs[name]
    assert output.startswith(TRAINERS[name]) and "ERROR step 2 failed" in output, output[-2000:]
    bar = output.index("\x1b[?25l")  # the bar hides the cursor ...
    error = output.index("ERROR step 2 failed")
    assert output.count("\x1b[?25h", bar, error) == 1, repr(output[-2000:])  # ... and shows it again
    before, after = output.split("THREADS ", 1)[1].splitlines()[0].split(" -> ")
    assert before == after, (before, after)  # no writer thread left behind
    assert os.listdir(os.path.join(out_dir, "tensorboard", "p", "e"))  # TensorBoard did write: its thread ran
