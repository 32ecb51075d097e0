"""The generative judge against a local OpenAI-compatible server that misbehaves on purpose.

The server (stdlib http.server, started in the test) answers by what the response under
judgement says: a verdict, a verdict without a number, garbage instead of JSON, JSON without
choices, HTTP 500, or nothing within the timeout. A second judge points at a closed port.
Each failure scores ``failure_score``, is counted under ``reward/judge/<cause>_count`` and the
combined reward lands at each response's last token.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.reward.judge import endpoint_url, parse_verdict
from verl_megatron.reward.model_config import JudgeConfig, ModelRewardSettings
from verl_megatron.reward.model_rewards import ModelRewards

STOP = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        message = body["messages"][-1]["content"]
        if "slow" in message:
            STOP.wait(60.0)  # past the client's timeout; released when the module ends
            return self._send(200, b"{}")
        if "boom" in message:
            return self._send(500, b"internal error")
        if "garbage" in message:
            return self._send(200, b"<html>not json")
        if "empty" in message:
            return self._send(200, json.dumps({"choices": []}).encode())
        verdict = (
            "I cannot tell." if "vague" in message else ("Score: 7" if "good" in message else "Score: 2")
        )
        reply = {"choices": [{"message": {"role": "assistant", "content": verdict}}]}
        return self._send(200, json.dumps(reply).encode())

    def _send(self, status: int, payload: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout case)
            pass


@pytest.fixture(scope="module")
def server():
    STOP.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    STOP.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from verl_megatron.utils.local_assets import build_char_tokenizer

    return build_char_tokenizer(tmp_path_factory.mktemp("judge_tok"))


RESPONSES = ["good", "bad", "vague", "garbage", "empty", "boom", "slow"]


def make_batch(tokenizer, responses=RESPONSES, rule=None) -> DataProto:
    prompts = [tokenizer(f"q{i}")["input_ids"] for i in range(len(responses))]
    answers = [tokenizer(r)["input_ids"] for r in responses]
    tp, tr = max(map(len, prompts)), max(map(len, answers))
    ids = torch.zeros((len(responses), tp + tr), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, tp - len(p) : tp] = torch.tensor(p)
        ids[i, tp : tp + len(a)] = torch.tensor(a)
        mask[i, tp - len(p) : tp + len(a)] = 1
    reward_model = [{"ground_truth": f"t{i}"} for i in range(len(responses))]
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "responses": ids[:, tp:], "response_mask": mask[:, tp:]},
        non_tensors={"reward_model": reward_model},
    )


def _rewards(url: str, tokenizer, combine: str | None = None, **judge) -> ModelRewards:
    cfg = JudgeConfig(
        enable=True, backend="openai", url=url, timeout_s=3.0, scale=0.1, failure_score=-1.0, **judge
    )
    return ModelRewards(ModelRewardSettings(judge=cfg, combine=combine), None, tokenizer)


def test_verdicts_and_contained_failures_counted_by_cause(server, tokenizer):
    url = f"http://127.0.0.1:{server.server_port}"
    rewards = _rewards(
        url, tokenizer, combine="rule + judge", prompt_template="Q={prompt} A={response} T={ground_truth}"
    )
    batch = make_batch(tokenizer)
    rule = torch.zeros(len(RESPONSES), batch.batch["responses"].shape[1])
    rule[:, 0] = 0.5  # rule reward at the first token: the sum is what the formula reads
    start = time.perf_counter()
    reward, extra = rewards.apply(batch, (rule, {"acc": [1.0] * len(RESPONSES)}))
    elapsed = time.perf_counter() - start
    expected_judge = [0.7, 0.2, -1.0, -1.0, -1.0, -1.0, -1.0]
    assert extra["judge_score"] == pytest.approx(expected_judge)
    counts = {k: sum(v) for k, v in extra.items() if k.startswith("reward/judge/")}
    assert counts == {
        "reward/judge/timeout_count": 1,
        "reward/judge/connection_count": 0,
        "reward/judge/http_count": 1,
        "reward/judge/bad_response_count": 2,
        "reward/judge/unparsable_count": 1,
    }
    assert extra["acc"] == [1.0] * len(RESPONSES)  # the rule manager's extra info is kept
    lengths = batch.batch["response_mask"].sum(-1)
    for i, total in enumerate(expected_judge):
        assert reward[i, lengths[i] - 1] == pytest.approx(0.5 + total)
        assert float(reward[i].abs().sum()) == pytest.approx(abs(0.5 + total))  # nothing elsewhere
    # The hung request was cut off at the client's limit (3 s), not waited on for the server's 60 s.
    assert elapsed < 20.0, elapsed
    sent = [r["messages"][0]["content"] for r in server.requests if "q0" in r["messages"][0]["content"]]
    assert sent[-1] == "Q=q0 A=good T=t0"


def test_connection_refused_and_yes_no_verdicts(server, tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    rewards = _rewards(f"http://127.0.0.1:{closed_port}/v1", tokenizer)
    reward, extra = rewards.apply(make_batch(tokenizer, ["good", "bad"]), None)
    assert extra["judge_score"] == [-1.0, -1.0]
    assert sum(extra["reward/judge/connection_count"]) == 2
    assert float(reward.sum()) == pytest.approx(-2.0)  # default formula: the judge's score alone


def test_parse_verdict_patterns():
    assert parse_verdict("Score: 8/10", r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", {}) == 8.0
    assert parse_verdict("Verdict: YES.", r"(?i)verdict:\s*(yes|no)", {"yes": 1.0, "no": 0.0}) == 1.0
    assert parse_verdict("Verdict: no", r"(?i)verdict:\s*(yes|no)", {"yes": 1.0, "no": 0.0}) == 0.0
    assert parse_verdict("Verdict: maybe", r"(?i)verdict:\s*(\w+)", {"yes": 1.0}) is None
    assert parse_verdict("score: nan", r"score: (\w+)", {}) is None
    assert parse_verdict("4.5", r"\d+\.\d+", {}, scale=2.0) == 9.0  # no group: the whole match


def test_endpoint_url_forms():
    assert endpoint_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert endpoint_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert endpoint_url("https://h/v1/chat/completions") == "https://h/v1/chat/completions"
    for bad in ("localhost:8000", "ftp://h/v1", "http://:80", "http://h:port"):
        with pytest.raises(ValueError):
            endpoint_url(bad)
