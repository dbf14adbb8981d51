"""Progress lines for the long command-line jobs (the demo, the mismatch anatomy): numbered
steps with their wall time, and notes inside a step, flushed as they happen."""

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Steps:
    """Numbered progress lines with each step's wall time, flushed as they happen."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.times: dict[str, float] = {}

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.done += 1
        print(f"\n[{self.done}/{self.total}] {title} ...", flush=True)
        start = time.perf_counter()
        yield
        self.times[title] = time.perf_counter() - start
        print(f"[{self.done}/{self.total}] done in {self.times[title]:.1f} s", flush=True)


def note(text: str) -> None:
    """A progress line inside a step (long steps say what they are doing)."""
    print(f"  .. {text}", flush=True)
