"""The OpenAI-compatible endpoint over the rollout engine (rollout/endpoint.py, rollout/agent.py).

Scripted-engine cases pin the wire format, per-request parameters, tool calls, stop strings,
limits and the server's lifetime in-process; the real-engine case (tiny Qwen2 with a byte-level
BPE tokenizer) shows the trained ids are the sampled ones where re-tokenizing the text is not.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout.agent import AgentOutcome, AgentRollout, ChatClient, EndpointError
from verl_megatron.rollout.base import RolloutEngine, assemble_output, responses_from_lists
from verl_megatron.rollout.config import AgentConfig, RolloutConfig


class ScriptedEngine(RolloutEngine):
    """Answers each prompt row with ``script(prompt_ids)`` (cut at the response length); log-prob
    of token t is -t/100. Records every call's meta_info."""

    def __init__(self, script, stop_ids=()) -> None:
        self.script = script
        self.stop_ids = set(stop_ids)
        self.metas: list[dict] = []

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.metas.append(dict(prompts.meta_info))
        n, length = int(prompts.meta_info.get("n", 1)), int(prompts.meta_info["response_length"])
        rows = []
        for ids, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"]):
            answer = list(self.script(ids[mask.bool()].tolist()))[:length]
            stops = [k for k, t in enumerate(answer) if t in self.stop_ids]
            rows += [answer[: stops[0] + 1] if stops else answer] * n
        responses, mask, log_probs = responses_from_lists(
            rows, [[-t / 100 for t in r] for r in rows], length, 0
        )
        return assemble_output(prompts, responses, mask, log_probs, n)


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from verl_megatron.data.lookup_task import AGENT_CHAT_TEMPLATE, TOOL_TOKENS
    from verl_megatron.utils.local_assets import build_char_tokenizer

    return build_char_tokenizer(
        tmp_path_factory.mktemp("agent_tok"), extra_tokens=TOOL_TOKENS, chat_template=AGENT_CHAT_TEMPLATE
    )


def _config(**agent) -> RolloutConfig:
    fields = {
        "enable": True,
        "harness": "test",
        "max_turns": 3,
        "deadline_s": 20.0,
        "tool_call_format": "bare",
        **agent,
    }
    return RolloutConfig(n=1, prompt_length=16, response_length=24, agent=AgentConfig(**fields))


def _prompts(tokenizer, contents: list[str]) -> DataProto:
    messages = [[{"role": "user", "content": c}] for c in contents]
    ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in ids]
    width = 16
    raw = np.empty(len(messages), dtype=object)
    raw[:] = messages
    return DataProto.from_dict(
        {
            "input_ids": torch.tensor([[0] * (width - len(i)) + i for i in ids]),
            "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
        },
        non_tensors={"raw_prompt": raw},
    )


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_tool_call_turns_token_exact_with_env_tokens_masked(char_tokenizer):
    """Turn 1 calls the tool (bare format), turn 2 answers: the sample is prompt + call + tool
    reply + answer, mask 1 exactly on the engine's tokens, log-probs the engine's."""
    tok = char_tokenizer
    eos = tok.eos_token_id
    call = [*_ids(tok, "<tool_call>42</tool_call>"), eos]
    answer = [*_ids(tok, "7"), eos]
    engine = ScriptedEngine(lambda p: answer if tok.convert_tokens_to_ids("<|tool|>") in p else call, [eos])
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"properties": {"key": {}}}}}]
    seen = []

    class Harness:
        def run(self, task, client):
            messages = list(task.messages)
            first = client.chat(messages, tools=tools)
            message = first["choices"][0]["message"]
            seen.append((first["choices"][0]["finish_reason"], message))
            key = json.loads(message["tool_calls"][0]["function"]["arguments"])["key"]
            messages += [message, {"role": "tool", "content": f"v{key}"}]
            second = client.chat(messages, tools=tools, logprobs=True)
            seen.append(second["choices"][0]["message"]["content"])
            return AgentOutcome(reward=1.0, turn_rewards=[0.25, 0.0])

    rollout = AgentRollout(engine, _config(), tok, Harness(), [eos])
    prompts = _prompts(tok, ["12"])
    prompts.meta_info["weights_version"] = 5  # the trainer's: every engine call names it
    out = rollout.generate_sequences(prompts)
    assert [m["weights_version"] for m in engine.metas] == [5, 5]
    assert seen == [("tool_calls", {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "42"}'}}]}), "7"]  # fmt: skip
    env = [*_ids(tok, "<|tool|>v42"), eos, *_ids(tok, "<|assistant|>")]
    expected = call + env + answer
    n = len(expected)
    assert out.batch["responses"][0, :n].tolist() == expected
    assert out.batch["response_mask"][0].tolist() == [1] * len(call) + [0] * len(env) + [1] * len(answer) + [
        0
    ] * (24 - n)
    assert out.batch["attention_mask"][0, 16:].tolist() == [1] * n + [0] * (24 - n)
    policy = out.batch["response_mask"][0].bool()
    assert out.batch["rollout_log_probs"][0][policy].tolist() == pytest.approx(
        [-t / 100 for t in call + answer]
    )
    cols = out.non_tensor_batch
    assert cols["agent_turns"][0] == 2 and cols["agent_tool_calls"][0] == 1 and cols["agent_failure"][0] == ""
    assert cols["agent_turn_ends"][0] == [len(call) - 1, n - 1] and cols["agent_turn_rewards"][0] == [
        0.25,
        0.0,
    ]
    assert not rollout.endpoint.running  # started and stopped by the call itself


def test_sampling_parameters_n_stop_strings_and_completions(char_tokenizer):
    """Per-request settings reach the engine; ``stop`` cuts at the token completing the string;
    ``n`` gives n choices; /v1/completions takes token ids; /v1/models lists the policy."""
    tok = char_tokenizer
    engine = ScriptedEngine(lambda p: _ids(tok, "123456789"))
    rollout = AgentRollout(engine, _config(), tok, None, [tok.eos_token_id])
    base = rollout.endpoint.start()
    replies: dict[str, object] = {}

    def client_side():
        client = ChatClient(rollout.endpoint.url_for("t0"))
        replies["chat"] = client.chat([{"role": "user", "content": "9"}], temperature=0.5, top_p=0.9, top_k=3,
                                      max_tokens=6, n=2, stop=["45"])  # fmt: skip
        replies["text"] = ChatClient(base).complete(_ids(tok, "<|user|>1"), temperature=0, max_tokens=4)
        with urllib.request.urlopen(base + "/models") as r:
            replies["models"] = json.loads(r.read())

    thread = threading.Thread(target=client_side)
    thread.start()
    done = lambda: not thread.is_alive()  # noqa: E731
    rollout.endpoint.serve(done, lambda: 1, time.monotonic() + 20)
    thread.join()
    rollout.endpoint.stop()
    chat = replies["chat"]
    assert [c["message"]["content"] for c in chat["choices"]] == ["123", "123"]
    assert [c["token_ids"] for c in chat["choices"]] == [
        _ids(tok, "12345")
    ] * 2  # through the "5" that completes "45"
    assert chat["trajectory_id"] == "t0" and chat["choices"][0]["finish_reason"] == "stop"
    meta = engine.metas[0]
    assert "weights_version" not in meta  # serve() named none: the engine packs afresh
    assert (meta["temperature"], meta["top_p"], meta["top_k"], meta["n"], meta["do_sample"], meta["response_length"]) == (
        0.5, 0.9, 3, 2, True, 6)  # fmt: skip
    text = replies["text"]["choices"][0]
    assert text["text"] == "1234" and text["finish_reason"] == "length"
    assert engine.metas[1]["do_sample"] is False and engine.metas[1]["response_length"] == 4
    assert replies["models"]["data"][0]["id"] == "policy"
    records = rollout.endpoint.ledger.records("t0")
    assert len(records) == 2 and records[0].completion_ids == _ids(tok, "12345")


def test_limits_failures_and_deadline(char_tokenizer):
    """max_turns refuses the 4th call (truncated, trained on); a harness that raises, returns
    garbage or hangs scores failure_score, is counted by cause and masked out; a hang costs no
    more than the deadline; the endpoint's thread and socket are gone after sleep()."""
    tok = char_tokenizer
    engine = ScriptedEngine(lambda p: [*_ids(tok, "5"), tok.eos_token_id], [tok.eos_token_id])
    release = threading.Event()

    class Harness:
        def run(self, task, client):
            kind = task.messages[0]["content"]
            messages = list(task.messages)
            if kind == "4":  # hangs after one call
                client.chat(messages)
                release.wait(600)
            for _ in range(5):
                reply = client.chat(messages)  # the 4th raises EndpointError(max_turns)
                messages += [reply["choices"][0]["message"], {"role": "user", "content": "1"}]
                if kind == "2":
                    raise RuntimeError("environment crashed")
                if kind == "3":
                    return "not an outcome"
            return AgentOutcome(reward=1.0)

    rollout = AgentRollout(
        engine, _config(deadline_s=3.0, failure_score=-1.0), tok, Harness(), [tok.eos_token_id]
    )
    rollout.wake_up()
    url = rollout.endpoint.base_url
    start = time.monotonic()
    out = rollout.generate_sequences(_prompts(tok, ["1", "2", "3", "4"]))
    elapsed = time.monotonic() - start
    release.set()
    assert rollout.endpoint.running  # the rollout phase owns it
    rollout.sleep()
    cols = out.non_tensor_batch
    assert list(cols["agent_failure"]) == ["max_turns", "error", "invalid", "timeout"]
    assert list(cols["agent_reward"]) == [-1.0] * 4
    assert list(cols["agent_turns"]) == [3, 1, 1, 1]
    # The hung environment's time until the deadline is environment time (it was 0 before).
    env_seconds = list(cols["agent_env_seconds"])
    assert 0.0 < env_seconds[3] <= elapsed, env_seconds
    mask = out.batch["response_mask"].sum(-1).tolist()
    assert mask[0] == 6 and mask[1:] == [0, 0, 0]  # truncated: trained; the environment's failures: not
    assert 3.0 <= elapsed < 300.0, elapsed  # the deadline (3 s) ended it, not the hang (600 s)
    assert not any(t.name == "policy-endpoint" for t in threading.enumerate())
    host, port = url.split("//")[1].split("/")[0].split(":")
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, int(port)), timeout=2):
        pass
    with pytest.raises(urllib.error.URLError):
        ChatClient(url, timeout=2).chat([{"role": "user", "content": "1"}])
    assert isinstance(EndpointError(400, "max_turns", "x"), RuntimeError)


def test_token_budget_and_long_prompt_are_counted_by_cause(char_tokenizer):
    """A conversation that spends rollout.response_length is refused 'token_budget' (its policy
    tokens trained on), a first prompt over rollout.prompt_length 'prompt_too_long' (nothing
    generated); both score failure_score and are counted by cause."""
    from verl_megatron.reward.managers.agent import agent_metrics

    tok = char_tokenizer
    engine = ScriptedEngine(lambda p: [*_ids(tok, "5"), tok.eos_token_id], [tok.eos_token_id])

    class Harness:
        def run(self, task, client):
            messages = list(task.messages)
            if messages[0]["content"] == "2":
                messages = [{"role": "user", "content": "2" * 40}]  # 40 > prompt_length (16)
            for _ in range(10):  # refused once 24 response tokens are spent: EndpointError
                reply = client.chat(messages)
                messages += [reply["choices"][0]["message"], {"role": "user", "content": "123456"}]
            return AgentOutcome(reward=1.0)

    rollout = AgentRollout(
        engine, _config(max_turns=10, failure_score=-1.0), tok, Harness(), [tok.eos_token_id]
    )
    out = rollout.generate_sequences(_prompts(tok, ["1", "2"]))
    cols = out.non_tensor_batch
    assert list(cols["agent_failure"]) == ["token_budget", "prompt_too_long"], dict(cols)
    assert list(cols["agent_truncated"]) == ["token_budget", "prompt_too_long"]
    assert list(cols["agent_reward"]) == [-1.0, -1.0]
    turns, mask = cols["agent_turns"], out.batch["response_mask"].sum(-1).tolist()
    assert turns[0] >= 2 and mask[0] == 2 * turns[0] and (turns[1], mask[1]) == (0, 0), (turns, mask)
    extra = agent_metrics(cols)
    assert extra["reward/agent/failure_token_budget_count"] == [1.0, 0.0]
    assert extra["reward/agent/failure_prompt_too_long_count"] == [0.0, 1.0]
    assert extra["reward/agent/truncated_count"] == [1.0, 1.0]


def token_exact_job(path: str) -> dict:
    """Two chat turns per conversation on the real engine; what the endpoint returned, what the
    rollout assembled, and the re-tokenization of each turn's text."""
    from transformers import AutoTokenizer

    from tests.test_rollout_native import _setup
    from verl_megatron.rollout import build_rollout

    tokenizer = AutoTokenizer.from_pretrained(path)
    runtime, chunks, hf_config = _setup(path)
    config = RolloutConfig(n=2, prompt_length=40, response_length=48, seed=3,
                           agent=AgentConfig(enable=True, harness="test", max_turns=2))  # fmt: skip
    engine = build_rollout(config, runtime, chunks, tokenizer, hf_config)
    returned: dict[str, list] = {}

    class TwoTurns:
        def run(self, task, client):
            messages = list(task.messages)
            for _ in range(2):
                choice = client.chat(messages, max_tokens=10, logprobs=True)["choices"][0]
                returned.setdefault(task.trajectory_id, []).append(
                    (choice["token_ids"], [p["logprob"] for p in choice["logprobs"]["content"]])
                )
                messages += [choice["message"], {"role": "user", "content": "go on"}]
            return AgentOutcome(reward=0.0)

    rollout = AgentRollout(engine, config, tokenizer, TwoTurns(), [tokenizer.eos_token_id])
    messages = [[{"role": "user", "content": "hello world"}], [{"role": "user", "content": "what is 2+2"}]]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    raw = np.empty(2, dtype=object)
    raw[:] = messages
    pad = tokenizer.pad_token_id
    prompts = DataProto.from_dict(
        {
            "input_ids": torch.tensor([[pad] * (40 - len(i)) + i for i in ids]),
            "attention_mask": torch.tensor([[0] * (40 - len(i)) + [1] * len(i) for i in ids]),
        },
        non_tensors={"raw_prompt": raw},
    )
    out = rollout.generate_sequences(prompts)
    turns = [returned[f"b0-{i}"] for i in range(len(out))]
    retokenized = [
        [tokenizer.encode(tokenizer.decode(t), add_special_tokens=False) for t, _ in row] for row in turns
    ]
    return {
        "turns": turns,
        "retokenized": retokenized,
        "responses": out.batch["responses"],
        "response_mask": out.batch["response_mask"],
        "rollout_log_probs": out.batch["rollout_log_probs"],
        "failures": list(out.non_tensor_batch["agent_failure"]),
    }


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_bpe_tokenizer, build_tiny_hf_model

    path = tmp_path_factory.mktemp("agent_bpe")
    tokenizer = build_bpe_tokenizer(path)
    build_tiny_hf_model(path, "qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, tokenizer=tokenizer, seed=3)  # fmt: skip
    return str(path)


def test_trained_ids_are_the_sampled_ids_not_a_retokenization(pool1, bpe_model):
    (got,) = pool1.run(f"{__name__}:token_exact_job", path=bpe_model)
    assert got["failures"] == [""] * 4
    differs = 0
    for row, turns in enumerate(got["turns"]):
        mask = got["response_mask"][row].bool()
        sampled = [t for ids, _ in turns for t in ids]
        assert got["responses"][row][mask].tolist() == sampled, row
        assert got["rollout_log_probs"][row][mask].tolist() == [lp for _, lps in turns for lp in lps], row
        differs += sum(r != ids for r, (ids, _) in zip(got["retokenized"][row], turns))
    # Re-tokenizing the returned text would have changed at least one turn's ids.
    assert differs >= 1, got["retokenized"]
