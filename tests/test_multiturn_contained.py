"""A multi-turn environment runs in a worker process by default (rollout.multi_turn.isolation:
process). It must give the batch the in-process call gives, keep per-sample state in
``conversation.info`` across turns, and end only its own conversation (masked out, with a cause)
when it raises, hangs, kills its worker or returns garbage, leaving no process behind.
The engine is the seeded stand-in of the seeds test: each row's tokens depend only on its global
row and the engine call, so the conversations that do not fail must match a clean run exactly."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from tests.test_sampling_multiturn_seeds import PAD, REPLY, SeededEngine
from verl_megatron.errors import RolloutConfigError
from verl_megatron.protocol import DataProto
from verl_megatron.rollout import RolloutConfig
from verl_megatron.rollout.config import MultiTurnConfig
from verl_megatron.rollout.multiturn import ENV_FAILURES, EnvironmentReply, MultiTurnRollout
from verl_megatron.trainer.metrics import multi_turn_metrics

BUDGET = 64
PROMPTS = [[3, 4], [3, 5], [3, 6], [3, 7]]  # n=2: 8 conversations
KEYS = ("responses", "response_mask", "attention_mask", "rollout_log_probs")
COLUMNS = ("multi_turn_turns", "multi_turn_env_turns", "multi_turn_truncated")


def counting_environment(conversation, text: str) -> EnvironmentReply:
    """Its k-th reply is k REPLY tokens; it ends the conversation at its third call. The count
    lives in conversation.info only: were that lost between turns, every reply would be 1 token
    and no conversation would end before the budget."""
    calls = conversation.info.get("calls", 0) + 1
    conversation.info["calls"] = calls
    return EnvironmentReply(done=True) if calls == 3 else EnvironmentReply(token_ids=[REPLY] * calls)


class FailingEnvironment:
    """counting_environment, but at its second call conversation i fails as ``modes[i]`` says."""

    def __init__(self, modes: dict[int, str], pid_file: Path) -> None:
        self.modes, self.pid_file = modes, pid_file

    def __call__(self, conversation, text: str) -> EnvironmentReply:
        mode = self.modes.get(conversation.index)
        if mode is None or conversation.info.get("calls", 0) != 1:
            return counting_environment(conversation, text)
        if mode == "raise":
            raise ValueError("tool crashed")
        if mode == "exit":
            os._exit(3)
        if mode == "invalid":
            return "not a reply"
        # hang, with a process of its own that the worker's kill must reach as well
        child = psutil.Popen(["sleep", "60"])
        self.pid_file.write_text(str(child.pid))
        time.sleep(60)
        return EnvironmentReply()


def _rollout(environment, **multi_turn) -> dict:
    config = RolloutConfig(n=2, response_length=BUDGET, seed=3, multi_turn=MultiTurnConfig(**multi_turn))
    tokenizer = SimpleNamespace(pad_token_id=PAD, decode=lambda ids, skip_special_tokens=True: str(ids))
    ids = torch.tensor(PROMPTS)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    out = MultiTurnRollout(SeededEngine(config), config, tokenizer, environment).generate_sequences(prompts)
    return {
        **{k: out.batch[k] for k in KEYS},
        **{k: list(out.non_tensor_batch[k]) for k in COLUMNS},
        "metrics": multi_turn_metrics(out.non_tensor_batch),
    }


def _env_segments(out: dict, row: int) -> list[int]:
    """Lengths of the environment's runs of tokens in a row's response."""
    length = int(out["attention_mask"][row, len(PROMPTS[0]) :].sum())
    tokens = out["responses"][row, :length].tolist()
    runs, current = [], 0
    for token in [*tokens, None]:
        if token == REPLY:
            current += 1
        elif current:
            runs, current = [*runs, current], 0
    return runs


@pytest.fixture(autouse=True)
def no_process_left():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, f"processes left alive: {left}"


def test_contained_environment_gives_the_in_process_batch_and_keeps_info():
    contained = _rollout(counting_environment)  # isolation: process is the default
    trusted = _rollout(counting_environment, isolation="none")
    for key in KEYS:
        assert torch.equal(contained[key], trusted[key]), key
    for key in COLUMNS:
        assert contained[key] == trusted[key], key
    # conversation.info carried the count from turn to turn: replies of 1 then 2 tokens, then done
    ended = [row for row in range(8) if contained["multi_turn_truncated"][row] == ""]
    assert len(ended) >= 6, contained["multi_turn_truncated"]
    for row in ended:
        assert _env_segments(contained, row) == [1, 2]
        assert (contained["multi_turn_turns"][row], contained["multi_turn_env_turns"][row]) == (3, 2)
    zeros = dict.fromkeys(ENV_FAILURES, 0.0)
    assert {k: contained["metrics"][f"multi_turn/{k}_count"] for k in ENV_FAILURES} == zeros


def test_failures_end_only_their_conversation(tmp_path):
    modes = {0: "raise", 2: "hang", 5: "exit", 6: "invalid"}
    causes = {0: "env_error", 2: "env_timeout", 5: "env_error", 6: "env_invalid"}
    pid_file = tmp_path / "grandchild.pid"
    with pytest.warns(UserWarning, match=r"rollout\.multi_turn: conversation \d+ ended \(env_"):
        out = _rollout(FailingEnvironment(modes, pid_file), env_timeout_s=1.0)
    clean = _rollout(counting_environment, isolation="none")
    for row in range(8):
        if row in causes:
            # ended at the environment's second call, after two policy turns: none of it trained on
            assert out["multi_turn_truncated"][row] == causes[row], row
            assert (out["multi_turn_turns"][row], out["multi_turn_env_turns"][row]) == (2, 1), row
            assert out["response_mask"][row].sum() == 0, row
            assert _env_segments(out, row) == [1], row
            assert out["attention_mask"][row].sum() > len(PROMPTS[0]) + 2, row  # the tokens stay
        else:
            # the others finished as in a clean run, on the workers that replaced the dead ones
            for key in KEYS:
                assert torch.equal(out[key][row], clean[key][row]), (row, key)
            assert [out[k][row] for k in COLUMNS] == [clean[k][row] for k in COLUMNS], row
    metrics = out["metrics"]
    assert (metrics["multi_turn/env_error_count"], metrics["multi_turn/env_timeout_count"]) == (2.0, 1.0)
    assert metrics["multi_turn/env_invalid_count"] == 1.0
    others_cut = sum(clean["multi_turn_truncated"][r] != "" for r in range(8) if r not in causes)
    assert metrics["multi_turn/truncated_count"] == 4.0 + others_cut
    # what the hanging environment started went with its worker
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5.0
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the environment's own process {grandchild} is still running"
        time.sleep(0.05)


def test_in_process_environment_is_trusted_and_raises():
    # isolation: none runs the environment as a plain call: its failure stops the step
    with pytest.raises(ValueError, match="tool crashed"):
        _rollout(FailingEnvironment({1: "raise"}, Path(os.devnull)), isolation="none")
    with pytest.raises(
        TypeError, match=r"rollout\.multi_turn\.environment returned str, not an EnvironmentReply"
    ):
        _rollout(FailingEnvironment({1: "invalid"}, Path(os.devnull)), isolation="none")


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        (
            {"isolation": "thread"},
            r"rollout\.multi_turn\.isolation must be one of \['process', 'none'\], got 'thread'",
        ),
        ({"env_timeout_s": 0}, r"rollout\.multi_turn\.env_timeout_s must be a number of seconds > 0, got 0"),
        ({"env_timeout_s": -1.5}, r"rollout\.multi_turn\.env_timeout_s .* got -1\.5"),
        ({"env_timeout_s": float("inf")}, r"rollout\.multi_turn\.env_timeout_s .* got inf"),
        ({"env_timeout_s": "60"}, r"rollout\.multi_turn\.env_timeout_s .* got '60'"),
    ],
)
def test_bad_settings_are_refused(setting, match):
    with pytest.raises(RolloutConfigError, match=match):
        MultiTurnConfig(**setting)


def test_bad_setting_is_refused_at_config_load():
    from verl_megatron.trainer.config import load_config

    with pytest.raises(RolloutConfigError, match=r"rollout\.multi_turn\.isolation must be one of"):
        load_config("configs/quickstart.yaml", ["rollout.multi_turn.isolation=threads"])
    assert load_config("configs/quickstart.yaml", []).rollout.multi_turn.isolation == "process"


def train_step_job(out_dir: str) -> dict:
    """One quickstart training step with a multi-turn rollout (its environment contained, as by
    default): the step's multi_turn metrics and the processes left behind in this rank."""
    from tests.test_e2e import QUICKSTART, TINY
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    multi_turn = [
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.environment={__name__}:counting_environment",
    ]
    # room in the response for a few turns
    steps = ["data.max_response_length=12", "trainer.total_training_steps=1", "trainer.save_freq=-1"]
    run(QUICKSTART, [f"trainer.default_local_dir={out_dir}", *TINY, *steps, *multi_turn])
    rows = read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    return {
        "metrics": {k: v for r in rows for k, v in r.items() if k.startswith("multi_turn/")},
        "left": left,
    }


def test_quickstart_step_with_a_contained_multi_turn_environment(pool1, tmp_path):
    # the trainer's own wiring (components.py), forking the worker from a training rank
    result = pool1.run(f"{__name__}:train_step_job", out_dir=str(tmp_path))[0]
    metrics = result["metrics"]
    # 8 prompts x 4 samples, each with its first turn and some with more (17 in the run at hand)
    assert metrics["multi_turn/turns_count"] > 32 and metrics["multi_turn/env_turns_count"] > 0, metrics
    assert metrics["multi_turn/env_seconds_count"] > 0, metrics
    assert [metrics[f"multi_turn/{cause}_count"] for cause in ENV_FAILURES] == [0.0, 0.0, 0.0]
    assert result["left"] == []
