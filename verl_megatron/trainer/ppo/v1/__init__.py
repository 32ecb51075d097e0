"""verl's ``trainer.ppo.v1`` import path: only the pieces this project provides (``utils``)."""
