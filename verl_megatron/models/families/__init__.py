"""Model families beyond the Llama layout: each module maps one family's HF config and weights to megatron."""
