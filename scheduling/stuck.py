"""A stuck pool, seen from inside one of its workers, and how the pool gets itself restarted.

Words. A *pool* is one `qcluster`: its main process, its sentinel and the sentinel's children (the
pusher, the monitor, the workers). Its *internal queue* is the multiprocessing queue the pusher
fills from the broker and the sentinel hands out from, one task to each worker that asks
(scheduling.pool; `WorkerChannel.size` is its waiting count). A worker is *idle* between tasks
(django-q2's `pre_execute` and `post_execute_in_worker` signals, sent in the worker).

A pool is **stuck** when work has waited in its internal queue for a while and this worker, idle
all along, has started none of it. In a working pool an idle worker is handed waiting work at once.
An idle worker that sees work wait therefore knows its pool no longer hands work out: what nobody
foresaw (a frozen sentinel, a failure in its hand-out; a killed worker is not one: scheduling.pool,
docs/architecture.md "Running workers in production"). The pulse threads keep writing heartbeats
all the while, and nothing in the pool recovers by itself: this is the backstop.

Judged this way, by work not started inside the pool, the verdict does not depend on who fetched
the message from the broker, nor on the broker: a pool busy with long tasks is busy (its workers
are not idle), a pool with nothing to do is idle (its internal queue is empty), and two pools on
one queue are judged apart (each has its own internal queue). Messages a killed pool had fetched
are nobody's internal queue: they do not make a new pool look stuck.

Every worker's pulse looks once a tick (`StuckWatch.look`, no database query) and writes the
verdict with its heartbeat (`WorkerHeartbeat.stalled_since`, which /healthz and
`fairshare_queue_stalled` read: scheduling.liveness). Once the pool has been stuck for
FAIRSHARE["STALLED_POOL_EXIT_AFTER_S"], the pulse ends the whole pool (`exit_pool`): SIGKILL of its
main process first (a non-zero exit: killed by a signal), then its sentinel and every process of
it, itself last. A plain supervisor (systemd `Restart=always`, Kubernetes) starts it again; nothing
is lost that a stuck pool was not already losing (the ORM broker delivers its fetched messages
again after `retry`, the reconciler re-sends exports, dispatch leases give held work back).
SIGTERM would not do: a stuck pool's sentinel may never hand its workers their stop.

Linux only (`/proc` names the pool's processes); elsewhere the pool is reported, not ended.
"""
import logging
import multiprocessing
import os
import signal
import time
from pathlib import Path

logger = logging.getLogger("fairshare.stuck")
PROC = Path("/proc")


def internal_queue():
    """This worker process's internal queue, or None outside a django-q2 worker.

    django-q2 passes it to `django_q.worker.worker` as its first argument and exposes it nowhere
    else; the Process object of a forked child keeps its target and arguments.
    """
    from django_q.worker import worker

    process = multiprocessing.current_process()
    if getattr(process, "_target", None) is worker and getattr(process, "_args", None):
        return process._args[0]
    return None


def waiting_tasks(queue) -> int:
    """Tasks put into the internal queue and not yet taken: django-q2's shared counter, read without
    its lock (a process killed while holding that lock must not hang the one that looks)."""
    return queue.size.count.get_obj().value


class StuckWatch:
    """One worker's view of its pool: fed by django-q2's task signals, asked once a tick."""

    def __init__(self, queue) -> None:
        self.queue = queue
        self.in_task = False
        self.last_start = 0.0  # time.monotonic() of this worker's last task start
        self.waiting_since: float | None = None  # monotonic: idle, and work waiting, since then

    def task_started(self, **kwargs) -> None:
        self.in_task, self.last_start = True, time.monotonic()

    def task_ended(self, **kwargs) -> None:
        self.in_task = False

    def wants_work(self) -> bool:
        """Whether this worker is idle with nothing waiting for it in its pool: held work released
        now would be its to run."""
        return not self.in_task and waiting_tasks(self.queue) == 0

    def look(self, now: float | None = None) -> float | None:
        """Seconds this idle worker has watched work wait in its pool without starting any (None:
        working, or nothing waits)."""
        now = time.monotonic() if now is None else now
        if self.in_task or waiting_tasks(self.queue) == 0:
            self.waiting_since = None
        elif self.waiting_since is None or self.last_start >= self.waiting_since:
            self.waiting_since = now  # (a task started since: the wait starts again)
        return None if self.waiting_since is None else now - self.waiting_since


def _stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, ...)."""
    return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int | None:
    try:
        return int(_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit() and _parent(int(entry.name)) == pid:
            found.append(int(entry.name))
    return found


def _is_qcluster(pid: int) -> bool:
    try:
        return b"qcluster" in (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


def pool_processes() -> tuple[int | None, int, list[int]]:
    """(main, sentinel, the sentinel's children but this process) of this worker's pool.

    The main is named only when it is a `qcluster` process other than PID 1: a sentinel whose main
    died belongs to init, and init is never signalled (in a container where qcluster is PID 1 the
    kernel would ignore it anyway: the main exits by itself once its sentinel is gone).
    """
    sentinel = os.getppid()
    main = _parent(sentinel)
    if main is not None and (main <= 1 or not _is_qcluster(main)):
        main = None
    return main, sentinel, [pid for pid in _children(sentinel) if pid != os.getpid()]


def exit_pool(*, queue: str, stuck_s: float) -> None:
    """End this worker's whole pool with SIGKILL, the main PID first, this process last."""
    from scheduling.models import WorkerHeartbeat
    from scheduling.services import worker_id

    if not PROC.is_dir():
        logger.error("pool stuck; cannot end it without /proc", extra={"queue": queue, "stuck_s": round(stuck_s)})
        return
    main, sentinel, others = pool_processes()
    logger.critical("pool stuck: work waits in it that no worker takes; ending it so its supervisor starts it again",
                    extra={"queue": queue, "stuck_s": round(stuck_s), "main_pid": main, "sentinel_pid": sentinel})
    host = worker_id().rsplit(":", 1)[0]
    try:
        # Its heartbeats go with it: /healthz must not go on calling the restarted pool stuck.
        WorkerHeartbeat.objects.filter(worker__in=[f"{host}:{pid}" for pid in [*others, os.getpid()]]).delete()
    except Exception as exc:  # the pool ends all the same; its heartbeats age out
        logger.warning("could not forget the pool's heartbeats", extra={"error_class": type(exc).__name__})
    for pid in ([main] if main else []) + [sentinel, *others]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os.kill(os.getpid(), signal.SIGKILL)
