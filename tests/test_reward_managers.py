"""Reward managers on hand-built batches: exact reward tensors, overlong
penalties, extra info, and containment of scorers that fail or hang."""

import math
import pickle
import re
import time

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.utils.local_assets import build_char_tokenizer
from verl_megatron.workers.reward_manager import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    ParallelRewardManager,
    PrimeRewardManager,
    get_reward_manager_cls,
    register,
)

PROMPT_LEN, RESPONSE_LEN = 6, 10


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tok"))


def make_batch(tok, rows, prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN, extra_info=None):
    """A DataProto from (prompt, response, data_source, ground_truth) rows:
    prompts left-padded to ``prompt_len``, responses right-padded to ``response_len``."""
    size = len(rows)
    prompts = torch.zeros(size, prompt_len, dtype=torch.long)
    responses = torch.zeros(size, response_len, dtype=torch.long)
    mask = torch.zeros(size, prompt_len + response_len, dtype=torch.long)
    for i, (prompt, response, _, _) in enumerate(rows):
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tok(response, add_special_tokens=False)["input_ids"]
        prompts[i, prompt_len - len(p_ids) :] = torch.tensor(p_ids)
        responses[i, : len(r_ids)] = torch.tensor(r_ids, dtype=torch.long)
        mask[i, prompt_len - len(p_ids) : prompt_len + len(r_ids)] = 1
    non_tensors = {
        "data_source": np.array([row[2] for row in rows], dtype=object),
        "reward_model": np.array([{"ground_truth": row[3]} for row in rows], dtype=object),
    }
    if extra_info is not None:
        non_tensors["extra_info"] = np.array(extra_info, dtype=object)
    tensors = {"prompts": prompts, "responses": responses, "attention_mask": mask}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def expected_tensor(cells, size, response_len=RESPONSE_LEN):
    """Zeros with ``value`` at each (row, column) of ``cells``."""
    out = torch.zeros(size, response_len, dtype=torch.float32)
    for (row, col), value in cells.items():
        out[row, col] = value
    return out


MIXED_ROWS = [
    ("q1", "#### 12", "openai/gsm8k", "12"),  # 7 tokens, right
    ("qq2", "#### 13", "openai/gsm8k", "12"),  # 7 tokens, wrong
    ("3", "1 2 0 7", "synthetic/reverse", "120"),  # 7 tokens, 3 of 4 digits right
    ("q4", "021", "synthetic/copy", "120"),  # 3 tokens, 1 of 3 right
]
MIXED_EXPECTED = {(0, 6): 1.0, (1, 6): 0.0, (2, 6): 0.75, (3, 2): 1 / 3}


# ---------------------------------------------------------------- naive / parallel


def test_naive_writes_score_at_last_valid_response_token(tok):
    manager = NaiveRewardManager(tok, num_examine=0)
    reward = manager(make_batch(tok, MIXED_ROWS))
    assert reward.dtype == torch.float32
    torch.testing.assert_close(reward, expected_tensor(MIXED_EXPECTED, 4), rtol=0, atol=0)


def test_parallel_and_prime_match_naive(tok):
    data = make_batch(tok, MIXED_ROWS * 3)
    naive = NaiveRewardManager(tok, num_examine=0)(data, return_dict=True)
    for manager in (
        ParallelRewardManager(tok, 0, num_processes=2),
        PrimeRewardManager(tok, 0, num_processes=2),
    ):
        out = manager(data, return_dict=True)
        torch.testing.assert_close(out["reward_tensor"], naive["reward_tensor"], rtol=0, atol=0)
        assert out["reward_extra_info"] == naive["reward_extra_info"]
        manager.close()


def dict_scorer(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {
        "score": 2.0 if correct else -1.0,
        "acc": correct,
        "pred": solution_str.strip(),
        "tag": extra_info["k"],
    }


def test_dict_scores_fill_reward_extra_info(tok):
    rows = [("p", "ab", "src", "ab"), ("p", "abc", "src", "ab")]
    manager = NaiveRewardManager(tok, 0, compute_score=dict_scorer)
    out = manager(make_batch(tok, rows, extra_info=[{"k": 7}, {"k": 8}]), return_dict=True)
    torch.testing.assert_close(out["reward_tensor"], expected_tensor({(0, 1): 2.0, (1, 2): -1.0}, 2))
    assert out["reward_extra_info"] == {
        "score": [2.0, -1.0],
        "acc": [True, False],
        "pred": ["ab", "abc"],
        "tag": [7, 8],
        "reward/timeout_count": [0, 0],
        "reward/error_count": [0, 0],
        "reward/invalid_count": [0, 0],
    }
    assert out["reward_metrics"] == {
        "reward/timeout_count": 0,
        "reward/error_count": 0,
        "reward/invalid_count": 0,
    }


def test_num_examine_prints_that_many_samples_per_data_source(tok, capsys):
    rows = MIXED_ROWS + MIXED_ROWS  # gsm8k x4, reverse x2, copy x2
    NaiveRewardManager(tok, num_examine=1)(make_batch(tok, rows))
    printed = capsys.readouterr().out
    assert printed.count("[response]") == 3
    assert "[prompt] q1\n[response] #### 12\n[ground_truth] 12\n[score] 1.0\n" in printed
    NaiveRewardManager(tok, num_examine=2)(make_batch(tok, rows))
    assert capsys.readouterr().out.count("[response]") == 6
    NaiveRewardManager(tok, num_examine=0)(make_batch(tok, rows))
    assert capsys.readouterr().out == ""


def test_rm_scores_pass_through(tok):
    data = make_batch(tok, MIXED_ROWS)
    rm_scores = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    data.batch["rm_scores"] = rm_scores
    assert NaiveRewardManager(tok, 0)(data) is rm_scores
    assert NaiveRewardManager(tok, 0)(data, return_dict=True)["reward_tensor"] is rm_scores


def test_bad_batches_raise_naming_the_problem(tok):
    data = make_batch(tok, MIXED_ROWS)
    with pytest.raises(KeyError, match="non_tensor_batch has no 'task'"):
        NaiveRewardManager(tok, 0, reward_fn_key="task")(data)
    data.non_tensor_batch["reward_model"][1] = {"answer": "12"}
    with pytest.raises(KeyError, match="sample 1 has reward_model=\\{'answer': '12'\\}"):
        NaiveRewardManager(tok, 0)(data)
    with pytest.raises(ValueError, match="compute_score_timeout must be a positive number"):
        NaiveRewardManager(tok, 0, compute_score_timeout=0)
    with pytest.raises(ValueError, match="ParallelRewardManager: num_processes must be >= 1, got 0"):
        ParallelRewardManager(tok, 0, num_processes=0)


# ---------------------------------------------------------------- DAPO


def constant_one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


LENGTH_ROWS = [("p", "a" * n, "src", "x") for n in (5, 6, 8, 10)]


def test_dapo_overlong_penalty_is_exact(tok):
    # expected length 10 - 4 = 6; exceed = -1, 0, 2, 4; penalty = min(-exceed / 4 * 0.5, 0).
    cfg = {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True}
    manager = DAPORewardManager(tok, 0, compute_score=constant_one, max_resp_len=10, overlong_buffer_cfg=cfg)
    out = manager(make_batch(tok, LENGTH_ROWS), return_dict=True)
    cells = {(0, 4): 1.0, (1, 5): 1.0, (2, 7): 0.75, (3, 9): 0.5}
    torch.testing.assert_close(out["reward_tensor"], expected_tensor(cells, 4), rtol=0, atol=0)
    assert out["reward_extra_info"]["overlong_reward"] == [0.0, 0.0, -0.25, -0.5]
    assert out["reward_extra_info"]["overlong"] == [False, False, True, True]


def test_dapo_without_overlong_cfg_is_plain_scoring(tok):
    data = make_batch(tok, LENGTH_ROWS)
    cells = {(0, 4): 1.0, (1, 5): 1.0, (2, 7): 1.0, (3, 9): 1.0}
    for cfg in (None, {"enable": False, "len": 4, "penalty_factor": 1.0, "log": True}):
        manager = DAPORewardManager(
            tok, 0, compute_score=constant_one, max_resp_len=None, overlong_buffer_cfg=cfg
        )
        out = manager(data, return_dict=True)
        torch.testing.assert_close(out["reward_tensor"], expected_tensor(cells, 4), rtol=0, atol=0)
        assert "overlong_reward" not in out["reward_extra_info"]
    # log=False: penalised but nothing logged.
    cfg = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": False}
    out = DAPORewardManager(tok, 0, constant_one, max_resp_len=10, overlong_buffer_cfg=cfg)(
        data, return_dict=True
    )
    assert out["reward_tensor"][3, 9].item() == 0.0
    assert "overlong" not in out["reward_extra_info"]


def test_dapo_rejects_incomplete_overlong_cfg(tok):
    # verl asserts these: the error is an AssertionError as well as a ValueError
    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="max_resp_len must be provided"):
            DAPORewardManager(tok, 0, overlong_buffer_cfg={"enable": True, "len": 4, "penalty_factor": 1.0})
        with pytest.raises(error, match=r"overlong_buffer_cfg.len must be a positive int, got 0"):
            DAPORewardManager(tok, 0, max_resp_len=8, overlong_buffer_cfg={"enable": True, "len": 0})
        with pytest.raises(error, match=r"max_resp_len must be larger than overlong_buffer.len \(8 < 9\)"):
            DAPORewardManager(tok, 0, max_resp_len=8, overlong_buffer_cfg={"enable": True, "len": 9})


class EosTextTokenizer:
    """Decodes id i to chr(ord('a') + i) and id 9 to an eos string that survives
    skip_special_tokens (as with tokenizers whose eos is not a special token)."""

    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True):
        return "".join("</s>" if int(i) == 9 else chr(ord("a") + int(i)) for i in ids)


def exact_ab(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth else 0.0


def test_dapo_strips_trailing_eos_and_logs_acc():
    # responses "ab</s>", "ab", "a</s>b" (eos inside stays), "ba</s>"; ground truth "ab"
    responses = torch.tensor([[0, 1, 9], [0, 1, 0], [0, 9, 1], [1, 0, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.zeros(4, 1, dtype=torch.long),
            "responses": responses,
            "attention_mask": mask,
        },
        non_tensors={
            "data_source": np.array(["src"] * 4, dtype=object),
            "reward_model": np.array([{"ground_truth": "ab"}] * 4, dtype=object),
        },
    )
    out = DAPORewardManager(EosTextTokenizer(), 0, compute_score=exact_ab)(data, return_dict=True)
    cells = {(0, 2): 1.0, (1, 1): 1.0, (2, 2): 0.0, (3, 2): 0.0}
    torch.testing.assert_close(
        out["reward_tensor"], expected_tensor(cells, 4, response_len=3), rtol=0, atol=0
    )
    assert out["reward_extra_info"]["acc"] == [1.0, 1.0, 0.0, 0.0]


def test_dapo_dict_scores_log_their_keys_not_acc(tok):
    def with_pred(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "pred": solution_str}

    out = DAPORewardManager(tok, 0, compute_score=with_pred)(
        make_batch(tok, LENGTH_ROWS[:2]), return_dict=True
    )
    assert out["reward_extra_info"]["score"] == [0.5, 0.5]
    assert out["reward_extra_info"]["pred"] == ["aaaaa", "aaaaaa"]
    assert "acc" not in out["reward_extra_info"]


def test_reward_loop_dapo_scores_the_last_sample(tok):
    import asyncio

    from omegaconf import OmegaConf

    from verl_megatron.experimental.reward_loop.reward_manager.dapo import DAPORewardManager as LoopDAPO

    cfg = {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True}
    config = OmegaConf.create({"reward": {"reward_kwargs": {"max_resp_len": 10, "overlong_buffer_cfg": cfg}}})
    manager = LoopDAPO(config, tok, constant_one)
    out = asyncio.run(manager.run_single(make_batch(tok, LENGTH_ROWS)))
    # the last row has 10 tokens: exceed 4, penalty -0.5 (as in test_dapo_overlong_penalty_is_exact)
    assert out == {
        "reward_score": 0.5,
        "reward_extra_info": {"acc": 1.0, "overlong_reward": -0.5, "overlong": True},
    }
    with pytest.raises(AssertionError, match="max_resp_len must be provided"):
        LoopDAPO(
            OmegaConf.create({"reward": {"reward_kwargs": {"overlong_buffer_cfg": cfg}}}), tok, constant_one
        )


def test_precomputed_rm_scores_return_extra_info_from_meta_keys(tok):
    data = make_batch(tok, LENGTH_ROWS[:2])
    data.batch["rm_scores"] = torch.tensor([[0.0] * 9 + [0.25], [0.0] * 9 + [0.75]])
    data.non_tensor_batch["judge"] = np.array(["ok", "bad"], dtype=object)
    data.meta_info["reward_extra_keys"] = ["judge"]
    for manager in (NaiveRewardManager(tok, 0), DAPORewardManager(tok, 0)):
        out = manager(data, return_dict=True)
        assert out["reward_tensor"] is data.batch["rm_scores"]
        assert list(out["reward_extra_info"]["judge"]) == ["ok", "bad"]
    data.meta_info.pop("reward_extra_keys")
    assert NaiveRewardManager(tok, 0)(data, return_dict=True)["reward_extra_info"] == {}


# ---------------------------------------------------------------- batch


def test_batch_manager_makes_one_vectorised_call(tok):
    calls = []

    def batched(data_sources, solution_strs, ground_truths, extra_infos, bonus):
        calls.append((list(data_sources), solution_strs, ground_truths, extra_infos))
        return [len(s) + bonus for s in solution_strs]

    rows = [("p", "ab", "s1", "g1"), ("p", "abcd", "s2", "g2")]
    manager = BatchRewardManager(tok, 0, compute_score=batched, isolation="none", bonus=0.5)
    reward = manager(make_batch(tok, rows, extra_info=[{"i": 0}, {"i": 1}]))
    assert calls == [(["s1", "s2"], ["ab", "abcd"], ["g1", "g2"], [{"i": 0}, {"i": 1}])]
    torch.testing.assert_close(reward, expected_tensor({(0, 1): 2.5, (1, 3): 4.5}, 2), rtol=0, atol=0)
    default = BatchRewardManager(tok, 0)(make_batch(tok, MIXED_ROWS))
    torch.testing.assert_close(default, expected_tensor(MIXED_EXPECTED, 4), rtol=0, atol=0)


def test_batch_manager_contains_failures(tok):
    data = make_batch(tok, MIXED_ROWS)

    def raises(**kwargs):
        raise RuntimeError("service down")

    def short(**kwargs):
        return [1.0]

    def one_nan(**kwargs):
        return [1.0, math.nan, 2.0, 3.0]

    with pytest.warns(RuntimeWarning, match="4 of 4 sample.*error.*RuntimeError: service down"):
        out = BatchRewardManager(tok, 0, compute_score=raises)(data, return_dict=True)
    assert out["reward_metrics"]["reward/error_count"] == 4
    assert torch.count_nonzero(out["reward_tensor"]) == 0
    with pytest.warns(RuntimeWarning, match="returned 1 scores for 4 samples"):
        out = BatchRewardManager(tok, 0, compute_score=short)(data, return_dict=True)
    assert out["reward_metrics"]["reward/error_count"] == 4
    with pytest.warns(RuntimeWarning, match="1 of 4 sample.*invalid.*sample 1, data_source='openai/gsm8k'"):
        out = BatchRewardManager(tok, 0, compute_score=one_nan)(data, return_dict=True)
    assert out["reward_metrics"] == {
        "reward/timeout_count": 0,
        "reward/error_count": 0,
        "reward/invalid_count": 1,
    }
    cells = {(0, 6): 1.0, (1, 6): 0.0, (2, 6): 2.0, (3, 2): 3.0}
    torch.testing.assert_close(out["reward_tensor"], expected_tensor(cells, 4), rtol=0, atol=0)


# ---------------------------------------------------------------- safety


def flaky_scorer(data_source, solution_str, ground_truth, extra_info=None):
    """Fails in a different way for each response text."""
    if solution_str == "raise":
        raise ZeroDivisionError("division by zero in user code")
    if solution_str == "nan":
        return math.nan
    if solution_str == "inf":
        return -math.inf
    if solution_str == "text":
        return "1.0"
    if solution_str == "none":
        return None
    if solution_str == "nokey":
        return {"acc": True}
    if solution_str == "sleep":
        time.sleep(60)
    if solution_str == "cloop":
        # Catastrophic regex backtracking: stuck in C, holding the GIL, deaf to signals.
        re.match(r"(a+)+$", "a" * 64 + "b")
    if solution_str == "exit":
        import os

        os._exit(7)
    return float(len(solution_str))


def test_errors_and_invalid_scores_are_contained_without_timeout(tok):
    texts = ["ok", "raise", "nan", "inf", "text", "none", "nokey", "fine"]
    rows = [("p", t, f"src/{t}", "g") for t in texts]
    manager = NaiveRewardManager(tok, 0, compute_score=flaky_scorer)
    with pytest.warns(RuntimeWarning) as record:
        out = manager(make_batch(tok, rows), return_dict=True)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2  # one per failure kind
    assert "1 of 8 sample(s) scored 0 because compute_score error" in messages[0]
    assert "data_source='src/raise': ZeroDivisionError: division by zero in user code" in messages[0]
    assert "5 of 8" in messages[1] and "data_source='src/nan': score is nan" in messages[1]
    assert out["reward_metrics"] == {
        "reward/timeout_count": 0,
        "reward/error_count": 1,
        "reward/invalid_count": 5,
    }
    assert out["reward_extra_info"]["reward/invalid_count"] == [0, 0, 1, 1, 1, 1, 1, 0]
    assert out["reward_extra_info"]["acc"] == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, True, 0.0]
    cells = {(0, 1): 2.0, (7, 3): 4.0}
    torch.testing.assert_close(out["reward_tensor"], expected_tensor(cells, 8), rtol=0, atol=0)
    assert manager.last_metrics == out["reward_metrics"]


@pytest.mark.parametrize("manager_cls", [NaiveRewardManager, ParallelRewardManager])
def test_hanging_scorers_are_killed_at_the_timeout(tok, manager_cls):
    texts = ["ok", "sleep", "cloop", "exit", "fine"]
    rows = [("p", t, f"src/{t}", "g") for t in texts]
    kwargs = {"num_processes": 2} if manager_cls is ParallelRewardManager else {}
    manager = manager_cls(tok, 0, compute_score=flaky_scorer, compute_score_timeout=0.5, **kwargs)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning) as record:
        out = manager(make_batch(tok, rows), return_dict=True)
    elapsed = time.monotonic() - start
    assert elapsed < 8.0  # two 0.5 s timeouts plus worker restarts, not 60 s
    messages = " | ".join(str(w.message) for w in record)
    assert "2 of 5 sample(s) scored 0 because compute_score timed out" in messages
    assert "data_source='src/sleep': scorer did not return within 0.5 s" in messages
    assert "data_source='src/exit': scorer process died (exit code 7)" in messages
    assert out["reward_metrics"] == {
        "reward/timeout_count": 2,
        "reward/error_count": 1,
        "reward/invalid_count": 0,
    }
    assert out["reward_extra_info"]["reward/timeout_count"] == [0, 1, 1, 0, 0]
    cells = {(0, 1): 2.0, (4, 3): 4.0}
    torch.testing.assert_close(out["reward_tensor"], expected_tensor(cells, 5), rtol=0, atol=0)
    # The pool recovered: the next batch scores normally and fast.
    again = manager(make_batch(tok, [("p", "abc", "s", "g")]))
    assert again[0, 2].item() == 3.0
    manager.close()


def test_batch_manager_timeout_covers_the_whole_call(tok):
    def hangs(**kwargs):
        time.sleep(60)

    manager = BatchRewardManager(tok, 0, compute_score=hangs, compute_score_timeout=0.5)
    with pytest.warns(RuntimeWarning, match="4 of 4 sample.*timed out"):
        out = manager(make_batch(tok, MIXED_ROWS), return_dict=True)
    assert out["reward_metrics"]["reward/timeout_count"] == 4
    manager.close()


def test_manager_pickles_after_use(tok):
    # verl ships the reward function to another process; the worker pool stays behind.
    manager = NaiveRewardManager(tok, 0, compute_score=flaky_scorer, compute_score_timeout=5)
    data = make_batch(tok, [("p", "abc", "s", "g")])
    assert manager(data)[0, 2].item() == 3.0
    clone = pickle.loads(pickle.dumps(manager))
    assert clone(data)[0, 2].item() == 3.0
    manager.close()
    clone.close()


# ---------------------------------------------------------------- registry


def test_registry_lookup_and_errors():
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert get_reward_manager_cls("dapo") is DAPORewardManager
    assert get_reward_manager_cls("batch") is BatchRewardManager
    assert get_reward_manager_cls("parallel") is ParallelRewardManager
    assert get_reward_manager_cls("prime") is PrimeRewardManager
    with pytest.raises(
        ValueError, match=r"Unknown reward manager: nope; registered reward managers: .*dapo.*naive"
    ):
        get_reward_manager_cls("nope")
    assert register("naive")(NaiveRewardManager) is NaiveRewardManager  # idempotent

    class Other(NaiveRewardManager):
        pass

    with pytest.raises(ValueError, match=r"'naive' is already registered to .*NaiveRewardManager"):
        register("naive")(Other)


def test_score_timeout_context_is_verls_in_process_guard():
    import time

    from verl_megatron.workers.reward_manager.naive import _score_timeout

    start = time.monotonic()
    with pytest.raises(TimeoutError), _score_timeout(0.2):
        time.sleep(5)
    assert time.monotonic() - start < 2.0
    for off in (None, 0):  # disabled: no alarm is installed, the block runs to the end
        with _score_timeout(off):
            time.sleep(0.05)
    with _score_timeout(2.0):
        value = 1 + 1
    assert value == 2
    time.sleep(0.1)  # the timer of the fast block was cancelled: nothing fires afterwards
