"""Progress of a run: a tqdm bar on a terminal, a plain periodic line otherwise (overnight logs stay
readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, done: int, enabled: bool = True, log_every_s: float = 30.0,
                 stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.done = done
        self.num_output_tokens = 0
        self.start = time.monotonic()
        self.start_done = done
        self.log_every_s = log_every_s
        self.last_log = self.start
        self.enabled = enabled
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="req", file=self.stream, dynamic_ncols=True,
                            desc="bulkgen run")

    def advance(self, num_requests: int, num_output_tokens: int) -> None:
        self.done += num_requests
        self.num_output_tokens += num_output_tokens
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(num_requests)
            self.bar.set_postfix_str(f"{self.output_rate:.1f} out tok/s", refresh=False)
        elif time.monotonic() - self.last_log >= self.log_every_s:
            self.last_log = time.monotonic()
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    @property
    def output_rate(self) -> float:
        return self.num_output_tokens / max(time.monotonic() - self.start, 1e-9)

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        finished_here = self.done - self.start_done
        remaining = self.total - self.done
        eta = f"{remaining * elapsed / finished_here:.0f}s" if finished_here and remaining > 0 else "-"
        return (f"bulkgen run: {self.done}/{self.total} requests · {self.output_rate:.1f} output tok/s · "
                f"elapsed {elapsed:.0f}s · ETA {eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
