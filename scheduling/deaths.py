"""A pool worker's death, judged by its sentinel (scheduling.pool) once nothing of the dead process
can commit any more: what becomes of the task it was running, and what it held in the tables.

- When. A worker's database sessions are named for it (`name_sessions`: `application_name`, through
  libpq's PGAPPNAME, set in the worker as it is forked). A SIGKILLed client's session ends within
  milliseconds (the server reads the closed socket), having done whatever the client sent before it
  died (a COMMIT written just before the kill counts). `sessions_ended` waits for pg_stat_activity
  to show none of them, SESSIONS_END_WITHIN_S at most; a session still there then is a backend
  running a statement nobody will read the end of: it is ended (`pg_terminate_backend`), and waited
  for again as long. Only then do the tables say the truth about the dead worker, and may others
  take over what it held. (An `application_name` set in DATABASE_URL's options would hide the
  sessions: leave it unset. Behind a pooler that does not pass it on, nothing is found, and the
  give-back then relies on the row locks the reclaim takes, as the lease's reclaim does.)
- Its task (`after_death`). No run of the task's envelope recorded by that worker: it was killed
  before anything happened, and the task goes to the next ready worker (it takes over its still
  dispatched slot). A run that ended: killed before handing in the result, which the sentinel hands
  in for it (else the ORM broker delivers the finished job again after `retry`). A run still running:
  killed mid-way; the give-back below records it lost, and the broker's own rules (redelivery,
  retry) decide whether it runs again, as for any run whose worker died.
- Its timer lock (`TimerLock`), which the sentinel's guard takes every cycle: not waited for once
  the worker is dead.
- What it held (`give_back`): its slots and its claims on held jobs, given back at once by the
  enqueue gates that took them (EnqueueGate.worker_died: budgets' reclaim, scoped to the worker)
  instead of when their leases expire (the hand-off's claim lease is 30 s, a running slot's 60 s).
  So the dead worker's account's line goes on within a second. Idempotent: the reclaim, the last
  resort, finds nothing of it later.
"""
import logging
import multiprocessing
import os
import time
from collections.abc import Callable

from django.db import DatabaseError, connection

from scheduling.broker import RUNNER
from scheduling.gates import enqueue_gates
from scheduling.models import Outcome, TaskRun
from scheduling.services import worker_id

logger = logging.getLogger("fairshare.pool")
# PostgreSQL keeps the first 63 bytes of an application_name: the pid first, so a long host name
# loses its end, not the pid.
SESSION_PREFIX, SESSION_NAME_MAX = "fairshare worker ", 63
SESSIONS_END_WITHIN_S = 5.0  # how long the sentinel waits for a dead worker's sessions to end, twice at most
SESSIONS_LOOK_S = 0.02  # and how often it looks
TIMER_LOCK_LOOK_S = 0.1  # the guard waits for a worker's timer lock in these steps, looking whether it died


def session_name(worker: str) -> str:
    """The application_name of `worker`'s ("host:pid") database sessions."""
    host, _, pid = worker.rpartition(":")
    return f"{SESSION_PREFIX}{pid}@{host}"[:SESSION_NAME_MAX]


def name_sessions() -> None:
    """In a worker process just forked: the database sessions it opens are named for it. (It opens
    them after the fork: django-q2 closes the sentinel's connections before forking.)"""
    os.environ["PGAPPNAME"] = session_name(worker_id())


def worker_of(pid: int) -> str:
    """The worker id ("host:pid") of the sentinel's worker process `pid`."""
    return f"{worker_id().rsplit(':', 1)[0]}:{pid}"


def after_death(task: dict, *, worker: str, hand_on: Callable[[dict, str], None],
                hand_in: Callable[[dict], None]) -> None:
    """`worker` died running `task` (it had started it and not handed it in): once none of its
    sessions is left, judge the task by the tables, then give back what the worker held. In a
    thread of the sentinel; its connection is closed at the end (no connection left open there).
    Should the database be away, the leases and the broker's redelivery decide, as before."""
    try:
        ended = sessions_ended(worker)
        outcomes = recorded_runs(task, worker=worker)
        if outcomes == []:
            hand_on(task, f"pool worker {worker} died after starting task %s and before its run was recorded")
        elif outcomes and Outcome.RUNNING not in outcomes:
            hand_in(task)
        if ended:
            give_back(worker)
        else:
            logger.error("pool worker %s died and its database sessions did not end: what it held is given back "
                         "when its leases expire", worker)
    except Exception:
        logger.error("pool worker %s died and its death could not be judged: its leases decide", worker, exc_info=True)
    finally:
        connection.close()


def prepare() -> None:
    """In the sentinel, before it forks its first worker: load everything judging a death loads
    (the gates' modules, the database driver's adapters, the ORM's query for the runs) by judging
    one for a worker that never was. A module imported by one of the sentinel's threads while the
    sentinel forks stays half-initialized in the child for good (the thread importing it does not
    exist there): every later `from … import` of it fails. So after the first fork nothing may be
    imported in those threads: seen as a new worker whose every pulse failed with ImportError,
    when the first death's give-back imported budgets.gate. Without the database (yet), the
    rest loads when the first death is judged, as before."""
    enqueue_gates()
    try:
        sessions_ended(worker_of(0))
        recorded_runs({"func": RUNNER, "args": ({"job": "", "ref": ""},)}, worker=worker_of(0))
        give_back(worker_of(0))
    except DatabaseError:
        logger.warning("the database is not reachable yet: a worker's death loads what judging it needs")
    finally:
        connection.close()


def sessions_ended(worker: str) -> bool:
    """Wait until pg_stat_activity shows no session of `worker`, ending those still there after
    SESSIONS_END_WITHIN_S (module docstring); False when some are left after that too."""
    name = session_name(worker)
    for terminate in (False, True):
        if terminate:
            _terminate(name, worker)
        deadline = time.monotonic() + SESSIONS_END_WITHIN_S
        while _sessions(name):
            if time.monotonic() > deadline:
                break
            time.sleep(SESSIONS_LOOK_S)
        else:
            return True
    return False


def _sessions(name: str) -> int:
    # pg_stat_activity: the server's in-memory table of its backends (max_connections rows), no disk.
    # Read outside a transaction: a transaction keeps the first view of it it took.
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %(name)s", {"name": name})
        return cursor.fetchone()[0]


def _terminate(name: str, worker: str) -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %(name)s",
                           {"name": name})
        logger.warning("pool worker %s died while its database session ran a statement: the session is ended", worker)
    except DatabaseError:  # not allowed to (another role's backend): the leases decide
        logger.warning("pool worker %s died and its database session could not be ended", worker, exc_info=True)


def recorded_runs(task: dict, *, worker: str) -> list[str] | None:
    """The outcomes of the runs of the task's envelope that `worker` recorded (an admitted run is
    recorded with its slot, in one transaction). None for a task that is not an envelope for the
    runner: not ours to judge."""
    args = task.get("args") or ()
    message = args[0] if len(args) == 1 else None
    if task.get("func") != RUNNER or not isinstance(message, dict) or "job" not in message or "ref" not in message:
        return None
    return list(TaskRun.objects.filter(job=message["job"], ref=str(message["ref"]), worker=worker)
                .values_list("outcome", flat=True))


def give_back(worker: str) -> int:
    """What the dead `worker` held, given back by the gates that took it; returns how many slots."""
    given = sum(gate.worker_died(worker=worker) for gate in enqueue_gates())
    if given:
        logger.warning("pool worker %s died holding %d slot(s): given back at once", worker, given)
    return given


class TimerLock:
    """The lock of a worker's timer (django-q2's `Value("f")`). The worker holds it while it hands in
    a result; the sentinel's guard takes it every cycle, and here stops waiting for it once the
    worker is dead (nobody is left to race). Nested (an RLock): the guard reads the timer under it."""

    def __init__(self):
        self._lock = multiprocessing.RLock()
        self._sentinel_pid = os.getpid()
        self.process: multiprocessing.Process | None = None  # the worker, once started
        self._entries: list[bool] = []  # sentinel side: whether each nested entry holds the lock

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        if os.getpid() != self._sentinel_pid or self.process is None:
            return self._lock.acquire(block, timeout)
        held = self._lock.acquire(False)
        while not held and self.process.is_alive():
            held = self._lock.acquire(True, TIMER_LOCK_LOOK_S)
        self._entries.append(held)
        return True

    def release(self) -> None:
        if os.getpid() != self._sentinel_pid or self.process is None:
            self._lock.release()
        elif self._entries.pop():
            self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
