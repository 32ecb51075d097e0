"""An OpenAI-compatible HTTP endpoint over a rollout engine, for agent harnesses.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, each also under
``/trajectories/<id>/`` (a harness that only lets you set ``base_url`` names its trajectory that way);
else the ``X-Trajectory-Id`` header or a ``trajectory_id`` body field; else each request is its own
trajectory. Per request: ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` (capped by the trajectory's
remaining token budget), ``stop`` (strings), ``n`` (at most ``max_turns``: each choice is filed as a model
call of the trajectory), ``logprobs``; chat requests take ``tools`` and return ``tool_calls`` parsed from
the model's text in its chat template's format (``chat_format.py``). Every choice carries the sampled
``token_ids`` (and the response ``prompt_token_ids``): what the trainer will train on, filed in the
:class:`~verl_megatron.rollout.trajectory.TrajectoryLedger` under the trajectory id.

Requests are answered by the thread that owns the engine (:meth:`PolicyEndpoint.serve`): it waits for the
live conversations' requests, groups them by sampling settings and makes one engine call per group (the
native engine); vLLM and SGLang take every request with its own settings (``n``, ``max_tokens``, sampling,
the rollout's stop tokens) in one call of their generate API (``ExternalRollout.generate_requests``),
token ids in, the engine's ids and log-probs out. Stop strings are cut by the endpoint on the returned ids
(the engines run without a tokenizer). The server is stdlib ``ThreadingHTTPServer``: no web framework is
part of the default install, a handful of local clients is its whole load (the engine is the bottleneck),
and ``shutdown()`` + ``server_close()`` end its thread and socket deterministically.

With :class:`WeightVersions` (the rollout rank of ``rollout.placement=separate``), the serving
thread loads whatever newer weights have arrived before each engine call, and every choice is
filed (and answered, ``weight_version``) with the version that generated it: a trajectory whose
turns straddle a weight update records both versions, token by token.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout.chat_format import continue_prompt, normalize_messages, parse_tool_calls, render
from verl_megatron.rollout.external import ExternalRollout
from verl_megatron.rollout.sampling import SamplingParams
from verl_megatron.rollout.trajectory import TrajectoryLedger, TurnRecord

__all__ = ["EndpointSettings", "GenerationRequest", "PolicyEndpoint", "RequestRefused", "WeightVersions"]


@dataclass(frozen=True)
class EndpointSettings:
    """Limits and formats of one endpoint (from ``rollout.*`` and ``rollout.agent.*``)."""

    prompt_length: int
    response_length: int
    max_turns: int
    tool_call_format: str = "hermes"
    host: str = "127.0.0.1"
    port: int = 0
    batch_wait_s: float = 0.02
    model_name: str = "policy"


@dataclass(frozen=True)
class WeightVersions:
    """The weights an engine generates with, when they change during a rollout (partial rollout
    under ``rollout.placement=separate``): ``current()`` is the version loaded now, ``refresh()``
    loads the newer ones that have arrived (called on the engine's thread, between engine calls)."""

    current: Callable[[], int]
    refresh: Callable[[], None]


class RequestRefused(Exception):
    """A request the endpoint answers with an error (``status``, ``code``) instead of tokens."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class GenerationRequest:
    """One request waiting for the engine; ``choices`` are (ids, log-probs) per sample."""

    trajectory_id: str
    prompt_ids: list[int]
    n: int
    max_tokens: int
    sampling: tuple[bool, float, float, int]  # greedy, temperature, top_p, top_k
    done: threading.Event = field(default_factory=threading.Event)
    choices: list[tuple[list[int], list[float]]] | None = None
    error: str | None = None
    version: int = -1  # the weight version that generated the choices (-1: not tracked)
    cancelled: bool = False  # answered 503 while queued: nobody waits for its choices


class PolicyEndpoint:
    """The endpoint (module docstring) over ``engine`` (``generate_sequences``), while started.

    Args:
        engine: the rollout engine; only :meth:`serve`'s thread calls it.
        tokenizer: chat template, encoding of prompts, decoding of choices.
        settings: limits and formats.
        stop_ids: token ids that end a turn (a choice ending otherwise at ``max_tokens`` finishes
            with ``length``); stripped from the returned text.
        versions: the engine's weight versions when they change during a rollout; None: colocated.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        settings: EndpointSettings,
        stop_ids: list[int],
        versions: WeightVersions | None = None,
    ) -> None:
        self.engine = engine
        self.versions = versions
        self.tokenizer = tokenizer
        self.settings = settings
        self.stop_ids = set(stop_ids)
        self.ledger = TrajectoryLedger()
        self._queue: queue.Queue[GenerationRequest] = queue.Queue()
        self._ids = itertools.count()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._deadline = 0.0
        self._override: tuple[bool, float, float, int] | None = None
        self._weights_version: int | None = None  # serve()'s, while it runs (colocated)
        self.engine_calls = 0

    # ------------------------------------------------------------------ lifetime

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("PolicyEndpoint: not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def url_for(self, trajectory_id: str) -> str:
        """A ``base_url`` that files every request under ``trajectory_id``."""
        return self.base_url[: -len("/v1")] + f"/trajectories/{trajectory_id}/v1"

    def start(self) -> str:
        """Listen (a free port when ``settings.port`` is 0); returns the base URL."""
        if self._server is None:
            handler = type("Handler", (_Handler,), {"endpoint": self})
            self._server = _Server((self.settings.host, self.settings.port), handler)
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="policy-endpoint", daemon=True
            )
            self._thread.start()
        return self.base_url

    def stop(self) -> None:
        """Close the socket, end the server thread, fail whatever still waits."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()
        self._server, self._thread = None, None
        self._fail_pending("the endpoint stopped")

    # ------------------------------------------------------------------ the engine's side

    def accept_until(self, deadline: float) -> None:
        """Requests arriving before :meth:`serve` starts wait for it until ``deadline``."""
        self._deadline = deadline

    def serve(
        self,
        finished: Callable[[], bool],
        waiting: Callable[[], int],
        deadline: float,
        sampling: tuple[bool, float, float, int] | None = None,
        weights_version: int | None = None,
        alive: Callable[[], None] | None = None,
    ) -> None:
        """Answer requests until ``finished()`` or ``deadline`` (``time.monotonic``).

        After the first request of a round, waits up to ``settings.batch_wait_s`` for ``waiting()``
        requests (the conversations not busy elsewhere) so one engine call serves them. ``sampling``
        (validation): these settings replace every request's. ``weights_version``: the weights'
        version, fixed while serving, that engine calls name (the native engine reuses its packed
        weights); ignored when ``versions`` tracks them. ``alive``: called once a second before
        ``deadline`` (the stall watchdog's progress: a wait for conversations is bounded).
        """
        self._deadline, self._override, self._weights_version = deadline, sampling, weights_version
        next_alive = 0.0  # when ``alive`` is due (the watchdog looks once a second)
        try:
            while not finished() and time.monotonic() < deadline:
                if alive is not None and time.monotonic() >= next_alive:
                    alive()
                    next_alive = time.monotonic() + 1.0
                try:
                    first = self._queue.get(timeout=0.05)  # 5 ms cost ~18 ms CPU/s idle; a put wakes it
                except queue.Empty:
                    continue
                batch = [first]
                until = time.monotonic() + self.settings.batch_wait_s
                while len(batch) < max(1, waiting()) and time.monotonic() < until:
                    with contextlib.suppress(queue.Empty):
                        batch.append(self._queue.get(timeout=0.001))
                batch = [r for r in batch + self._drain() if not r.cancelled]
                if batch:
                    self._generate(batch)
        finally:
            self._fail_pending("the rollout's deadline passed")
            self._override, self._weights_version = None, None

    def _drain(self) -> list[GenerationRequest]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _fail_pending(self, reason: str) -> None:
        for request in self._drain():
            request.error = reason
            request.done.set()

    def _generate(self, requests: list[GenerationRequest]) -> None:
        """One engine call for all (vLLM, SGLang), else one per group of equal sampling and ``n``."""
        if self.versions is not None:
            self.versions.refresh()
            version = self.versions.current()
            for request in requests:
                request.version = version
        calls: list[tuple[Callable[[], None], list[GenerationRequest]]] = []
        if isinstance(self.engine, ExternalRollout):
            calls.append((lambda: self._generate_each(requests), requests))
        else:
            groups: dict[tuple, list[GenerationRequest]] = {}
            for request in requests:
                groups.setdefault((self._override or request.sampling, request.n), []).append(request)
            for (sampling, n), group in groups.items():
                calls.append((lambda g=group, s=sampling, k=n: self._generate_group(g, s, k), group))
        for call, group in calls:
            try:
                call()
            except Exception as err:  # a bad request must not take the trainer down
                for request in group:
                    request.error = f"generation failed: {type(err).__name__}: {err}"
            for request in group:
                request.done.set()

    def _generate_each(self, requests: list[GenerationRequest]) -> None:
        """An external engine's one call: each request with its own settings (module docstring)."""
        params = []
        for request in requests:
            greedy, temperature, top_p, top_k = self._override or request.sampling
            n = 1 if greedy else request.n  # greedy: every sample would be the same
            params.append(SamplingParams(temperature, top_k, top_p, greedy, n))
        answers = self.engine.generate_requests(
            [r.prompt_ids for r in requests], params, [r.max_tokens for r in requests]
        )
        self.engine_calls += 1
        for request, settings, completions in zip(requests, params, answers):
            choices = [
                (c.token_ids[: request.max_tokens], c.log_probs[: request.max_tokens]) for c in completions
            ]
            request.choices = choices * (request.n // settings.n)

    def _generate_group(self, group: list[GenerationRequest], sampling: tuple, n: int) -> None:
        greedy, temperature, top_p, top_k = sampling
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.full((len(group), width), int(pad), dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, request in enumerate(group):
            ids[i, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[i, width - len(request.prompt_ids) :] = 1
        meta = {
            "do_sample": not greedy,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "n": 1 if greedy else n,
            "response_length": max(r.max_tokens for r in group),
            "pad_token_id": int(pad),
        }
        # The native engine reuses its packed weights while the version stays the same. Tracked
        # (separate placement): the version _generate set after refresh(); else serve()'s.
        version = group[0].version if self.versions is not None else self._weights_version
        if version is not None:  # None: a colocated serve() given no version
            meta["weights_version"] = version
        out = self.engine.generate_sequences(
            DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info=meta)
        )
        self.engine_calls += 1
        samples = 1 if greedy else n
        lengths = out.batch["response_mask"].sum(-1).tolist()
        for i, request in enumerate(group):
            request.choices = []
            for j in range(i * samples, (i + 1) * samples):
                length = min(int(lengths[j]), request.max_tokens)
                tokens = out.batch["responses"][j, :length].tolist()
                log_probs = out.batch["rollout_log_probs"][j, :length].tolist()
                request.choices.append((tokens, log_probs))
            # greedy: every sample of n would be the same; OpenAI still returns n choices
            request.choices *= n // samples

    # ------------------------------------------------------------------ the request threads' side

    def handle(self, path: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        """The JSON answer of one request; raises RequestRefused for an error answer."""
        trajectory_id, route = _route(path)
        trajectory_id = trajectory_id or headers.get("x-trajectory-id") or body.get("trajectory_id")
        request_id = f"req-{next(self._ids)}"
        trajectory_id = str(trajectory_id or request_id)
        if route in ("/v1/chat/completions", "/v1/completions"):
            _check_shapes(body, chat=route == "/v1/chat/completions")
        if route == "/v1/chat/completions":
            tools = body.get("tools") or None
            messages = normalize_messages(body.get("messages"))
            prompt_ids, prompt_text = self._chat_prompt(trajectory_id, messages, tools)
        elif route == "/v1/completions":
            prompt_ids, prompt_text, tools = self._completion_prompt(body.get("prompt")), None, None
        else:
            raise RequestRefused(404, "not_found", f"no route {path!r}")
        request = self._request(trajectory_id, prompt_ids, body)
        self._queue.put(request)
        if not request.done.wait(timeout=max(0.0, self._deadline - time.monotonic()) + 1.0):
            request.cancelled = True  # a later serve() skips it if still queued (one in flight runs on)
            raise RequestRefused(503, "deadline", "the rollout's deadline passed")
        if request.error is not None:
            raise RequestRefused(503, "unavailable", request.error)
        assert request.choices is not None
        choices, records = [], []
        for index, (tokens, log_probs) in enumerate(request.choices):
            choice, record = self._choice(index, tokens, log_probs, request, body, tools, route)
            record.prompt_text, record.version = prompt_text, request.version
            choices.append(choice)
            records.append(record)
        self.ledger.add(trajectory_id, *records)  # one model call
        completion_tokens = sum(len(t) for t, _ in request.choices)
        return {
            "id": request_id,
            "object": "chat.completion" if route == "/v1/chat/completions" else "text_completion",
            "created": int(time.time()),
            "model": str(body.get("model") or self.settings.model_name),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "prompt_token_ids": prompt_ids,
            "trajectory_id": trajectory_id,
            **({"weight_version": request.version} if self.versions is not None else {}),
        }

    def _chat_prompt(
        self, trajectory_id: str, messages: list[dict[str, Any]], tools: list[dict] | None
    ) -> tuple[list[int], str]:
        earlier = [
            (r.prompt_text, r.prompt_ids, r.completion_ids, r.message)
            for r in self.ledger.records(trajectory_id)
            if r.prompt_text is not None and r.message is not None
        ]
        text = render(self.tokenizer, messages, tools, generation=True)
        continued = continue_prompt(self.tokenizer, messages, tools, earlier)
        if continued is not None:
            return continued.prompt_ids, text
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        raise RequestRefused(
            400, "invalid_prompt", "'prompt' must be a non-empty string or list of token ids"
        )

    def _request(self, trajectory_id: str, prompt_ids: list[int], body: dict[str, Any]) -> GenerationRequest:
        """The queued request, after the trajectory's turn and token limits."""
        settings = self.settings
        turns, used = self.ledger.budget(trajectory_id, prompt_ids)
        refusal = None
        if turns >= settings.max_turns:
            refusal = ("max_turns", f"trajectory {trajectory_id} made its {settings.max_turns} model calls")
        elif used == 0 and len(prompt_ids) > settings.prompt_length:
            refusal = ("prompt_too_long", f"prompt of {len(prompt_ids)} tokens > {settings.prompt_length}")
        elif used >= settings.response_length:
            refusal = ("token_budget", f"trajectory {trajectory_id} spent {settings.response_length} tokens")
        if refusal is not None:
            self.ledger.mark_truncated(trajectory_id, refusal[0])
            raise RequestRefused(400, *refusal)
        # n: each choice is filed as a model call of the trajectory, so at most max_turns of them.
        n = _field(body, "n", int, 1, lambda v: 1 <= v <= settings.max_turns, f"in [1, {settings.max_turns}]")
        remaining = settings.response_length - used
        key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
        max_tokens = min(_field(body, key, int, remaining, lambda v: v >= 1, ">= 1"), remaining)
        temperature = _field(body, "temperature", float, 1.0, lambda v: 0 <= v < math.inf, "finite, >= 0")
        top_p = _field(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
        top_k = _field(body, "top_k", int, -1, lambda v: v >= -1, "-1 (off) or >= 0")
        sampling = (temperature == 0, temperature if temperature > 0 else 1.0, top_p, top_k)
        return GenerationRequest(trajectory_id, prompt_ids, n, max_tokens, sampling)

    def _choice(
        self,
        index: int,
        tokens: list[int],
        log_probs: list[float],
        request: GenerationRequest,
        body: dict[str, Any],
        tools: list[dict] | None,
        route: str,
    ) -> tuple[dict[str, Any], TurnRecord]:
        """The wire choice and the ledger record of one sample (stop strings cut, tool calls parsed)."""
        stops = body.get("stop") or []
        tokens, log_probs, text, stopped = _cut_at_stop(
            self.tokenizer, tokens, log_probs, stops, self.stop_ids
        )
        finish = "stop" if stopped or (tokens and tokens[-1] in self.stop_ids) else "length"
        record = TurnRecord(f"{request.trajectory_id}/{index}", request.prompt_ids, tokens, log_probs, finish)
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": tokens}
        if route == "/v1/chat/completions":
            content, calls = parse_tool_calls(text, self.settings.tool_call_format, tools)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                choice["finish_reason"] = "tool_calls" if finish == "stop" else finish
            choice["message"] = message
            record.message, record.tool_calls = normalize_messages([message])[0], len(calls)
            if body.get("logprobs"):
                pieces = [self.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
                choice["logprobs"] = {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for p, lp in zip(pieces, log_probs)
                    ]
                }
        else:
            choice["text"] = text
            if body.get("logprobs") is not None:
                pieces = [self.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
                choice["logprobs"] = {"tokens": pieces, "token_logprobs": log_probs}
        return choice, record


def _route(path: str) -> tuple[str | None, str]:
    """(trajectory id from a ``/trajectories/<id>`` prefix or None, the OpenAI route)."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.startswith("/trajectories/"):
        _, _, rest = path.partition("/trajectories/")
        trajectory_id, _, route = rest.partition("/")
        return trajectory_id or None, "/" + route
    return None, path


def _cut_at_stop(
    tokenizer: Any, tokens: list[int], log_probs: list[float], stops: Any, stop_ids: set[int]
) -> tuple[list[int], list[float], str, bool]:
    """(ids up to the one completing the first stop string, their log-probs, the text before
    that string (without a final stop token), whether a stop string was hit)."""
    stops = [stops] if isinstance(stops, str) else [s for s in stops if isinstance(s, str) and s]

    def hit(k: int) -> tuple[str, int] | None:  # the first k ids' text and its first stop, if any
        text = tokenizer.decode(tokens[:k], skip_special_tokens=False)
        found = [text.find(s) for s in stops if s in text]
        return (text, min(found)) if found else None

    # The cut is the shortest prefix whose text holds a stop string. A longer prefix's text holds
    # what a shorter one's does, so one decode tells whether there is a cut and a binary search
    # finds it (log2(len) decodes; decoding every prefix was quadratic in the response's length).
    last = hit(len(tokens)) if stops else None
    if last is not None:
        lo, hi = 0, len(tokens)  # the empty text holds no stop; the whole one does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = hit(mid)
            lo, hi, last = (mid, hi, last) if found is None else (lo, mid, found)
        return tokens[:hi], log_probs[:hi], last[0][: last[1]], True
    body = tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens
    return tokens, log_probs, tokenizer.decode(body, skip_special_tokens=False), False


class _Server(ThreadingHTTPServer):
    # Every live conversation may connect at once: the default listen backlog (5) resets the rest.
    request_queue_size = 1024
    daemon_threads = True


class _Handler(BaseHTTPRequestHandler):
    endpoint: PolicyEndpoint  # set on the subclass made per endpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the trainer's log

    def do_GET(self) -> None:
        if _route(self.path)[1] == "/v1/models":
            name = self.endpoint.settings.model_name
            self._send(
                200,
                {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "verl-megatron"}]},
            )
        else:
            self._send(404, _error("not_found", f"no route {self.path!r}"))

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, payload = 200, self.endpoint.handle(self.path, headers, body)
        except RequestRefused as err:
            status, payload = err.status, _error(err.code, str(err))
        except (ValueError, TypeError, KeyError) as err:
            status, payload = 400, _error("invalid_request", f"{type(err).__name__}: {err}")
        except Exception as err:  # the endpoint's own bug: an answer, not a dropped connection
            status, payload = 500, _error("internal_error", f"{type(err).__name__}: {err}", "server_error")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client has left
            self._send(status, payload)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _error(code: str, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def _refuse(name: str, need: str, value: Any) -> RequestRefused:
    return RequestRefused(400, "invalid_request", f"{name!r} must be {need}, got {value!r}"[:300])


def _check_shapes(body: dict[str, Any], chat: bool) -> None:
    """Refuse (400 naming the field) a ``stop``, ``tools`` or ``messages`` the endpoint could not
    read: checked before the request is queued, so a malformed one costs no engine call."""
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str) or _list_of(stop, str)):
        raise _refuse("stop", "a string or a list of strings", stop)
    if not chat:
        return
    tools = body.get("tools")
    if not (tools is None or _list_of(tools, dict)):
        raise _refuse("tools", "a list of objects", tools)
    for i, tool in enumerate(tools or []):
        function = tool.get("function", tool)  # chat_format's bare calls read name and parameters
        parameters = function.get("parameters", {}) if isinstance(function, dict) else None
        if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
            raise _refuse(f"tools[{i}].function", "an object with object 'parameters'", tool)
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise _refuse("messages", "a non-empty list", messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _refuse(f"messages[{i}]", "an object with a string 'role'", message)
        content = message.get("content")
        if not (content is None or isinstance(content, (str, list))):
            raise _refuse(f"messages[{i}].content", "a string, a list of parts or null", content)
        calls = message.get("tool_calls") or []
        if not _list_of(calls, dict):
            raise _refuse(f"messages[{i}].tool_calls", "a list of objects", calls)
        for j, call in enumerate(calls):
            function = call.get("function", {})
            if not isinstance(function, dict) or not isinstance(function.get("arguments", {}), (str, dict)):
                need = "an object whose 'function' has string or object 'arguments'"
                raise _refuse(f"messages[{i}].tool_calls[{j}]", need, call)


def _field(body: dict[str, Any], key: str, kind: type, default: Any, valid: Callable, need: str) -> Any:
    """``body[key]`` as ``kind`` (``default`` when absent); refused (400 naming it) unless valid."""
    value = body.get(key)
    if value is None:
        return default
    try:
        number = None if isinstance(value, bool) else kind(value)
    except (TypeError, ValueError, OverflowError):
        number = None
    if number is None or not valid(number):
        raise RequestRefused(400, "invalid_sampling", f"{key!r} must be a number {need}, got {value!r}"[:300])
    return number


def _list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) for v in value)
