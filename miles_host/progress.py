"""A one-line progress bar over rollouts with ETA and the last reward (stderr)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``[#####-----] 12/30 rollouts  ETA 1m05s  reward 0.41``."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, width: int = 24):
        self.total, self.start, self.enabled, self.width = total, start, enabled, width
        self.began = time.perf_counter()
        self.interactive = sys.stderr.isatty()

    def update(self, done: int, reward: float | None) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.began
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else 0.0
        filled = int(self.width * done / max(1, self.total))
        bar = "#" * filled + "-" * (self.width - filled)
        reward_text = f"  reward {reward:.3f}" if reward is not None else ""
        line = f"[{bar}] {done}/{self.total} rollouts  ETA {int(eta // 60)}m{int(eta % 60):02d}s{reward_text}"
        end = "\r" if self.interactive else "\n"
        print(line, end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.interactive:
            print(file=sys.stderr)
