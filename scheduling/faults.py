"""Named fault points for crash tests. TEST-ONLY: inert unless armed through the environment
(seams are refused outside the test suite: scheduling/testing.py).

    FAIRSHARE_FAULT=<point>          the point at which the worker process kills itself (SIGKILL)
    FAIRSHARE_FAULT_MARKER=<path>    fire once: only the process that creates this file fires
    FAIRSHARE_FAULT_RESUME=<path>    pause instead: the process waits at the point until this file
                                     exists (at most PAUSE_MAX_S), then goes on. With the marker, a
                                     test knows when a worker stands at the point, whatever the speed
                                     of the machine, acts on it, then lets it go on.

Points in the export job: ``before_claim`` (run admitted, export not claimed yet),
``after_claim``, ``mid_stream`` (after the first batch), ``after_publish`` (object stored, record
not yet complete), ``before_notify`` (record complete, requester not yet notified),
``after_complete`` (record complete and requester notified, task not yet acknowledged to the
broker). In the budget middleware, around every account's run: ``after_settle`` (charged and its
slot freed, the run's outcome not yet recorded); in budgets' settlement, ``after_pass_on`` (the
slot passed on to a held job claimed for this worker and admitted, not yet started). In the runtime: ``before_handoff`` (a held job
claimed for this worker, by a hand-off or a pull, with its slot taken; not yet admitted), and
``before_send`` (in the producer: the enqueue gates admitted the job, its message is not sent yet). In the
door's consumer (tasks/management/commands/door.py): ``door_before_ack`` (the call and its message
id committed, the message not yet acknowledged). In the worker pool: ``taken_not_started`` (a worker
received its task from its sentinel, not started yet), and ``before_run`` (the task started in its
worker, its run not admitted nor recorded yet). In the usage relay (usage/relay.py):
``usage_after_publish`` (a batch of events stored by the log, not yet deleted from the outbox).
"""
import os
import signal
import time

from scheduling.testing import FAULT, FAULT_MARKER, FAULT_RESUME

PAUSE_MAX_S = 60

POINTS = frozenset({"before_claim", "after_claim", "mid_stream", "after_publish", "before_notify", "after_complete",
                    "after_settle", "after_pass_on", "before_handoff", "before_send", "door_before_ack",
                    "taken_not_started", "before_run", "usage_after_publish"})


def fault_point(name: str) -> None:
    if name not in POINTS:  # a misspelt point in the code would never fire, and no test would say so
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(sorted(POINTS))}")
    if os.environ.get(FAULT.env) != name:
        return
    marker = os.environ.get(FAULT_MARKER.env)
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # already fired in some process
    resume = os.environ.get(FAULT_RESUME.env)
    if not resume:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + PAUSE_MAX_S
    while not os.path.exists(resume) and time.monotonic() < deadline:
        time.sleep(0.02)
