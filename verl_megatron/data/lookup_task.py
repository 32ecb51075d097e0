"""The lookup task of the agent quickstart: the answer sits in a table only a tool can read.

A prompt is a key of ``num_digits`` digits; the answer is the table's value for it, a hash of
(seed, key) the model cannot compute. The policy must call the ``lookup`` tool with the key
(``<tool_call>KEY</tool_call>``, the ``bare`` tool-call format), read the tool's reply and
repeat the value. Keys are split into train / validation, so validation keys are never trained
on. The character tokenizer's chat template (:data:`AGENT_CHAT_TEMPLATE`) renders tool calls and
tool replies in that format.
"""

from __future__ import annotations

import hashlib
import itertools
import os

__all__ = ["AGENT_CHAT_TEMPLATE", "TOOL_TOKENS", "lookup_value", "write_lookup_dataset"]

# Special tokens the character tokenizer needs beside its role markers.
TOOL_TOKENS = ("<|tool|>", "<tool_call>", "</tool_call>")

# One marker per role, every turn closed by the eos token; an assistant's tool calls follow its
# text as <tool_call>ARGUMENT</tool_call> (the first argument's value).
AGENT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{{ '<tool_call>' + ((call['function']['arguments'].values() | list)[0] | string) + '</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|endoftext|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def lookup_value(key: str, seed: int = 0, num_digits: int = 2) -> str:
    """The table's value of ``key``: ``num_digits`` digits of a hash of (seed, key). Also the
    ``lookup`` tool itself, run in the sandbox (this module imports only the standard library
    at the top for that)."""
    digest = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest(), 16)
    return str(digest % 10**num_digits).zfill(num_digits)


def write_lookup_dataset(
    out_dir: str | os.PathLike, num_digits: int = 2, seed: int = 0, val_fraction: float = 0.2
) -> tuple[str, str]:
    """``train.parquet`` / ``val.parquet`` of verl rows for every key; returns their paths."""
    import numpy as np

    from verl_megatron.data.synthetic import write_parquet

    if not 1 <= num_digits <= 4:
        raise ValueError(f"num_digits must be in 1..4, got {num_digits}")
    keys = ["".join(d) for d in itertools.product("0123456789", repeat=num_digits)]
    order = np.random.default_rng(seed).permutation(len(keys))
    num_val = max(1, round(len(keys) * val_fraction))
    paths = []
    for split, part in (("train", order[num_val:]), ("val", order[:num_val])):
        rows = [
            {
                "data_source": "agent/lookup",
                "prompt": [{"role": "user", "content": keys[i]}],
                "ability": "tool_use",
                "reward_model": {"style": "rule", "ground_truth": lookup_value(keys[i], seed, num_digits)},
                "extra_info": {"split": split, "index": int(i), "key": keys[i], "table_seed": seed},
            }
            for i in part
        ]
        path = os.path.join(os.fspath(out_dir), f"{split}.parquet")
        write_parquet(rows, path)
        paths.append(path)
    return paths[0], paths[1]
