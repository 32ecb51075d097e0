"""verl-megatron: RL post-training of LLMs on megatron-core with verl's trainer API."""

__version__ = "0.1.0"
