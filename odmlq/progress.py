"""Progress of long work on the terminal (internal).

A bar on stderr (tqdm) while calibrating, converting, verifying, trying
fixes and tuning; shown only when stderr is a terminal unless asked
(``progress=True``), never with ``progress=False`` (``--quiet``). It writes
nothing to stdout, so piped results stay clean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def shown(progress: bool | None) -> bool:
    """Whether to show progress: as asked, else when stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return False


def steps(items: Iterable[T], what: str, *, total: int | None = None, progress: bool | None = None,
          unit: str = "it") -> Iterator[T]:
    """`items`, with a bar counting them on stderr when `progress` says so."""
    if not shown(progress):
        yield from items
        return
    from tqdm.auto import tqdm

    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with tqdm(items, desc=what, total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        yield from bar
    # A finished step leaves one line saying what took the time.
    print(f"{what}: {bar.n} {unit} in {bar.format_dict['elapsed']:.1f} s", file=sys.stderr)


class Stage:
    """One step of unknown length (a conversion): said when it starts and ends.

    Example:
      >>> with Stage("converting", progress=None):
      ...     convert(...)
    """

    def __init__(self, what: str, *, progress: bool | None = None):
        self.what, self.show = what, shown(progress)

    def __enter__(self) -> "Stage":
        if self.show:
            self.start = time.perf_counter()
            print(f"{self.what}...", end="", file=sys.stderr, flush=True)
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self.show:
            state = "failed" if kind is not None else "done"
            print(f" {state} in {time.perf_counter() - self.start:.1f} s", file=sys.stderr, flush=True)


class Bar:
    """A bar advanced by hand (`tick()`), for work reported by callback.

    Example:
      >>> with Bar("sensitivity at int8", total=63, progress=None) as bar:
      ...     run(on_group=bar.tick)
    """

    def __init__(self, what: str, *, total: int | None = None, progress: bool | None = None, unit: str = "it"):
        self.what, self.total, self.unit, self.show = what, total, unit, shown(progress)
        self.bar = None

    def __enter__(self) -> "Bar":
        if self.show:
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=self.what, total=self.total, unit=self.unit, file=sys.stderr, leave=False,
                            dynamic_ncols=True)
        return self

    def tick(self, *_) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def __exit__(self, kind, value, traceback) -> None:
        if self.bar is not None:
            self.bar.close()
            if kind is None:
                print(f"{self.what}: {self.bar.n} {self.unit} in {self.bar.format_dict['elapsed']:.1f} s",
                      file=sys.stderr)
