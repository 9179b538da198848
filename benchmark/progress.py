"""Progress of a long benchmark loop: a tqdm bar, or with ``--no-progress`` a line a minute.

``--no-progress`` is for logs (CI, ``nohup``), where a bar's carriage returns are noise but
an hour of silence is not acceptable either: :class:`ProgressLines` prints one line to
stderr at most every ``every_s`` seconds, with the count, the elapsed time and the time
left at the rate so far, and a last line at the end of a loop that printed any. A loop
shorter than ``every_s`` prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

PROGRESS_EVERY_S = 60.0
NO_PROGRESS_HELP = "no bar; for logs, a line a minute on stderr (count, elapsed, time left) instead"


class ProgressLines:
    """The calls of a tqdm bar that the loops here use (``update``, ``set_postfix_str``, ``close``)."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float = PROGRESS_EVERY_S,
                 file: Optional[TextIO] = None, clock=time.monotonic) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s: expected > 0 seconds, got {every_s}")
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self._file, self._clock = file, clock
        self.n, self.postfix, self.printed = 0, "", 0
        self._start = clock()
        self._last = self._start

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if now - self._last >= self.every_s:
            self._last = now
            self._print(now)

    def close(self) -> None:
        if self.printed:
            self._print(self._clock(), done=True)

    def line(self, now: float, done: bool = False) -> str:
        elapsed = now - self._start
        head = f"[{self.desc}] {self.n}/{self.total} {self.unit}"
        if self.total > 0:
            head += f" ({100.0 * self.n / self.total:.0f}%)"
        head += f", {elapsed:.0f} s"
        if done:
            return head + ", done"
        if 0 < self.n < self.total:
            head += f", ~{elapsed * (self.total - self.n) / self.n:.0f} s left"
        return head + (f": {self.postfix}" if self.postfix else "")

    def _print(self, now: float, done: bool = False) -> None:
        print(self.line(now, done), file=self._file or sys.stderr, flush=True)
        self.printed += 1


def progress_bar(total: int, desc: str, unit: str, enabled: bool):
    """A tqdm bar on stderr when ``enabled``, else :class:`ProgressLines`."""
    if not enabled:
        return ProgressLines(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)
