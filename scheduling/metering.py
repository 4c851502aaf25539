"""Metering of one task run: CPU, wall, database wait, storage wait, peak memory.

A django-q2 worker process runs many tasks, so every figure is a delta taken around one run.
CPU is process CPU time (user + system); waits are wall time spent blocked on the database or on
export storage, measured where the waiting happens.
"""
import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from django.db import connections

T = TypeVar("T")

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
# This process's two /proc files, opened once (a run's metering otherwise opened and closed both,
# a few percent of a no-op job's time): by path, with the pid that opened them (a forked worker
# opens its own: /proc/self is resolved when the file is opened).
_open: dict[str, tuple[int, int]] = {}


def _proc_file(path: str, flags: int) -> int:
    pid = os.getpid()
    opened = _open.get(path)
    if opened is None or opened[0] != pid:
        opened = _open[path] = (pid, os.open(path, flags))
    return opened[1]


def _reset_peak_rss() -> None:
    # Linux: writing "5" resets the peak RSS (VmHWM) so the next reading is this run's own peak.
    with contextlib.suppress(OSError):
        os.write(_proc_file(_CLEAR_REFS, os.O_WRONLY), b"5")


def peak_rss_kb() -> int:
    try:
        status = os.pread(_proc_file(_STATUS, os.O_RDONLY), 16384, 0)  # read anew from the start each time
        for line in status.splitlines():
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@dataclass
class Meter:
    cpu_ms: int = 0
    wall_ms: int = 0
    db_wait_ms: float = 0.0
    storage_wait_ms: float = 0.0
    peak_rss_kb: int = 0
    _started: tuple[float, float] = field(default=(0.0, 0.0), repr=False)
    _stopped: bool = field(default=False, repr=False)
    # True while blocked in a streaming read that db_reads() already times (no double count).
    _in_read: bool = field(default=False, repr=False)

    @contextlib.contextmanager
    def measure(self) -> Iterator["Meter"]:
        """Meter everything inside the block, including every SQL statement on any connection."""
        _reset_peak_rss()
        self._started = (time.process_time(), time.perf_counter())
        self._stopped = False
        with contextlib.ExitStack() as stack:
            for alias in connections:
                stack.enter_context(connections[alias].execute_wrapper(self._time_query))
            try:
                yield self
            finally:
                self.stop()

    def stop(self) -> None:
        """Fix the figures now (idempotent). Settlement stops the meter so that the ledger is
        charged exactly what the TaskRun records."""
        if self._stopped:
            return
        self._stopped = True
        cpu0, wall0 = self._started
        self.cpu_ms = round((time.process_time() - cpu0) * 1000)
        self.wall_ms = round((time.perf_counter() - wall0) * 1000)
        self.peak_rss_kb = peak_rss_kb()

    def _time_query(self, execute, sql, params, many, context):
        # Once stopped, the figures are final: settlement's own queries (which still run inside
        # `measure()`) must not make the TaskRun record more than the ledger was charged.
        if self._in_read or self._stopped:
            return execute(sql, params, many, context)
        t0 = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.db_wait_ms += (time.perf_counter() - t0) * 1000

    @contextlib.contextmanager
    def storage_wait(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if not self._stopped:
                self.storage_wait_ms += (time.perf_counter() - t0) * 1000

    def db_reads(self, chunks: Iterable[T]) -> Iterator[T]:
        """Yield from a streaming read (COPY, server-side cursor), counting the time blocked in it.

        `execute_wrapper` sees only `execute()`; rows fetched later arrive outside it.
        """
        it = iter(chunks)
        clock = time.perf_counter
        waited = 0.0
        try:
            while True:
                t0 = clock()
                self._in_read = True
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    self._in_read = False
                    waited += clock() - t0
                yield item
        finally:
            if not self._stopped:
                self.db_wait_ms += waited * 1000
