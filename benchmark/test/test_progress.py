"""``--no-progress`` lines: at most one per interval, the rate's time left, a last line, silence when short."""

from __future__ import annotations

import io

import pytest

from benchmark.progress import ProgressLines, progress_bar


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_with_the_time_left_at_the_rate_so_far():
    clock, out = Clock(), io.StringIO()
    bar = ProgressLines(10, "calibrate", "layer-budget", every_s=60, file=out, clock=clock)
    bar.set_postfix_str("ctx 2048 win 0")
    for t in (30, 59):  # inside the first minute: nothing
        clock.now = 100 + t
        bar.update()
    assert out.getvalue() == ""
    clock.now = 100 + 60  # 3 done in 60 s: 7 left take 140 s
    bar.update()
    clock.now = 100 + 61
    bar.update()  # 1 s after the last line: nothing
    assert out.getvalue() == "[calibrate] 3/10 layer-budget (30%), 60 s, ~140 s left: ctx 2048 win 0\n"
    clock.now = 100 + 125
    bar.update(6)
    bar.close()
    assert out.getvalue().splitlines()[1:] == [
        "[calibrate] 10/10 layer-budget (100%), 125 s: ctx 2048 win 0",
        "[calibrate] 10/10 layer-budget (100%), 125 s, done",
    ]


def test_a_loop_shorter_than_the_interval_prints_nothing():
    clock, out = Clock(), io.StringIO()
    bar = ProgressLines(3, "quality grid", "fwd", every_s=60, file=out, clock=clock)
    for _ in range(3):
        clock.now += 10
        bar.update()
    bar.close()
    assert out.getvalue() == "" and bar.n == 3


def test_a_growing_total_and_an_unknown_total():
    clock, out = Clock(), io.StringIO()
    bar = ProgressLines(0, "train", "step", every_s=1, file=out, clock=clock)
    bar.total += 4
    clock.now += 2
    bar.update()
    assert out.getvalue() == "[train] 1/4 step (25%), 2 s, ~6 s left\n"
    assert ProgressLines(0, "x", "fwd", every_s=1, clock=clock).line(clock.now + 5) == "[x] 0/0 fwd, 5 s"


def test_the_bar_when_enabled_and_bad_intervals():
    from tqdm import tqdm

    bar = progress_bar(2, "grid", "fwd", enabled=True)
    assert isinstance(bar, tqdm)
    bar.close()
    assert isinstance(progress_bar(2, "grid", "fwd", enabled=False), ProgressLines)
    with pytest.raises(ValueError, match="every_s: expected > 0 seconds, got 0"):
        ProgressLines(1, "x", "fwd", every_s=0)
