"""The agent endpoint over vLLM and SGLang (rollout/endpoint.py -> ExternalRollout.generate_requests),
against the fakes of the engines' Python APIs that tests/test_rollout_gpu_contract.py uses.

Two conversations: A asks (temperature 0.5, top_p 0.9, top_k 3, max_tokens 6, stop "45"), then
continues greedily (max_tokens 4); C asks for n=3 samples of 5 tokens. A's and C's first requests
arrive together and are answered by ONE engine call carrying each request's own settings; the
test checks the request objects the engine received and that the trajectories hold the engine's
ids and log-probs (never a re-tokenization).
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from tests.test_agent_endpoint import _ids, _prompts, char_tokenizer  # noqa: F401
from tests.test_rollout_gpu_contract import HF, RUNTIME, fake_engines  # noqa: F401
from verl_megatron.rollout.agent import AgentOutcome, AgentRollout
from verl_megatron.rollout.config import AgentConfig, RolloutConfig
from verl_megatron.rollout.sglang_engine import SGLangRollout
from verl_megatron.rollout.vllm_engine import VLLMRollout


def _answer(tok, prompt: list[int], sample: int, max_tokens: int) -> tuple[list[int], list[float]]:
    """The scripted engine: sample j of any prompt is the digits from j+1 on; log-prob of the k-th
    token -(k+1)/10 - j - len(prompt)/1000 (so every number says which request it answers)."""
    ids = _ids(tok, "123456789")[sample : sample + max_tokens]
    return ids, [-(k + 1) / 10 - sample - len(prompt) / 1000 for k in range(len(ids))]


class _Harness:
    def run(self, task, client):
        messages = list(task.messages)
        if messages[0]["content"] == "1":  # A: a sampled turn cut by a stop string, then a greedy one
            first = client.chat(messages, temperature=0.5, top_p=0.9, top_k=3, max_tokens=6, stop=["45"])
            messages += [first["choices"][0]["message"], {"role": "user", "content": "go"}]
            second = client.chat(messages, temperature=0, max_tokens=4)
            self.replies["A"] = [first, second]
        else:  # C: three samples
            self.replies["C"] = [client.chat(messages, n=3, max_tokens=5)]
        return AgentOutcome(reward=1.0)


def _rollout(engine_cls, tok):
    agent = AgentConfig(enable=True, harness="test", max_turns=3, deadline_s=60.0, batch_wait_s=30.0)
    name = "sglang" if engine_cls is SGLangRollout else "vllm"
    config = RolloutConfig(name=name, tensor_model_parallel_size=1, n=1, prompt_length=16,
                           response_length=24, seed=4, agent=agent)  # fmt: skip
    engine = engine_cls(config, RUNTIME, [], tok, HF)
    harness = _Harness()
    harness.replies = {}
    return AgentRollout(engine, config, tok, harness, [tok.eos_token_id]), engine, harness


def _check_trajectories(out, replies, tok) -> None:
    a_first, a_second = replies["A"]
    cut = _ids(tok, "12345")  # through the "5" that completes the stop string "45"
    assert a_first["choices"][0]["token_ids"] == cut and a_first["choices"][0]["message"]["content"] == "123"
    # the greedy turn continues from A's prompt + the engine's ids (not a re-tokenization)
    assert (
        a_second["prompt_token_ids"][: len(a_first["prompt_token_ids"]) + 5]
        == a_first["prompt_token_ids"] + cut
    )
    assert a_second["choices"][0]["token_ids"] == _ids(tok, "1234")
    assert [c["token_ids"] for c in replies["C"][0]["choices"]] == [
        _ids(tok, "123456789")[j : j + 5] for j in range(3)
    ]
    mask = out.batch["response_mask"][0].bool()
    assert out.batch["responses"][0][mask].tolist() == cut + _ids(tok, "1234")
    first_lp = _answer(tok, a_first["prompt_token_ids"], 0, 6)[1][:5]
    second_lp = _answer(tok, a_second["prompt_token_ids"], 0, 4)[1]
    assert out.batch["rollout_log_probs"][0][mask].tolist() == pytest.approx(first_lp + second_lp, abs=1e-7)
    assert list(out.non_tensor_batch["agent_failure"]) == ["", ""]


def test_endpoint_serves_vllm_with_per_request_settings(fake_engines, char_tokenizer, monkeypatch):  # noqa: F811
    tok = char_tokenizer
    calls = []

    class SamplingParams:  # vLLM's: the keyword arguments are the request object
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    def generate(prompts, sampling_params=None, use_tqdm=True):
        calls.append(([p["prompt_token_ids"] for p in prompts], [s.kwargs for s in sampling_params]))
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            samples = []
            for j in range(params.kwargs["n"]):
                ids, lps = _answer(tok, prompt["prompt_token_ids"], j, params.kwargs["max_tokens"])
                steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
                samples.append(SimpleNamespace(token_ids=ids, logprobs=steps))
            outputs.append(SimpleNamespace(outputs=samples))
        return outputs

    monkeypatch.setattr(sys.modules["vllm"], "SamplingParams", SamplingParams, raising=False)
    monkeypatch.setitem(sys.modules, "vllm.inputs", types.SimpleNamespace(TokensPrompt=lambda **kw: kw))
    rollout, engine, harness = _rollout(VLLMRollout, tok)
    engine.backend.llm.generate = generate
    out = rollout.generate_sequences(_prompts(tok, ["1", "2"]))

    a_first, a_second = harness.replies["A"]
    c_prompt = harness.replies["C"][0]["prompt_token_ids"]
    assert len(calls) == 2  # A's and C's first requests in one call, then A's second turn
    prompts, params = calls[0]
    by_prompt = dict(zip(map(tuple, prompts), params))
    common = {"stop_token_ids": [tok.eos_token_id], "ignore_eos": False, "logprobs": 0, "detokenize": False}
    a, c = by_prompt[tuple(a_first["prompt_token_ids"])], by_prompt[tuple(c_prompt)]
    assert {k: v for k, v in a.items() if k != "seed"} == {
        "n": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "max_tokens": 6, **common}  # fmt: skip
    assert {k: v for k, v in c.items() if k != "seed"} == {
        "n": 3, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 5, **common}  # fmt: skip
    assert a["seed"] != c["seed"]  # each prompt draws from its own seed
    assert calls[1][0] == [a_second["prompt_token_ids"]]
    assert {k: calls[1][1][0][k] for k in ("n", "temperature", "max_tokens")} == {
        "n": 1,
        "temperature": 0.0,
        "max_tokens": 4,
    }
    _check_trajectories(out, harness.replies, tok)


def test_endpoint_serves_sglang_with_per_request_settings(fake_engines, char_tokenizer):  # noqa: F811
    tok = char_tokenizer
    calls = []

    def generate(input_ids, sampling_params=None, return_logprob=False):
        calls.append((input_ids, sampling_params, return_logprob))
        outputs, seen = [], {}
        for ids, params in zip(input_ids, sampling_params):
            j = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1  # the copy number of this prompt
            tokens, lps = _answer(tok, ids, j, params["max_new_tokens"])
            outputs.append(
                {
                    "output_ids": tokens,
                    "meta_info": {"output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, lps)]},
                }
            )
        return outputs

    rollout, engine, harness = _rollout(SGLangRollout, tok)
    engine.backend.engine.generate = generate
    out = rollout.generate_sequences(_prompts(tok, ["1", "2"]))

    a_first, a_second = harness.replies["A"]
    c_prompt = harness.replies["C"][0]["prompt_token_ids"]
    assert len(calls) == 2
    input_ids, params, logprobs = calls[0]
    # each prompt repeated its own n times, each copy with its request's sampling dict
    assert sorted(map(tuple, input_ids)) == sorted(
        [tuple(a_first["prompt_token_ids"])] + [tuple(c_prompt)] * 3
    )
    common = {"stop_token_ids": [tok.eos_token_id], "ignore_eos": False}
    a = {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "max_new_tokens": 6, **common}
    c = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 5, **common}
    expected = [a if ids == a_first["prompt_token_ids"] else c for ids in input_ids]
    assert params == expected and logprobs == [True] * 4
    assert calls[1][0] == [a_second["prompt_token_ids"]] and calls[1][1][0]["temperature"] == 0.0
    _check_trajectories(out, harness.replies, tok)
