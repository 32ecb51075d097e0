"""A rollout engine that runs its generation through an inner engine (multi-turn, agents)."""

from __future__ import annotations

from verl_megatron.rollout.base import RolloutEngine

__all__ = ["WrappedRollout"]


class WrappedRollout(RolloutEngine):
    """Hands the checkpoint state and the weight / memory hooks to ``self.engine``; a subclass
    sets ``engine`` and writes ``generate_sequences``."""

    engine: RolloutEngine

    def state_dict(self) -> dict[str, int]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.engine.load_state_dict(state)

    def sync_weights(self) -> None:
        self.engine.sync_weights()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def wake_up_weights(self) -> None:
        self.engine.wake_up_weights()
