"""Reward containment under the default config: a user's scorer that exits, crashes,
hangs or returns NaN scores 0 and is counted, and training goes on; hung calls are cut
off side by side; worker processes do not outlive their manager; a bad scorer file is
reported at start-up (one ``error:`` line, exit code 2) before any model is built."""

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from omegaconf import OmegaConf
from verl_megatron.workers.reward_manager.scoring import DEFAULT_TIMEOUT_S

from tests.test_e2e import QUICKSTART, TINY
from tests.test_reward_managers import make_batch
from verl_megatron import cli
from verl_megatron.errors import ConfigError
from verl_megatron.trainer.ppo.reward import check_reward_config, load_reward_manager
from verl_megatron.utils.local_assets import build_char_tokenizer
from verl_megatron.workers.reward_manager import NaiveRewardManager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Behaviour chosen by the response text; anything else scores its length.
BAD_SCORER = textwrap.dedent(
    """
    import ctypes, os, sys, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "exitzero":
            sys.exit(0)
        if solution_str == "exitone":
            os._exit(1)
        if solution_str == "raise":
            raise RuntimeError("bad scorer")
        if solution_str == "sleep":
            time.sleep(1e6)
        if solution_str == "segv":
            ctypes.string_at(0)
        if solution_str == "nan":
            return float("nan")
        return float(len(solution_str))
    """
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tok"))


@pytest.fixture(scope="module")
def bad_scorer(tmp_path_factory):
    path = tmp_path_factory.mktemp("scorer") / "bad_scorer.py"
    path.write_text(BAD_SCORER)
    return str(path)


def default_config(path, **reward_kwargs):
    """The trainer's default reward section, with a custom scorer file."""
    return OmegaConf.create(
        {
            "data": {"reward_fn_key": "data_source"},
            "reward_model": {"reward_manager": "naive", "reward_kwargs": reward_kwargs},
            "custom_reward_function": {"path": path, "name": "compute_score", "reward_kwargs": {}},
        }
    )


def _live(pid: int) -> bool:
    """True while ``pid`` runs (a zombie or a reaped process is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_defaults_contain_user_scorers(tok, bad_scorer):
    manager = load_reward_manager(default_config(bad_scorer), tok)
    assert isinstance(manager, NaiveRewardManager)
    assert manager.compute_score_timeout == DEFAULT_TIMEOUT_S == 30.0
    assert manager.isolated  # a user's file: in a worker process
    assert not NaiveRewardManager(tok, 0).isolated  # the built-in scorer: in this process


@pytest.mark.parametrize(
    ("case", "counter"),
    [
        ("exitzero", "error"),
        ("exitone", "error"),
        ("raise", "error"),
        ("segv", "error"),
        ("nan", "invalid"),
        ("sleep", "timeout"),
    ],
)
def test_each_failure_scores_zero_and_is_counted(tok, bad_scorer, case, counter):
    # The default config, except for the sleep case: its 30 s limit is lowered to 1 s
    # with verl's keyword, so the test waits 1 s rather than 30.
    kwargs = {"compute_score_timeout": 1.0} if case == "sleep" else {}
    manager = load_reward_manager(default_config(bad_scorer, **kwargs), tok)
    rows = [("p", "ab", "s", "g"), ("p", case, "s", "g"), ("p", "abcd", "s", "g")]
    try:
        with pytest.warns(RuntimeWarning, match="1 of 3 sample"):
            out = manager(make_batch(tok, rows), return_dict=True)
    finally:
        manager.close()
    # The other samples keep their scores (the worker is replaced after a crash).
    assert out["reward_tensor"][0, 1].item() == 2.0 and out["reward_tensor"][2, 3].item() == 4.0
    assert out["reward_tensor"][1].abs().sum().item() == 0.0
    expected = {f"reward/{kind}_count": 0 for kind in ("timeout", "error", "invalid")}
    expected[f"reward/{counter}_count"] = 1
    assert out["reward_metrics"] == expected
    assert out["reward_extra_info"][f"reward/{counter}_count"] == [0, 1, 0]


@pytest.mark.parametrize("manager_name", ["naive", "parallel"])
def test_hung_calls_are_cut_off_side_by_side(tok, bad_scorer, manager_name):
    # 50 samples, 10 of them hang; limit 1 s (the other calls return in microseconds, and the
    # failure cases above use 1 s too). One after another they would cost >= 10 s.
    timeout, hung = 1.0, 10
    texts = ["sleep" if i % 5 == 2 else "x" * (1 + i % 7) for i in range(50)]
    kwargs = {"compute_score_timeout": timeout}
    if manager_name == "parallel":
        kwargs["num_processes"] = 2
    config = default_config(bad_scorer, **kwargs)
    config.reward_model.reward_manager = manager_name
    manager = load_reward_manager(config, tok)
    data = make_batch(tok, [("p", text, "s", "g") for text in texts])
    try:
        manager(data[:1])  # workers started
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=f"{hung} of 50 sample"):
            out = manager(data, return_dict=True)
        elapsed = time.monotonic() - start
        # The pool is back to its size, every extra worker started past a hung call gone.
        assert len(manager._pool._workers) == (2 if manager_name == "parallel" else 1)
    finally:
        manager.close()
    assert out["reward_metrics"]["reward/timeout_count"] == hung
    assert out["reward_metrics"]["reward/error_count"] == 0
    serial = hung * timeout
    assert elapsed < 0.5 * serial, (
        f"{hung} hung calls took {elapsed:.1f} s; one after another: {serial:.0f} s"
    )
    scores = out["reward_tensor"].sum(-1).tolist()
    assert scores == [0.0 if text == "sleep" else float(len(text)) for text in texts]


def test_workers_end_with_close_and_with_garbage_collection(tok, bad_scorer):
    before = {p.pid for p in multiprocessing.active_children()}
    config = default_config(bad_scorer, compute_score_timeout=1.0)
    config.reward_model.reward_manager = "parallel"
    config.reward_model.reward_kwargs.num_processes = 3
    data = make_batch(tok, [("p", text, "s", "g") for text in ["ab", "sleep", "exitone", "abc"] * 2])
    pids = []
    for close in (True, False):
        manager = load_reward_manager(config, tok)
        with pytest.warns(RuntimeWarning):
            manager(data)
        pids += [w.process.pid for w in manager._pool._workers]
        if close:
            manager.close()
        del manager
        gc.collect()
    assert len(pids) == 6
    assert not [pid for pid in pids if _live(pid)]
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_a_worker_dies_with_a_trainer_killed_hard(tmp_path, bad_scorer):
    # The parent is SIGKILLed while its worker sleeps in a scorer: the worker must not linger.
    script = textwrap.dedent(
        f"""
        import sys
        from verl_megatron.utils.reward_score.custom import load_custom_compute_score
        from verl_megatron.workers.reward_manager.scoring import ScorerPool, ScoreTask
        pool = ScorerPool(load_custom_compute_score({bad_scorer!r}), num_workers=1, timeout=None)
        pool._ensure_workers(1)
        print(pool._workers[0].process.pid, flush=True)
        task = dict(data_source="s", solution_str="sleep", ground_truth="g")
        pool.map([ScoreTask(task)])
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        worker_pid = int(child.stdout.readline())
        assert _live(worker_pid)
        time.sleep(0.5)  # the call is running
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    deadline = time.monotonic() + 10
    while _live(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _live(worker_pid)


# ---------------------------------------------------------------- start-up check

BAD_FILES = {
    "syntax": ("import os\n\ndef compute_score(a, b\n", "line 3: SyntaxError"),
    "import": ("import os\nimport no_such_module_xyz\n", "line 2: importing it raised ModuleNotFoundError"),
    "name": ("def compute_scores(**kwargs):\n    return 1.0\n", "did you mean 'compute_scores'?"),
    "top_level_exit": ("import sys\nsys.exit(0)\n", "line 2: importing it called sys.exit(0)"),
    "top_level_os_exit": ("import os\nos._exit(4)\n", "importing it ended the interpreter (exit code 4)"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_scorer_file_is_one_error_line_and_exit_2_before_any_model(case, tmp_path, capsys, monkeypatch):
    source, expected = BAD_FILES[case]
    path = tmp_path / f"{case}.py"
    path.write_text(source)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def no_model(*args, **kwargs):
        raise AssertionError("the scorer file must be checked before the runtime and model are built")

    monkeypatch.setattr("verl_megatron.distributed.parallel.init_runtime", no_model)
    out_dir = tmp_path / "out"
    argv = ["train", "--config", QUICKSTART, *TINY, f"trainer.default_local_dir={out_dir}"]
    assert cli.main([*argv, f"custom_reward_function.path={path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert str(path) in err[0] and expected in err[0] and "compute_score" in err[0], err[0]
    assert not out_dir.exists()


def test_check_reward_config_names_unknown_manager_arguments(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("def compute_score(**kwargs):\n    return 1.0\n")
    check_reward_config(default_config(str(good), compute_score_timeout=5))
    with pytest.raises(
        ConfigError, match=r"reward_kwargs.compute_score_timout: .*did you mean 'compute_score_timeout'"
    ):
        check_reward_config(default_config(str(good), compute_score_timout=5))


# ---------------------------------------------------------------- end to end

EXITING_SCORER = textwrap.dedent(
    """
    import os, sys
    from verl_megatron.utils.reward_score import default_compute_score

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if int(ground_truth) % 3 == 0:
            sys.exit(0)
        if int(ground_truth) % 3 == 1:
            os._exit(1)
        return default_compute_score(data_source, solution_str, ground_truth)
    """
)


def test_training_survives_a_scorer_that_exits(tmp_path, pool1):
    """The run goes through ``verl_megatron.cli train`` in a warm pool process (how the trainer
    starts is not the subject here; a fresh interpreter would import megatron again)."""
    scorer = tmp_path / "exiting_scorer.py"
    scorer.write_text(EXITING_SCORER)
    out_dir = tmp_path / "out"
    overrides = [
        *TINY,
        f"trainer.default_local_dir={out_dir}",
        f"custom_reward_function.path={scorer}",
        "trainer.total_training_steps=1",
        "trainer.test_freq=1",
        "trainer.save_freq=-1",
        "trainer.export_hf=false",
    ]
    (result,) = pool1.run(
        "tests.helpers:cli_train_job",
        argv=["train", "--config", QUICKSTART, *overrides],
        entry="verl_megatron.cli",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    with open(out_dir / "metrics.jsonl") as f:
        for line in f:
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    from verl_megatron.data.dataset import read_rows

    val = read_rows(str(out_dir / "assets" / "data" / "val.parquet"))
    failing = sum(int(r["reward_model"]["ground_truth"]) % 3 != 2 for r in val)
    assert 0 < failing < len(val)
    for step in (0, 1):  # before training and after the step: every failing sample counted
        assert rows[step]["val/reward/error_count"] == failing
        assert rows[step]["val/reward/timeout_count"] == rows[step]["val/reward/invalid_count"] == 0
    assert rows[1]["reward/error_count"] > 0
