"""What both checks of ``verl-megatron check-hf`` (logits and reward scores) share: prompts, verdict."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch

PROMPTS = (
    "The capital of France is",
    "Question: what is 12 + 35? Answer:",
    "def fibonacci(n):\n    ",
)


def check_prompts(path: str, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """Token ids [T] of the built-in prompts, or random ids when the folder has no tokenizer."""
    has_tokenizer = any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    )
    if has_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return [torch.tensor(tokenizer(p)["input_ids"], dtype=torch.long) for p in PROMPTS]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator) for length in (7, 12, 5)]


def max_abs_diff(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest |megatron - reference| over the prompts; inf if any difference is not finite.

    inf, not NaN: Python's max() and a MAX all-reduce may keep the other operand against a NaN,
    so a NaN logit of any prompt but the first would vanish and the check would pass.
    """
    worst = 0.0
    for ours, reference in pairs:
        diff = (ours - reference).abs()
        if not bool(torch.isfinite(diff).all()):
            return math.inf
        worst = max(worst, float(diff.max()))
    return worst


def verdict(
    max_diff: float, tolerance: float, *, reporter: bool, head: str, quantity: str, prompts: int
) -> int:
    """Exit status of a check (0: ``max_diff`` within ``tolerance``, else 1); ``reporter`` prints the line.

    ``head`` names the checkpoint and layout, ``quantity`` what was compared ("logit", "score").
    """
    ok = float(max_diff) <= tolerance
    if reporter:
        shown = f"{float(max_diff):.3e}" if math.isfinite(max_diff) else "not finite (NaN or inf values)"
        print(
            f"{head}: max |{quantity} diff| = {shown} over {prompts} prompts "
            f"(tolerance {tolerance:g}): {'OK' if ok else 'FAILED'}",
            flush=True,
        )
    return 0 if ok else 1
