"""The training loop's progress bar: tqdm's on a terminal, a line every :data:`LOG_PROGRESS_EVERY` seconds on
a stderr that is not one, nothing when the run is quiet."""

from __future__ import annotations

import sys
import time
from typing import Any


class _NoBar:
    """What the loop calls of a progress bar, doing nothing (no bar is shown)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def write(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class _LogProgress:
    """The progress bar for a stderr that is not a terminal (a log file, a pipe): the bar's text as a line of
    its own every ``every`` seconds and at the end, where tqdm redraws it ten times a second. The per-eval
    lines go to stdout, as tqdm's ``write`` sends them."""

    def __init__(self, total: int, initial: int, desc: str, every: float) -> None:
        from tqdm import tqdm

        self._format = tqdm.format_meter
        self.total, self.initial, self.desc, self.every = total, initial, desc, every
        self.n = initial
        self.postfix = ""
        self._shown: tuple[int, str] = (initial, "")  # what the last line showed
        self.start = self.last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.perf_counter() - self.last >= self.every:
            self._show()

    def set_postfix(self, values: dict[str, Any], refresh: bool = False) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        if (self.n, self.postfix) != self._shown:
            self._show()

    def _show(self) -> None:
        self.last = time.perf_counter()
        self._shown = (self.n, self.postfix)
        print(self._format(self.n, self.total, self.last - self.start, prefix=self.desc, unit="step",
                           postfix=self.postfix or None, initial=self.initial, ascii=True),
              file=sys.stderr, flush=True)


LOG_PROGRESS_EVERY = 30.0  # seconds between the progress lines on a stderr that is not a terminal


def _on_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no such method, or a closed stream
        return False


def progress_bar(show: bool, total: int, initial: int, desc: str) -> Any:
    """tqdm's bar on stderr when ``show`` (a line every LOG_PROGRESS_EVERY seconds when stderr is not a
    terminal), else one that does nothing (tqdm is then not imported)."""
    if not show:
        return _NoBar()
    if not _on_terminal(sys.stderr):
        return _LogProgress(total, initial, desc, LOG_PROGRESS_EVERY)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)
