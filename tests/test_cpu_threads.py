"""The C decode step's thread count, chosen by timing real steps (kernels/cpu_threads.py), with a fake clock."""

from __future__ import annotations

import pytest

from swarmkv.kernels import cpu_threads
from swarmkv.kernels.cpu_threads import FIRST_INTERVAL, MAX_INTERVAL, ThreadChoice


class Clock:
    """perf_counter that advances by the fake step's cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(choice: ThreadChoice, clock: Clock, seconds: dict[int, float], steps: int) -> list[int]:
    used: list[int] = []

    def step(threads: int) -> int:
        used.append(threads)
        clock.now += seconds[threads]
        return threads

    for _ in range(steps):
        choice.run(1, step)
    return used


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(cpu_threads.time, "perf_counter", fake)
    return fake


def test_the_team_keeps_running_while_it_is_faster(clock: Clock) -> None:
    choice = ThreadChoice(2)
    used = run_steps(choice, clock, {2: 0.01, 1: 0.018}, 200)
    assert used[:FIRST_INTERVAL] == [2] * FIRST_INTERVAL
    assert used.count(1) <= 4  # a few tries, each further apart
    assert choice.current == 2 and choice.interval > FIRST_INTERVAL


def test_a_contended_team_gives_way_to_one_thread_and_comes_back(clock: Clock) -> None:
    choice = ThreadChoice(2)
    run_steps(choice, clock, {2: 0.5, 1: 0.02}, FIRST_INTERVAL + 4)  # the cores are busy elsewhere
    assert choice.current == 1
    used = run_steps(choice, clock, {2: 0.01, 1: 0.02}, 3 * FIRST_INTERVAL)  # the load went away
    assert choice.current == 2 and used[-1] == 2


def test_one_thread_has_nothing_to_choose(clock: Clock) -> None:
    choice = ThreadChoice(1)
    assert run_steps(choice, clock, {1: 0.01}, 50) == [1] * 50
    assert MAX_INTERVAL >= FIRST_INTERVAL
