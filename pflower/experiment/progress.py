"""The progress of an experiment's runs on stderr: runs done of all, elapsed and ETA."""

from __future__ import annotations

import math
import sys
import time


class Progress:
    """Runs done of all, elapsed and ETA: a tqdm bar when tqdm is installed, else one plain
    line per finished run (both on stderr)."""

    def __init__(self, total: int, done: int, enabled: bool = True) -> None:
        self.total, self.done, self.first = total, done, done
        self.started = time.monotonic()
        self.bar = None
        self.enabled = enabled and total > done
        if self.enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=done, unit="run", dynamic_ncols=True)
            except ImportError:
                print(f"{done}/{total} runs done", file=sys.stderr, flush=True)

    def update(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
            return
        elapsed = time.monotonic() - self.started
        rate = (self.done - self.first) / elapsed
        eta = (self.total - self.done) / rate if rate else math.inf
        print(
            f"{self.done}/{self.total} runs done | {_clock(elapsed)} elapsed, ETA "
            f"{_clock(eta)} | {what}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
