"""Endpoint defects found in review (rollout/endpoint.py): malformed requests refused before any
engine call with a JSON 400 naming the field, an endpoint bug answered 500 (never a dropped
connection), bounded sampling settings, the stop-string cut, and requests given up on."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.test_agent_endpoint import ScriptedEngine, _config, _ids, char_tokenizer  # noqa: F401
from verl_megatron.rollout.agent import AgentRollout
from verl_megatron.rollout.endpoint import EndpointSettings, PolicyEndpoint, RequestRefused


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_malformed_requests_are_refused_before_the_engine_naming_the_field(char_tokenizer):  # noqa: F811
    tok = char_tokenizer
    engine = ScriptedEngine(lambda p: _ids(tok, "12"))
    rollout = AgentRollout(engine, _config(), tok, None, [tok.eos_token_id])
    url = rollout.endpoint.start() + "/chat/completions"
    user = [{"role": "user", "content": "9"}]
    cases = [
        ({"messages": user, "stop": 5}, "'stop'"),
        (
            {"messages": [*user, {"role": "assistant", "content": "", "tool_calls": ["x"]}]},
            "'messages[1].tool_calls'",
        ),
        (
            {"messages": [*user, {"role": "assistant", "tool_calls": [{"function": []}]}]},
            "'messages[1].tool_calls[0]'",
        ),
        ({"messages": user, "tools": {"a": 1}}, "'tools'"),
        ({"messages": user, "tools": [{"function": {"parameters": 3}}]}, "'tools[0].function'"),
        ({"messages": [{"role": "user", "content": 7}]}, "'messages[0].content'"),
        ({"messages": "hi"}, "'messages'"),
    ]
    try:
        answers = [_post(url, body) for body, _ in cases]
        completions = _post(url.replace("/chat/completions", "/completions"), {"prompt": "1", "stop": [1]})
        # An endpoint bug (here: the tokenizer raising) is a JSON 500, not a dropped connection.
        rollout.endpoint.tokenizer = None
        bug = _post(url, {"messages": user})
    finally:
        rollout.endpoint.stop()
    for (status, payload), (_, name) in zip(answers, cases):
        assert status == 400 and payload["error"]["message"].startswith(name), (name, status, payload)
    assert completions[0] == 400 and completions[1]["error"]["message"].startswith("'stop'")
    assert bug[0] == 500 and bug[1]["error"]["code"] == "internal_error", bug
    assert engine.metas == [] and rollout.endpoint.engine_calls == 0


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ({"temperature": float("nan")}, "'temperature'"),
        ({"temperature": float("inf")}, "'temperature'"),
        ({"temperature": -1}, "'temperature'"),
        ({"top_p": float("nan")}, "'top_p'"),
        ({"top_p": 0}, "'top_p'"),
        ({"n": 10**9}, "'n'"),
        ({"n": 4}, "'n'"),  # > max_turns (3): each choice is a model call of the trajectory
        ({"n": 0}, "'n'"),
        ({"n": float("inf")}, "'n'"),
        ({"max_tokens": 0}, "'max_tokens'"),
        ({"max_completion_tokens": -2}, "'max_completion_tokens'"),
        ({"top_k": -2}, "'top_k'"),
        ({"top_k": "x"}, "'top_k'"),
    ],
)
def test_sampling_settings_are_bounded(body, name):
    endpoint = PolicyEndpoint(None, None, EndpointSettings(64, 64, 3), [0])
    with pytest.raises(RequestRefused, match=f"^{name} must be") as info:
        endpoint._request("t", [1, 2, 3], body)
    assert info.value.status == 400


def test_sampling_settings_within_bounds_are_kept():
    endpoint = PolicyEndpoint(None, None, EndpointSettings(64, 64, 3), [0])
    request = endpoint._request(
        "t", [1, 2, 3], {"n": 3, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 0}
    )
    assert (request.n, request.max_tokens, request.sampling) == (3, 5, (False, 0.5, 0.9, 0))
    request = endpoint._request("t", [1, 2, 3], {"max_completion_tokens": 100, "temperature": 0})
    assert (request.n, request.max_tokens, request.sampling) == (1, 64, (True, 1.0, 1.0, -1))


def _cut_by_every_prefix(tokenizer, tokens, log_probs, stops, stop_ids):
    """The cut as it was computed before: every prefix decoded, the first holding a stop wins."""
    stops = [stops] if isinstance(stops, str) else [s for s in stops if isinstance(s, str) and s]
    for k in range(1, len(tokens) + 1) if stops else ():
        text = tokenizer.decode(tokens[:k], skip_special_tokens=False)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return tokens[:k], log_probs[:k], text[: min(hits)], True
    body = tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens
    return tokens, log_probs, tokenizer.decode(body, skip_special_tokens=False), False


def test_stop_cut_equals_the_prefix_by_prefix_cut(char_tokenizer):  # noqa: F811
    from verl_megatron.rollout.endpoint import _cut_at_stop

    tok = char_tokenizer
    eos = tok.eos_token_id
    texts = ["123456789", "ab<tool_call>cd</tool_call>ef", "x", "aaaa", "</answer> then", "abcdefgh" * 40]
    stops = [
        ["45"],
        "9",
        ["</tool_call>"],
        ["zz"],
        ["a", "aa"],
        ["</answer>"],
        ["h", "de"],
        [],
        ["gha"],
        ["", 3],
    ]
    cases = 0
    for text in texts:
        for ending in ([], [eos]):
            ids = _ids(tok, text) + ending
            log_probs = [-k / 7 for k in range(len(ids))]
            for stop in stops:
                got = _cut_at_stop(tok, ids, log_probs, stop, {eos})
                assert got == _cut_by_every_prefix(tok, ids, log_probs, stop, {eos}), (
                    text,
                    ending,
                    stop,
                    got,
                )
                cases += 1
    assert cases == 120
    ids = _ids(tok, "123456789")
    assert _cut_at_stop(tok, ids, [0.0] * 9, ["45", "3"], set()) == (ids[:3], [0.0] * 3, "12", True)


def test_a_request_given_up_while_queued_is_not_generated(char_tokenizer):  # noqa: F811
    """A request that got its 503 while no serve() ran stays queued: the next serve skips it."""
    tok = char_tokenizer
    prompts: list[list[int]] = []
    engine = ScriptedEngine(lambda p: prompts.append(p) or _ids(tok, "12"))
    endpoint = PolicyEndpoint(engine, tok, EndpointSettings(16, 24, 3, batch_wait_s=0.0), [tok.eos_token_id])
    endpoint.accept_until(time.monotonic())  # no rollout: it waits 1 s, then is answered 503
    with pytest.raises(RequestRefused) as info:
        endpoint.handle("/trajectories/stale/v1/completions", {}, {"prompt": [5, 5, 5]})
    assert info.value.status == 503
    replies = []
    thread = threading.Thread(
        target=lambda: replies.append(
            endpoint.handle("/v1/completions", {}, {"prompt": [7, 7], "max_tokens": 2})
        )
    )
    thread.start()
    endpoint.serve(lambda: not thread.is_alive(), lambda: 1, time.monotonic() + 20)
    thread.join()
    assert prompts == [[7, 7]] and endpoint.engine_calls == 1, prompts
    assert replies[0]["choices"][0]["token_ids"] == _ids(tok, "12") and replies[0]["prompt_token_ids"] == [
        7,
        7,
    ]
    assert endpoint.ledger.records("stale") == []
