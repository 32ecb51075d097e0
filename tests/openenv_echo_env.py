"""A local OpenEnv environment for tests/test_agent_openenv.py: a real subclass of openenv's
``Environment`` with pydantic Action / Observation models (its own module, so that collecting
the tests does not import openenv, whose server package imports gradio)."""

from __future__ import annotations

import json
import os
import time

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

EPISODES: list[tuple[str, list[str], list[float]]] = []  # (episode id, actions, rewards), this process
# When set: a file each closed episode appends [episode id, actions, rewards, pid] to as a JSON line
# (episodes run in worker processes by default, where EPISODES is the worker's own).
LOG_VAR = "OPENENV_ECHO_LOG"


class DigitsAction(Action):
    """The digits the policy says."""

    digits: str


class DigitsObservation(Observation):
    text: str = ""


class EchoTwiceEnv(Environment[DigitsAction, DigitsObservation, State]):
    """Say the key (0.25), then the key reversed (0.75, done). A negative seed fails the reset."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> DigitsObservation:
        if seed < 0:
            raise ValueError("no key for a negative seed")
        self.key, self.turn = f"{seed % 10}{(3 * seed + 1) % 10}", 0
        self._state = State(episode_id=episode_id)
        self.record: tuple[str, list[str], list[float]] = (str(episode_id), [], [])
        EPISODES.append(self.record)
        return DigitsObservation(text=self.key)

    def step(self, action: DigitsAction, timeout_s=None, **kwargs) -> DigitsObservation:
        target = (self.key, self.key[::-1])[self.turn]
        reward = (0.25, 0.75)[self.turn] * float(action.digits == target)
        self.turn += 1
        self._state.step_count += 1
        self.record[1].append(action.digits)
        self.record[2].append(reward)
        return DigitsObservation(text=self.key[::-1], reward=reward, done=self.turn == 2)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        if os.environ.get(LOG_VAR) and hasattr(self, "record"):
            with open(os.environ[LOG_VAR], "a") as f:
                f.write(json.dumps([*self.record, os.getpid()]) + "\n")


def read_log(path: str) -> list[tuple[str, list[str], list[float], int]]:
    """The episodes a LOG_VAR file holds, in the order they closed."""
    with open(path) as f:
        return [tuple(json.loads(line)) for line in f]


class PidEnv(EchoTwiceEnv):
    """Also logs each reset with its pid (a killed worker never closes)."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> DigitsObservation:
        with open(os.environ[LOG_VAR], "a") as f:
            f.write(json.dumps([str(episode_id), [], [], os.getpid()]) + "\n")
        return super().reset(seed, episode_id, **kwargs)


class StepHangsEnv(PidEnv):
    def step(self, action: DigitsAction, timeout_s=None, **kwargs) -> DigitsObservation:
        time.sleep(3600)
        raise AssertionError("unreachable")


class StepExitsEnv(PidEnv):
    def step(self, action: DigitsAction, timeout_s=None, **kwargs) -> DigitsObservation:
        os._exit(3)


class ResetFailsEnv(EchoTwiceEnv):
    def reset(self, seed=None, episode_id=None, **kwargs) -> DigitsObservation:
        raise RuntimeError("the server is down\nsecond line")


def make_echo_env(**kwargs) -> EchoTwiceEnv:
    """A factory that is not a class; logs the pid it runs in (["made", [], [], pid]) first."""
    if os.environ.get(LOG_VAR):
        with open(os.environ[LOG_VAR], "a") as f:
            f.write(json.dumps(["made", [], [], os.getpid()]) + "\n")
    return EchoTwiceEnv(**kwargs)


def make_a_dict() -> dict:
    return {}


def make_fails() -> EchoTwiceEnv:
    raise RuntimeError("no license server\nsecond line")


def make_type_error() -> EchoTwiceEnv:
    """Its own body raises TypeError (not a wrong env_kwargs: it is given none)."""
    return EchoTwiceEnv(*[None] * 9)
