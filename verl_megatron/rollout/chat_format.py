"""Chat text for the endpoint: the model's chat template, tool calls in its format, and the
token-exact continuation of a conversation.

A harness sends the whole message history each turn. Re-tokenizing that history would give
other ids than the ones the engine sampled (a BPE merges "hel" + "lo" into "hello"), so the
policy would be trained on tokens it never produced. :func:`continue_prompt` instead keeps the
previous turn's prompt and sampled ids as they are and tokenizes only what the template adds
after the assistant message: the rest of the template's rendering of that message (e.g. the
``\\n`` after ``<|im_end|>``) and the new messages (tool results, user turns).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Continuation",
    "continue_prompt",
    "normalize_messages",
    "parse_tool_calls",
    "render",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI wire messages as chat templates read them: tool-call arguments as dicts (the wire
    carries JSON strings), content parts joined into text. Raises ValueError on a malformed list."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            message["content"] = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        elif content is None:
            message["content"] = ""
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_as_dict(call) for call in message["tool_calls"]]
        else:
            message.pop("tool_calls", None)
        out.append(message)
    return out


def _call_as_dict(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function", {}))
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            arguments = {"input": arguments}
    function["arguments"] = arguments
    return {**call, "type": call.get("type", "function"), "function": function}


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, generation: bool) -> str:
    """The chat template's text of ``messages`` (and ``tools``), with the assistant header when
    ``generation``."""
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation, tokenize=False
    )


def parse_tool_calls(text: str, fmt: str, tools: list[dict] | None) -> tuple[str, list[dict[str, Any]]]:
    """(content without the tool-call blocks, OpenAI ``tool_calls``) of a generated turn.

    ``fmt``: ``hermes``: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` is a
    call (a block that is not such JSON stays in the content); ``bare``: the block's text is the
    only argument of the request's first tool; ``none``: no calls.
    """
    if fmt == "none" or TOOL_CALL_OPEN not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        call = _hermes_call(match.group(1)) if fmt == "hermes" else _bare_call(match.group(1), tools)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        name, arguments = call
        calls.append(
            {
                "id": f"call_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _hermes_call(body: str) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def _bare_call(body: str, tools: list[dict] | None) -> tuple[str, dict[str, Any]] | None:
    if not tools:
        return None
    function = tools[0].get("function", tools[0])
    properties = list(function.get("parameters", {}).get("properties", {})) or ["input"]
    return str(function.get("name", "")), {properties[0]: body}


@dataclass(frozen=True)
class Continuation:
    """Prompt ids of a chat request that continues an earlier turn of its trajectory.

    Attributes:
        prompt_ids: the earlier turn's prompt ids + its sampled ids + the added tokens.
        exact_bridge: the sampled text was a prefix of the template's rendering of the assistant
            message (else nothing is inserted between the sampled ids and the new messages).
    """

    prompt_ids: list[int]
    exact_bridge: bool


def continue_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    earlier: list[tuple[str, list[int], list[int], dict[str, Any]]],
) -> Continuation | None:
    """The token-exact prompt of ``messages`` when it extends an earlier turn (see the module
    docstring); None when no earlier turn matches (the caller then tokenizes the whole text).

    ``earlier``: (prompt text, prompt ids, sampled ids, returned message) of the trajectory's
    turns, oldest first. A turn matches when the history before the last assistant message
    renders to its prompt text and that message renders as the one the endpoint returned.
    """
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None or not earlier:
        return None
    head = render(tokenizer, messages[:last], tools, generation=True)
    upto = render(tokenizer, messages[: last + 1], tools, generation=False)
    full = render(tokenizer, messages, tools, generation=True)
    if not (upto.startswith(head) and full.startswith(upto)):
        return None
    for prompt_text, prompt_ids, sampled_ids, returned in reversed(earlier):
        if prompt_text != head:
            continue
        if render(tokenizer, [*messages[:last], returned], tools, generation=False) != upto:
            continue
        sampled_text = tokenizer.decode(sampled_ids, skip_special_tokens=False)
        assistant_text = upto[len(head) :]
        exact = assistant_text.startswith(sampled_text)
        added = (assistant_text[len(sampled_text) :] if exact else "") + full[len(upto) :]
        ids = tokenizer.encode(added, add_special_tokens=False) if added else []
        return Continuation(list(prompt_ids) + list(sampled_ids) + list(ids), exact)
    return None
