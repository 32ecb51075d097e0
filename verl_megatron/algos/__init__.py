"""The pure RL math: losses, advantages, KL, aggregation, rollout correction. Tensors in, tensors out."""
