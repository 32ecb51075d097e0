"""A generative judge: a prompt template sent to a chat model, a score parsed from its answer.

Two backends (``reward_model.judge.backend``):

- ``openai``: an external OpenAI-compatible server, ``POST <url>/v1/chat/completions``, requests
  sent side by side (``max_concurrency``), each with a time limit (``timeout_s``);
- ``native``: the trainer's own rollout engine (the actor) answers, greedy, ``max_tokens`` long;
  the trainer passes its generate function (every rank calls it together).

A call that fails scores ``failure_score`` and is counted by cause (:data:`CAUSES`):
``timeout``, ``connection`` (refused, unreachable), ``http`` (a status >= 400), ``bad_response``
(not the JSON of a chat completion) and ``unparsable`` (no verdict in the answer). Nothing a
server or a model answers stops the run.
"""

from __future__ import annotations

import json
import os
import re
import string
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.reward.model_config import JUDGE_BACKENDS, JudgeConfig

__all__ = [
    "CAUSES",
    "TEMPLATE_FIELDS",
    "JudgeVerdict",
    "OpenAIJudgeClient",
    "RewardJudge",
    "check_judge_config",
    "endpoint_url",
    "parse_verdict",
    "render_prompt",
]

CAUSES = ("timeout", "connection", "http", "bad_response", "unparsable")
TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")


@dataclass
class JudgeVerdict:
    """One judged response: its score and, when it failed, the cause (one of :data:`CAUSES`)."""

    score: float
    cause: str | None = None
    detail: str = ""


# ------------------------------------------------------------------ checks and pure parts


def endpoint_url(url: str) -> str:
    """The chat-completions endpoint of ``url``: a full ``.../chat/completions`` as is, a base
    ending in ``/v1`` + ``/chat/completions``, otherwise + ``/v1/chat/completions``. Raises
    ValueError for a URL that is not ``http(s)://host[:port][/path]``."""
    parts = urllib.parse.urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host[:port] URL")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as err:
        raise ValueError(f"{url!r}: {err}") from None
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions" if path.endswith("/v1") else "/v1/chat/completions"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def check_judge_config(cfg: JudgeConfig) -> None:
    """Raise ValueError (naming the key) for a judge setting that cannot work."""
    if cfg.backend not in JUDGE_BACKENDS:
        raise ValueError(
            f"reward_model.judge.backend={cfg.backend!r}; expected one of {list(JUDGE_BACKENDS)}"
        )
    if cfg.backend == "openai":
        if not cfg.url:
            raise ValueError("reward_model.judge.backend=openai needs reward_model.judge.url")
        try:
            endpoint_url(cfg.url)
        except ValueError as err:
            raise ValueError(f"reward_model.judge.url: {err}") from None
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(cfg.prompt_template) if f is not None}
    except ValueError as err:
        raise ValueError(f"reward_model.judge.prompt_template does not parse: {err}") from None
    unknown = sorted(f for f in fields if f not in TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(
            f"reward_model.judge.prompt_template uses {{{unknown[0]}}}; known fields: "
            + ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
        )
    try:
        re.compile(cfg.verdict_pattern)
    except re.error as err:
        raise ValueError(f"reward_model.judge.verdict_pattern does not compile: {err}") from None
    for name, value in (("max_tokens", cfg.max_tokens), ("max_concurrency", cfg.max_concurrency)):
        if value < 1:
            raise ValueError(f"reward_model.judge.{name} must be >= 1, got {value}")
    if not cfg.timeout_s > 0:
        raise ValueError(f"reward_model.judge.timeout_s must be > 0, got {cfg.timeout_s}")


def render_prompt(template: str, prompt: str, response: str, ground_truth: Any = "") -> str:
    """The judge's user message: ``template`` with its fields filled in."""
    return template.format(
        prompt=prompt, response=response, ground_truth="" if ground_truth is None else ground_truth
    )


def parse_verdict(text: str, pattern: str, verdict_map: dict[str, float], scale: float = 1.0) -> float | None:
    """The score in a judge's answer, or None when it holds no verdict.

    The first match of ``pattern``; its first group (the whole match without groups) is looked
    up in ``verdict_map`` (case-insensitive), else read as a finite number; times ``scale``.
    """
    match = re.search(pattern, text or "")
    if match is None:
        return None
    verdict = (match.group(1) if match.re.groups else match.group(0)) or ""
    lowered = {k.lower(): float(v) for k, v in verdict_map.items()}
    if verdict.strip().lower() in lowered:
        return lowered[verdict.strip().lower()] * scale
    try:
        value = float(verdict)
    except ValueError:
        return None
    return value * scale if value == value and abs(value) != float("inf") else None


# ------------------------------------------------------------------ backends


class OpenAIJudgeClient:
    """Chat-completion requests to an OpenAI-compatible server (stdlib ``urllib``)."""

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self.url = endpoint_url(cfg.url or "")
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None

    def ask(self, message: str) -> tuple[str | None, str | None, str]:
        """(answer text, failure cause, detail) of one request; never raises for server trouble."""
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            return None, "http", f"HTTP {err.code}"
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, TimeoutError):
                return None, "timeout", str(reason)
            return None, "connection", str(reason)
        except TimeoutError as err:
            return None, "timeout", str(err)
        except (ConnectionError, OSError) as err:  # reset mid-reply, remote closed
            return None, "connection", f"{type(err).__name__}: {err}"
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as err:
            return None, "bad_response", f"{type(err).__name__}: {raw[:80]!r}"
        if not isinstance(content, str):
            return None, "bad_response", f"content is {type(content).__name__}"
        return content, None, ""

    def ask_all(self, messages: Sequence[str]) -> list[tuple[str | None, str | None, str]]:
        if not messages:
            return []
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(messages))) as pool:
            return list(pool.map(self.ask, messages))


GenerateFn = Callable[[Any], Any]


class RewardJudge:
    """Scores responses with the configured backend; ``generate`` is the native backend's engine."""

    def __init__(self, cfg: JudgeConfig, tokenizer: Any, generate: GenerateFn | None = None) -> None:
        check_judge_config(cfg)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.generate = generate
        self.client = OpenAIJudgeClient(cfg) if cfg.backend == "openai" else None

    def _verdict(self, answer: str | None, cause: str | None, detail: str) -> JudgeVerdict:
        if cause is not None:
            return JudgeVerdict(self.cfg.failure_score, cause, detail)
        score = parse_verdict(answer or "", self.cfg.verdict_pattern, self.cfg.verdict_map, self.cfg.scale)
        if score is None:
            return JudgeVerdict(self.cfg.failure_score, "unparsable", (answer or "")[:80])
        return JudgeVerdict(score)

    def judge(self, messages: Sequence[str]) -> list[JudgeVerdict]:
        """One verdict per judge message."""
        if self.client is not None:
            return [self._verdict(*reply) for reply in self.client.ask_all(messages)]
        return [self._verdict(text, None, "") for text in self._generate_native(messages)]

    def _generate_native(self, messages: Sequence[str]) -> list[str]:
        """Greedy answers of the actor's engine to chat-templated ``messages``."""
        from verl_megatron.protocol import DataProto

        if self.generate is None:
            raise RuntimeError("the native judge needs the trainer's generate function (bind_generate)")
        tok = self.tokenizer
        rows = []
        for message in messages:
            text = tok.apply_chat_template(
                [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
            )
            rows.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        prompts = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        )
        prompts.meta_info.update(n=1, do_sample=False, response_length=self.cfg.max_tokens)
        output = self.generate(prompts)
        responses = output.batch["responses"]
        valid = output.batch["attention_mask"][:, -responses.shape[1] :].bool()
        return [
            tok.decode(responses[i][valid[i]].tolist(), skip_special_tokens=True) for i in range(len(rows))
        ]
