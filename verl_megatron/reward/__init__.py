"""The reward stage: managers, rule scorers, the code sandbox, reward models, judges, combination."""
