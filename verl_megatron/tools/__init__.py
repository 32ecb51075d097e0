"""Command-line checks: HF <-> megatron logits (check-hf) and reward heads."""
