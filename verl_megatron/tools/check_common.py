"""What both checks of ``verl-megatron check-hf`` (logits and reward scores) share: prompts, verdict."""

from __future__ import annotations

import os

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


def verdict(
    max_diff: float, tolerance: float, *, reporter: bool, head: str, quantity: str, prompts: int
) -> int:
    """Exit status of a check (0: ``max_diff`` within ``tolerance``, else 1); ``reporter`` prints the line.

    ``head`` names the checkpoint and layout, ``quantity`` what was compared ("logit", "score").
    """
    ok = float(max_diff) <= tolerance
    if reporter:
        print(
            f"{head}: max |{quantity} diff| = {float(max_diff):.3e} over {prompts} prompts "
            f"(tolerance {tolerance:g}): {'OK' if ok else 'FAILED'}",
            flush=True,
        )
    return 0 if ok else 1
