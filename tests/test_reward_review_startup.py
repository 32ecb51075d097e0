"""Reward misconfigurations that used to pass start-up and train on all-zero rewards (or fail
after the models were built) are refused by check_reward_config, one line naming the key/file/row."""

from __future__ import annotations

import json

import pytest

from verl_megatron.data.dataset import DataFormatError
from verl_megatron.errors import ConfigError
from verl_megatron.reward.loading import check_reward_config


def _data(tmp_path, source="openai/gsm8k", truths=("1", "2")) -> str:
    path = tmp_path / "train.jsonl"
    rows = [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"ground_truth": t},
        }
        for t in truths
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _config(data: str, manager: str = "naive", scorer: str | None = None, **kwargs) -> dict:
    config = {
        "reward_model": {"reward_manager": manager, "reward_kwargs": kwargs},
        "data": {"train_files": [data]},
    }
    if scorer is not None:
        config["custom_reward_function"] = {"path": scorer, "name": "compute_score"}
    return config


def _refused(config, error=ConfigError) -> str:
    with pytest.raises(error) as err:
        check_reward_config(config)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unknown_data_source_without_custom_scorer(tmp_path):
    data = _data(tmp_path, source="my_task")
    message = _refused(_config(data))
    assert f"{data}: row 0: data_source='my_task' has no rule" in message and "openai/gsm8k" in message
    check_reward_config(_config(_data(tmp_path)))  # a known source passes
    # The final reward reads only the reward model: the rule is never asked.
    config = _config(data)
    config["reward_model"].update(enable=True, combine="rm")
    check_reward_config(config)


def test_null_ground_truth_for_the_default_scorer(tmp_path):
    data = _data(tmp_path, truths=("1", None))
    message = _refused(_config(data), DataFormatError)
    assert message.startswith(f"{data}: row 1: reward_model.ground_truth is null")


@pytest.mark.parametrize(
    "manager, scorer, needle",
    [
        (
            "naive",
            "def compute_score(solution_str, ground_truth):\n    return 1.0\n",
            "unexpected keyword argument 'data_source'",
        ),
        (
            "batch",
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
            "keyword arguments (data_sources, solution_strs, ground_truths, extra_infos)",
        ),
    ],
)
def test_custom_scorer_signature_must_take_the_managers_arguments(tmp_path, manager, scorer, needle):
    path = tmp_path / "score.py"
    path.write_text(scorer)
    message = _refused(_config(_data(tmp_path, source="my_task"), manager, str(path)))
    assert f"custom_reward_function.name='compute_score' in '{path}'" in message and needle in message
    if manager == "batch":  # the per-sample call form takes it (and any data source)
        check_reward_config(_config(_data(tmp_path, source="my_task"), "naive", str(path)))


@pytest.mark.parametrize(
    "manager, kwargs, needle",
    [
        ("naive", {"compute_score_timeout": 0}, "compute_score_timeout must be a positive number"),
        ("dapo", {"isolation": "proc"}, "isolation must be one of"),
        ("parallel", {"num_processes": 0}, "num_processes must be >= 1, got 0"),
    ],
)
def test_bad_manager_argument_values(tmp_path, manager, kwargs, needle):
    message = _refused(_config(_data(tmp_path), manager, **kwargs))
    assert message.startswith("reward_model.reward_kwargs: ") and needle in message


def test_dapo_overlong_buffer_checked_with_the_trainers_arguments(tmp_path):
    config = _config(_data(tmp_path), "dapo")
    config["data"]["max_response_length"] = 4
    config["reward_model"]["overlong_buffer"] = {"enable": True, "len": 8, "penalty_factor": 1.0}
    message = _refused(config)
    assert "max_resp_len must be larger than overlong_buffer.len (4 < 8)" in message
    config["data"]["max_response_length"] = 16
    check_reward_config(config)


def test_dapo_validation_manager_gets_the_overlong_buffer_as_in_verls_recipe():
    from types import SimpleNamespace as NS

    from verl_megatron.trainer.components import reward_fns

    buffer = {"enable": True, "len": 2, "penalty_factor": 1.0, "log": False}
    config = NS(
        reward_model=NS(reward_manager="dapo", num_examine=0, overlong_buffer=buffer, reward_kwargs={}),
        data=NS(max_response_length=8, reward_fn_key="data_source"),
        custom_reward_function=NS(path=None),
    )
    train, val = reward_fns(config, object())
    for manager in (train, val):
        assert manager.overlong_enabled and (manager.buffer_len, manager.max_resp_len) == (2, 8)
        manager.close()
