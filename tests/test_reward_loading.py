"""load_reward_manager / compute_reward: registry names, import paths, custom
scorer files (and their start-up errors), reward kwargs."""

import textwrap
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.test_reward_managers import MIXED_EXPECTED, MIXED_ROWS, expected_tensor, make_batch
from verl_megatron.trainer.ppo.reward import compute_reward, load_reward_manager
from verl_megatron.utils.local_assets import build_char_tokenizer
from verl_megatron.utils.reward_score import batch_default_compute_score, default_compute_score
from verl_megatron.workers.reward_manager import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    ParallelRewardManager,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tok"))


def config(reward_manager="naive", reward_kwargs=None, custom=None, reward_fn_key="data_source"):
    return OmegaConf.create(
        {
            "data": {"reward_fn_key": reward_fn_key},
            "reward_model": {"reward_manager": reward_manager, "reward_kwargs": reward_kwargs or {}},
            "custom_reward_function": custom or {"path": None, "name": "compute_score", "reward_kwargs": {}},
        }
    )


CUSTOM_SCORER = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        return scale * len(solution_str)

    def shouting(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0 if solution_str.isupper() else 0.0, "upper": solution_str.isupper()}
    """
)


@pytest.fixture
def scorer_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_SCORER)
    return path


def test_defaults_give_naive_manager_with_default_scorer(tok):
    manager = load_reward_manager(config(), tok, num_examine=0)
    assert type(manager) is NaiveRewardManager
    assert manager.compute_score is default_compute_score
    reward, extra = compute_reward(make_batch(tok, MIXED_ROWS), manager)
    torch.testing.assert_close(reward, expected_tensor(MIXED_EXPECTED, 4), rtol=0, atol=0)
    assert extra["reward/error_count"] == [0, 0, 0, 0]
    # A config without the optional sections works too (plain objects, no reward_model).
    bare = load_reward_manager(SimpleNamespace(), tok)
    assert type(bare) is NaiveRewardManager and bare.reward_fn_key == "data_source"


def test_manager_kwargs_from_config_and_call(tok):
    overlong = {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True}
    manager = load_reward_manager(
        config("dapo", reward_kwargs={"overlong_buffer_cfg": overlong, "max_resp_len": 12}),
        tok,
        num_examine=0,
        max_resp_len=10,  # call-site kwargs win over the config
    )
    assert type(manager) is DAPORewardManager and manager.max_resp_len == 10
    rows = [("p", "#### 12", "openai/gsm8k", "12"), ("p", "#### 12 ab", "openai/gsm8k", "12")]
    reward, extra = compute_reward(make_batch(tok, rows), manager)
    # lengths 7 and 10, expected 6: penalties -1/4*0.5 and -4/4*0.5.
    cells = {(0, 6): 1.0 - 0.125, (1, 9): 1.0 - 0.5}
    torch.testing.assert_close(reward, expected_tensor(cells, 2), rtol=0, atol=0)
    assert extra["overlong_reward"] == [-0.125, -0.5]
    parallel = load_reward_manager(config("parallel", {"num_processes": 2, "compute_score_timeout": 30}), tok)
    assert (parallel.num_processes, parallel.compute_score_timeout) == (2, 30)


def test_batch_manager_gets_the_batched_default_scorer(tok):
    manager = load_reward_manager(config("batch"), tok)
    assert type(manager) is BatchRewardManager
    assert manager.compute_score is batch_default_compute_score
    reward, _ = compute_reward(make_batch(tok, MIXED_ROWS), manager)
    torch.testing.assert_close(reward, expected_tensor(MIXED_EXPECTED, 4), rtol=0, atol=0)


def test_custom_scorer_file_with_bound_kwargs(tok, scorer_file):
    custom = {"path": str(scorer_file), "name": "compute_score", "reward_kwargs": {"scale": 0.5}}
    manager = load_reward_manager(config(custom=custom), tok)
    rows = [("p", "abc", "anything", "g"), ("p", "abcdef", "other", "g")]
    reward, _ = compute_reward(make_batch(tok, rows), manager)
    torch.testing.assert_close(reward, expected_tensor({(0, 2): 1.5, (1, 5): 3.0}, 2), rtol=0, atol=0)
    # The name defaults to compute_score; a dict-valued scorer fills the extra info.
    assert load_reward_manager(config(custom={"path": str(scorer_file)}), tok).compute_score(
        data_source="s", solution_str="ab", ground_truth="g"
    ) == pytest.approx(2.0)
    shout = load_reward_manager(config(custom={"path": str(scorer_file), "name": "shouting"}), tok)
    _, extra = compute_reward(make_batch(tok, [("p", "AB", "s", "g"), ("p", "ab", "s", "g")]), shout)
    assert extra["upper"] == [True, False] and extra["score"] == [1.0, 0.0]


def test_custom_scorer_from_file_runs_in_spawned_workers(tok, scorer_file):
    # A spawned worker cannot import the file by module name: the scorer must reload it by path.
    custom = {"path": str(scorer_file), "reward_kwargs": {"scale": 2.0}}
    manager = load_reward_manager(
        config("parallel", {"num_processes": 1, "mp_start_method": "spawn"}, custom=custom), tok
    )
    reward = manager(make_batch(tok, [("p", "abcd", "s", "g")]))
    assert reward[0, 3].item() == 8.0
    manager.close()


def test_bad_custom_scorer_fails_at_start_up_naming_path_and_function(tok, tmp_path, scorer_file):
    missing = tmp_path / "nowhere.py"
    with pytest.raises(FileNotFoundError, match=r"custom reward function file not found: .*nowhere.py"):
        load_reward_manager(config(custom={"path": str(missing)}), tok)
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n    pass\n")
    with pytest.raises(
        RuntimeError, match=r"failed to load custom reward function file .*broken.py.*SyntaxError"
    ):
        load_reward_manager(config(custom={"path": str(broken)}), tok)
    failing_import = tmp_path / "needs_missing_pkg.py"
    failing_import.write_text("import not_a_real_package_xyz\n")
    with pytest.raises(RuntimeError, match=r"needs_missing_pkg.py.*ModuleNotFoundError"):
        load_reward_manager(config(custom={"path": str(failing_import)}), tok)
    with pytest.raises(
        AttributeError, match=r"custom reward function 'score_fn' not found in .*my_reward.py"
    ):
        load_reward_manager(config(custom={"path": str(scorer_file), "name": "score_fn"}), tok)


class LengthRewardManager(NaiveRewardManager):
    """A user's manager, found by import path rather than by registered name."""


def test_manager_by_import_path_and_unknown_names(tok):
    for name in (
        "tests.test_reward_loading:LengthRewardManager",
        "tests.test_reward_loading.LengthRewardManager",
    ):
        assert type(load_reward_manager(config(name), tok)) is LengthRewardManager
    assert type(load_reward_manager(config("parallel"), tok)) is ParallelRewardManager
    with pytest.raises(
        ValueError, match=r"Unknown reward manager: fancy; registered reward managers: agent, batch, dapo"
    ):
        load_reward_manager(config("fancy"), tok)
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg'.*registered reward managers"):
        load_reward_manager(config("no_such_pkg:Manager"), tok)
    with pytest.raises(ValueError, match=r"module 'tests.test_reward_loading' has no class 'Missing'"):
        load_reward_manager(config("tests.test_reward_loading:Missing"), tok)


def test_compute_reward_with_a_bare_reward_function(tok):
    data = make_batch(tok, MIXED_ROWS)

    def bare(batch):
        return torch.ones(len(batch), 10)

    reward, extra = compute_reward(data, bare)
    torch.testing.assert_close(reward, torch.ones(4, 10))
    assert extra == {}
