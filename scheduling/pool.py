"""A worker pool in which a worker's death never stops the others: each django-q2 worker takes its
tasks over a channel of its own.

Why. django-q2's workers read one shared `multiprocessing.Queue` whose readers share a lock: an idle
worker waits in `get()` holding it, and SIGKILLed there (the OOM killer, `kill -9`, a crash in a C
extension) it never gives it back: every other worker of the pool waits forever. The result queue's
write lock and each worker's timer lock (taken by the sentinel's guard every cycle) have the same
flaw in narrower windows, and a task a killed worker had taken was lost with it.

The design: `ChannelSentinel`, a subclass of django-q2's Sentinel (its worker, pusher and monitor
run unchanged).
- Each worker has a duplex pipe no other process reads or writes (`WorkerChannel`), given to
  django-q2's `worker()` as its task queue and its result queue: the worker says it is ready,
  receives one task, says when it starts it (`pre_execute`, before the task runs anything) and
  hands in the result.
- The pusher fills the pool's queue from the broker as before; the sentinel is its only reader (a
  hand-out thread sends a task only to a worker that said it is ready) and the result queue's only
  writer (a listening thread forwards the results to the monitor).
- The listening thread sees a worker die the moment it dies. A task sent to it and not started
  goes to the next ready worker first: it ran nowhere. A task it started and did not hand in is
  judged by the durable truth once none of the dead worker's database sessions is left, and what
  the worker held in the tables (its slots, its claims on held jobs) is given back at once
  (scheduling.deaths): no run of its envelope recorded by that worker means it was killed before
  anything happened, and it goes on too, to take over its still dispatched slot; a run that ended
  means it was killed before handing in the result, which the sentinel hands in for it; a run
  still running was killed mid-way (recorded lost, its slot given back). So it is neither lost nor
  run twice, and the dead worker's account's line goes on within a second; the reconciler and the
  leases stay the last resort.
- A worker's timer lock (deaths.TimerLock) is one the guard stops waiting for once its worker is dead.
A killed worker costs its pool that worker for one guard cycle (django-q2 starts another within
0.5 s), never the others, on any broker (the pusher is untouched). The alternatives and the cost:
docs/architecture.md "Running workers in production". The sentinel forks replacement workers while
its threads run; they hold no lock a child needs (`_close_in_child` runs in every child first) and
import nothing once the first worker is forked (deaths.prepare).

The backstop for what nobody foresaw stays (scheduling.stuck): a pool whose idle workers see work
wait in its queue (`WorkerChannel.size`) for FAIRSHARE["QUEUE_STALL_AFTER_S"] is reported, and ends
itself after FAIRSHARE["STALLED_POOL_EXIT_AFTER_S"].

The seam: django-q2's `Cluster.start` looks its sentinel class up in `django_q.cluster`'s globals;
`install()` (scheduling.apps) names ChannelSentinel there. On a django-q2 upgrade, check
`Sentinel.spawn_worker`/`spawn_pusher`/`spawn_process`/`stop` and `worker()`'s use of
`task_queue.get` and `result_queue.put`; tests/scheduling/test_pool.py kills the real thing. Linux.
"""
import collections
import functools
import logging
import multiprocessing
import os
import queue
import threading
from multiprocessing.connection import wait

from django.utils import timezone

from django_q import cluster
from django_q.queues import Queue
from django_q.signals import pre_execute
from django_q.worker import worker

from scheduling import deaths
from scheduling.faults import fault_point

logger = logging.getLogger("fairshare.pool")
READY, STARTED, RESULT, STOP = "ready", "started", "result", "STOP"  # STOP: django-q2's own pill
# A task handed on this many times after its worker died before starting it is dropped (logged): a
# task that kills every worker it reaches must not go round the pool for ever. Its message is the
# broker's, and its slot the dispatch lease's, as for any lost message.
MAX_HANDED_ON = 3
HANDED_ON = "fairshare_handed_on"  # the count, in the task (django-q2 stores only its own keys)
HAND_OUT_POLL_S = 0.1  # how long a task handed on waits at most for the hand-out thread to look


class WorkerChannel:
    """One worker's own pipe to its sentinel, given to django-q2's `worker()` as its task queue
    (`get`) and its result queue (`put`). `size` is the pool queue's waiting count (scheduling.stuck)."""

    def __init__(self, waiting):
        self.pool_end, self.worker_end = multiprocessing.Pipe(duplex=True)
        self.size = waiting
        self.process: multiprocessing.Process | None = None  # (sentinel side, from here down)
        self.held = None  # the task sent to the worker and not started yet
        self.running = None  # the task it started and has not handed in
        self.dead = False
        self._hooked = False

    def get(self):
        """In the worker: ask for the next task and wait for it."""
        if not self._hooked:
            self._hooked = True
            pre_execute.connect(self._started, weak=False, dispatch_uid="fairshare.pool.started")
        self.worker_end.send(READY)
        task = self.worker_end.recv()
        if task != STOP:
            fault_point("taken_not_started")
        return task

    def put(self, task) -> None:
        """In the worker: hand in a finished task."""
        self.worker_end.send((RESULT, task))

    def _started(self, sender, **kwargs) -> None:
        self.worker_end.send(STARTED)


Q2_SENTINEL = cluster.Sentinel


class ChannelSentinel(Q2_SENTINEL):
    """django-q2's sentinel, whose workers take tasks over channels of their own (module docstring)."""

    def __init__(self, *args, **kwargs):
        # Django-q2's __init__ starts the pool and guards it until it stops: set up first.
        self._lock = threading.Lock()  # channels' `held` and `dead`, `_channels`, `_returned`
        self._channels: dict[int, WorkerChannel] = {}  # by worker pid
        self._idle: queue.SimpleQueue[WorkerChannel] = queue.SimpleQueue()  # workers that said READY
        self._returned: collections.deque = collections.deque()  # tasks of dead workers, not started
        self._spawning: WorkerChannel | None = None
        self._wake_listener, self._wake = multiprocessing.Pipe(duplex=False)
        os.register_at_fork(after_in_child=self._close_in_child)
        deaths.prepare()  # before the first fork: the death-check thread imports nothing later
        super().__init__(*args, **kwargs)

    def spawn_cluster(self):
        # The pusher fills `_intake` (bounded, as django-q2's queue: its prefetch); only the hand-out
        # thread reads it. `task_queue` keeps what django-q2's stop() does with it (the workers' STOP
        # pills, then close): the hand-out thread gives each worker its STOP itself once the pusher
        # stopped, after everything the pool had taken.
        self._intake, self.task_queue = self.task_queue, Queue()
        super().spawn_cluster()
        logger.info("pool workers take their tasks over channels of their own (scheduling.pool)")
        for name, target in (("hand-out", self._hand_out), ("listener", self._listen)):
            threading.Thread(target=self._running(name, target), name=f"fairshare-pool-{name}", daemon=True).start()

    def spawn_pusher(self):
        return self.spawn_process(cluster.pusher, self._intake, self.event_out, self.broker)

    def spawn_worker(self):
        channel = WorkerChannel(self._intake.size)
        timer = multiprocessing.Value("f", -1, lock=deaths.TimerLock())
        self._spawning = channel
        try:
            process = self.spawn_process(worker, channel, channel, timer, self.timeout)
        finally:
            self._spawning = None
        channel.worker_end.close()  # the worker's alone: its death closes the pipe
        channel.process = timer.get_lock().process = process
        with self._lock:
            self._channels[process.pid] = channel
        self._wake.send_bytes(b"")

    def _close_in_child(self) -> None:
        """In every process forked from the sentinel: keep only the child's own end, if it is a
        worker, whose database sessions are named for it (scheduling.deaths). (Connection.close is
        idempotent: a grandchild closing them again does nothing.)"""
        for channel in list(self._channels.values()):
            channel.pool_end.close()
        if self._spawning is not None:
            self._spawning.pool_end.close()
            deaths.name_sessions()
        self._wake_listener.close()
        self._wake.close()

    @staticmethod
    def _running(name: str, loop):
        def run() -> None:
            try:
                loop()
            except Exception:  # the backstop ends a pool that no longer hands out (scheduling.stuck)
                logger.critical("the pool's %s thread stopped; its workers get no more work", name, exc_info=True)
        return run

    # --- The hand-out thread --------------------------------------------------------------------

    def _hand_out(self) -> None:
        task = None
        while True:
            channel = self._idle.get()  # a worker that waits for its next task
            while task is None:
                task = self._next_task()
            if self._send(channel, task):
                task = None  # else it died meanwhile: the task goes to the next ready worker

    def _next_task(self):
        """A task a dead worker had not started, else the pusher's next; STOP once the pool stops
        with nothing left in it. None after HAND_OUT_POLL_S without either."""
        with self._lock:
            if self._returned:
                return self._returned.popleft()
        try:
            return self._intake.get(timeout=HAND_OUT_POLL_S)
        except queue.Empty:
            stopped = self.event_out.is_set() and wait([self.pusher.sentinel], 0)
            return STOP if stopped else None

    def _send(self, channel: WorkerChannel, task) -> bool:
        # Under the lock: the listener must not bury this worker between the check and `held`.
        with self._lock:
            if channel.dead:
                return False
            try:
                channel.pool_end.send(task)
            except OSError:
                return False
            channel.held = None if task == STOP else task
        return True

    # --- The listening thread -------------------------------------------------------------------

    def _listen(self) -> None:
        while True:
            with self._lock:
                watched = {self._wake_listener: None}
                for channel in self._channels.values():
                    watched[channel.pool_end] = watched[channel.process.sentinel] = channel
            for ready in wait(list(watched)):
                channel = watched[ready]
                if channel is None:
                    self._wake_listener.recv_bytes()  # a new worker: watch it too
                elif channel.dead:
                    continue
                elif ready == channel.process.sentinel or not self._read(channel):
                    self._bury(channel)

    def _read(self, channel: WorkerChannel) -> bool:
        """Take in everything the worker said; False when its end is gone (it died)."""
        try:
            while channel.pool_end.poll():
                message = channel.pool_end.recv()
                if message == READY:
                    self._idle.put(channel)
                elif message == STARTED:
                    with self._lock:
                        channel.running, channel.held = channel.held, None
                else:
                    channel.running = None
                    self.result_queue.put(message[1])
        except (EOFError, OSError):
            return False
        return True

    def _bury(self, channel: WorkerChannel) -> None:
        """A worker died: what it said before dying counts (its "started", its result), then its
        task, if it had not started it, goes to the next ready worker; if it had started it and not
        handed it in, the tables decide, and what it held there is given back (scheduling.deaths)."""
        if channel.dead:
            return
        self._read(channel)
        with self._lock:
            channel.dead = True
            task, channel.held = channel.held, None
            running, channel.running = channel.running, None
            self._channels.pop(channel.process.pid, None)
        channel.pool_end.close()
        pid = channel.process.pid
        if task is not None:
            self._hand_on(task, f"pool worker {pid} died before starting task %s")
        elif running is not None:
            after = functools.partial(deaths.after_death, running, worker=deaths.worker_of(pid),
                                      hand_on=self._hand_on, hand_in=self._hand_in)
            threading.Thread(target=after, name="fairshare-pool-death-check", daemon=True).start()
        else:
            logger.debug("pool worker %s ended holding no task", pid)

    def _hand_in(self, task) -> None:
        self.result_queue.put({**task, "result": None, "success": True, "stopped": timezone.now()})
        logger.warning("a pool worker died after its run of task %s ended: its result handed in for it",
                       task.get("name"))

    def _hand_on(self, task, why: str) -> None:
        task[HANDED_ON] = task.get(HANDED_ON, 0) + 1
        if task[HANDED_ON] > MAX_HANDED_ON:
            logger.error("task %s dropped: %d workers died with it before its run", task.get("name"), MAX_HANDED_ON)
            return
        with self._lock:
            self._returned.appendleft(task)
        logger.warning(why + "; it goes to the next ready worker", task.get("name"))


def install() -> None:
    """Have django-q2's Cluster start a ChannelSentinel (see the module docstring for the seam)."""
    if cluster.Sentinel not in (ChannelSentinel, Q2_SENTINEL):
        raise RuntimeError(f"django_q.cluster.Sentinel is {cluster.Sentinel!r}, not django-q2's: "
                           "scheduling.pool would replace someone else's")
    cluster.Sentinel = ChannelSentinel
