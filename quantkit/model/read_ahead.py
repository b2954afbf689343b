"""Reading the next piece of a checkpoint while the current one is encoded and written: file reads and
pwrite release the GIL, so on a machine where a conversion is bound by the disk, reading and writing
overlap instead of taking turns.  One piece ahead, so memory holds at most two."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


def read_ahead(calls: Iterable[Callable[[], T]]) -> Iterator[T]:
    """Each call's result in order; call k + 1 runs in a background thread while the caller uses result k.
    An exception from a call is raised where its result would have been yielded."""
    calls = iter(calls)
    with ThreadPoolExecutor(1, thread_name_prefix="quantkit-read") as pool:
        first = next(calls, None)
        pending = pool.submit(first) if first is not None else None
        while pending is not None:
            following = next(calls, None)
            result = pending.result()
            pending = pool.submit(following) if following is not None else None
            yield result
