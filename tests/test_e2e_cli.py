"""The user's entry points: ``verl-megatron train`` (re-launching itself under torchrun when the
config asks for several processes), config errors, ``check-hf``. (``launch/single_node.sh`` runs a
job at two processes in tests/test_commands.py, its start-up check included.)"""

from __future__ import annotations

import json
import os

import pytest

from tests.inprocess_launch import run_cli, warm_ranks
from tests.test_e2e import QUICKSTART, TINY
from verl_megatron import cli

ONE_STEP = [
    *TINY,
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.export_hf=false",
]


def _check_two_process_run(out_dir, key: str, value: int) -> None:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        (row,) = [json.loads(line) for line in f]
    # Throughput is per device: the run had two processes.
    assert row["perf/throughput"] == pytest.approx(row["perf/total_num_tokens"] / (row["timing_s/step"] * 2))
    with open(os.path.join(out_dir, "config.json")) as f:
        assert json.load(f)["parallel"][key] == value


@pytest.mark.multiproc
def test_train_relaunches_under_torchrun_for_several_processes(tmp_path, monkeypatch, capfd):
    """The ranks torch's launcher starts are forked from a warm process (what they run is the
    same ``-m verl_megatron.train`` command line the CLI hands the launcher)."""
    overrides = [
        *ONE_STEP,
        f"trainer.default_local_dir={tmp_path}",
        "trainer.n_gpus_per_node=2",
        "parallel.tp=2",
    ]
    with warm_ranks(str(tmp_path)) as env:
        result = run_cli(["train", "--config", QUICKSTART, *overrides], monkeypatch, capfd, env)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_two_process_run(tmp_path, "tp", 2)


def test_config_errors_exit_2_naming_the_key(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["train", "trainer.total_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'trainer.total_steps'" in err and "trainer.total_training_steps" in err
    assert cli.main(["train", "--config", "/no/such.yaml"]) == 2
    assert "config file '/no/such.yaml' does not exist" in capsys.readouterr().err
    assert cli.main(["train", "trainer.nnodes=2"]) == 2
    assert "launch/multi_node.sh" in capsys.readouterr().err


def test_subcommands(capsys, monkeypatch):
    import verl_megatron.tools.check_hf as check_hf

    seen = []
    monkeypatch.setattr(check_hf, "main", lambda argv: seen.append(argv) or 7)
    assert cli.main(["check-hf", "/models/x", "--tp", "2"]) == 7
    assert seen == [["/models/x", "--tp", "2"]]
    assert cli.main([]) == 2 and "usage: verl-megatron {train,check,check-hf,plan}" in capsys.readouterr().err
    assert cli.main(["serve"]) == 2 and "unknown command 'serve'" in capsys.readouterr().err


def _bad_source_job(tmp_path) -> list[str]:
    """The quickstart on 8 rows whose data_source has no rule in the default scorer: the reward
    check refuses it, after the config and data checks pass."""
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "no_such_source",
           "reward_model": {"ground_truth": "2"}}  # fmt: skip
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(json.dumps(row) for _ in range(8)))
    return [
        f"data.train_files=[{data}]",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]


def test_check_fails_as_train_does(tmp_path, capsys, monkeypatch):
    """``verl-megatron check`` (launch/*.sh run it before torchrun) refuses what the ranks refuse:
    the same one line and exit status 2 as ``train`` (it passed a bad data source with status 0)."""
    from verl_megatron import train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = _bad_source_job(tmp_path)
    assert train.main(job) == 2
    trained = capsys.readouterr()
    assert cli.main(["check", *job]) == 2
    checked = capsys.readouterr()
    assert checked.err == trained.err and len(checked.err.splitlines()) == 1, checked.err
    assert checked.err.startswith(
        f"error: {tmp_path / 'bad.jsonl'}: row 0: data_source='no_such_source' has no rule"
    )
    assert checked.out == trained.out == "" and not (tmp_path / "run").exists()


def test_check_and_train_run_the_same_start_up_checks(monkeypatch, capsys):
    """One function holds the start-up checks: the ranks' ``train.run``, ``check`` and the launching
    ``train`` (several processes) all call it, with the same arguments for the same world size."""
    from verl_megatron import train
    from verl_megatron.errors import ConfigError

    calls = []

    def recorded(config_path, overrides, world_size, announce=None):
        calls.append((config_path, list(overrides), world_size))
        raise ConfigError("stopped after the start-up checks")

    monkeypatch.setattr(train, "startup_checks", recorded)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = ["--config", QUICKSTART, "trainer.seed=3"]
    assert train.main(job) == 2
    assert cli.main(["check", *job]) == 2
    assert cli.main(["check", "--world-size", "4", *job]) == 2
    assert cli.main(["train", *job, "trainer.n_gpus_per_node=2"]) == 2  # before it starts torchrun
    assert calls == [
        (QUICKSTART, ["trainer.seed=3"], 1),
        (QUICKSTART, ["trainer.seed=3"], 1),
        (QUICKSTART, ["trainer.seed=3"], 4),
        (QUICKSTART, ["trainer.seed=3", "trainer.n_gpus_per_node=2"], 2),
    ]
    assert capsys.readouterr().err.count("error: stopped after the start-up checks") == 4
