"""The pusher's side of the RabbitMQ broker (scheduling.rabbitmq): its consuming connection, the
relay through which the monitor and the workers reach it, and the check a delivery passes before a
worker sees it.

The relay is one pipe per process tree, made by the sentinel's broker (`open_relay`, from
`RabbitMQ.ping`) before it forks the pusher, the monitor and the workers, which inherit it. Lines:
"ack <id>" from the monitor, "take <id> <pid>" from a worker starting a delivery. An id is
"<consumer token>:<delivery tag>": one for a connection that has since died is dropped.
"""
import hashlib
import logging
import os
import time
import uuid

from django.db import close_old_connections
from django_q.signals import pre_execute
from django_q.signing import SignedPackage
from pika.exceptions import AMQPError

from scheduling import amqp
from scheduling import envelope as contract
from scheduling.broker import RUNNER
from scheduling.dead_letters import dead_letter_record
from scheduling.registry import get_job

logger = logging.getLogger("fairshare.rabbitmq")
# How long the pusher remembers a dead worker's delivery it copied, and a copy it withdrew, beyond
# the copy's delay (`requeue_orphans`): a copy arrives after that delay.
COPY_MEMORY_S = 600.0


def delivery_problem(body: bytes) -> str | None:
    """Why a delivered message cannot go to a worker, or None. A newer envelope version than this
    worker speaks is no problem here: the runner parks it (rolling upgrades)."""
    try:
        task = SignedPackage.loads(body.decode())
    except Exception:
        return "the message does not decode as a task signed with this deployment's SECRET_KEY"
    if not isinstance(task, dict) or task.get("func") != RUNNER:
        return None
    args = task.get("args") or ()
    try:
        if len(args) != 1:
            raise contract.ContractError(f"the runner takes one envelope, got {len(args)} arguments")
        get_job(contract.parse(args[0]).job)
    except contract.NeedsNewerWorker:
        return None
    except contract.ContractError as exc:  # also registry.UnknownJob
        return str(exc)
    return None


# The relay of this process tree (read end, write end); see the module docstring.
_relay: tuple[int, int] | None = None


def open_relay() -> None:
    """Make the relay, once per process tree (in the sentinel, before it forks)."""
    global _relay
    if _relay is None:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # a monitor or a worker never waits on a dead pusher
        _relay = (read_end, write_end)
        pre_execute.connect(_task_taken, dispatch_uid="fairshare.rabbitmq.taken")


def relay_read_end() -> int | None:
    return None if _relay is None else _relay[0]


def tell_pusher(line: str) -> None:
    if _relay is not None:
        try:
            os.write(_relay[1], line.encode() + b"\n")
        except (BlockingIOError, BrokenPipeError):
            pass  # no pusher reads: its connection is gone and the server requeued the message


def _task_taken(sender, task, **kwargs) -> None:
    """django-q2's `pre_execute`, in the worker: tell the pusher which process runs the delivery."""
    if task.get("ack_id"):
        tell_pusher(f"take {task['ack_id']} {os.getpid()}")


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a dead worker is a zombie until the sentinel reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


class Consumer:
    """The pusher's connection: consuming with manual acknowledgement."""

    def __init__(self, queue: str, prefetch: int):
        self.queue = queue
        self.token = uuid.uuid4().hex[:12]
        self.outstanding: dict[int, float] = {}  # delivery tag -> when it was handed out (monotonic)
        self.takers: dict[int, int] = {}  # delivery tag -> pid of the worker running it
        self.bodies: dict[int, bytes] = {}  # delivery tag -> its body, to send again if its worker dies
        # Deliveries of dead workers that were copied, and copies withdrawn (`requeue_orphans`).
        self.copied: dict[int, tuple[bytes, float]] = {}  # tag -> (digest of its body, when)
        self.withdrawn: dict[bytes, float] = {}
        self.delivered: list[tuple[str, str]] = []
        self.connection = amqp.connect()
        try:
            self.channel = self.connection.channel()
            amqp.declare(self.channel, self.connection, queue)
            self.channel.basic_qos(prefetch_count=prefetch)
            self.consumer_tag = self.channel.basic_consume(queue, self._on_message)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection: the server requeues whatever it delivered and was not acknowledged."""
        try:
            if self.connection.is_open:
                self.connection.close()
        except (AMQPError, OSError):
            pass

    def _on_message(self, channel, method, properties, body: bytes) -> None:
        problem = delivery_problem(body)
        if problem is not None:
            close_old_connections()
            dead_letter_record(queue=self.queue, reason=problem, body=body, message_id=properties.message_id)
            channel.basic_nack(method.delivery_tag, requeue=False)  # to the dead-letter queue
            logger.error("message dead-lettered", extra={"queue": self.queue})
            return
        if self.withdrawn.pop(hashlib.sha256(body).digest(), None) is not None:
            channel.basic_ack(method.delivery_tag)
            logger.warning("a dead worker's message copied to go again is dropped: its task was done after all",
                           extra={"queue": self.queue})
            return
        self.outstanding[method.delivery_tag] = time.monotonic()
        self.bodies[method.delivery_tag] = body
        self.delivered.append((f"{self.token}:{method.delivery_tag}", body.decode()))

    def ack(self, ack_id: str) -> None:
        token, _, tag = ack_id.partition(":")
        if token == self.token and self.outstanding.pop(int(tag), None) is not None:
            self.takers.pop(int(tag), None)
            self.bodies.pop(int(tag), None)
            self.channel.basic_ack(int(tag))
        elif token == self.token and (copied := self.copied.pop(int(tag), None)) is not None:
            # Done after all: its sentinel handed the result in, or the task on to a worker that
            # finished it (scheduling.deaths). Its copy is dropped when it comes.
            self.withdrawn[copied[0]] = time.monotonic()

    def taken(self, ack_id: str, pid: int) -> None:
        token, _, tag = ack_id.partition(":")
        if token == self.token and int(tag) in self.outstanding:
            self.takers[int(tag)] = pid

    def requeue_orphans(self, after_s: float) -> None:
        """Send again what a worker took and died with (SIGKILLed, out of memory, killed at its time
        limit: no acknowledgement can come for it), to arrive `after_s` after its death, once the
        leases its run held have expired and the redelivery can take the work over: a copy goes to
        the queue's waiting room (amqp.declare_later), confirmed, and then this delivery is
        acknowledged, which gives the pool its place back at once. Should the delivery be
        acknowledged after all (`ack`: its sentinel handed the result of a run that had ended in,
        or the task on to another worker), the copy is withdrawn: dropped when it comes."""
        now = time.monotonic()
        forget = now - after_s - COPY_MEMORY_S
        self.copied = {tag: copy for tag, copy in self.copied.items() if copy[1] > forget}
        self.withdrawn = {digest: when for digest, when in self.withdrawn.items() if when > forget}
        for tag, pid in list(self.takers.items()):
            if not _alive(pid):
                del self.takers[tag]
                body = self.bodies.pop(tag, None)
                if self.outstanding.pop(tag, None) is not None and body is not None:
                    amqp.Publisher.get().publish_later(self.queue, body, delay_s=after_s)
                    self.channel.basic_ack(tag)
                    self.copied[tag] = (hashlib.sha256(body).digest(), now)
                    logger.warning("worker died with a message; it goes again later",
                                   extra={"queue": self.queue, "retry_in_s": after_s})

    def reject(self, ack_id: str, reason: str) -> None:
        token, _, tag = ack_id.partition(":")
        if token == self.token and self.outstanding.pop(int(tag), None) is not None:
            self.bodies.pop(int(tag), None)
            close_old_connections()
            dead_letter_record(queue=self.queue, reason=reason, body=b"", message_id=f"delivery {ack_id}")
            self.channel.basic_nack(int(tag), requeue=False)

    def requeue_stale(self, older_than_s: float) -> None:
        """Give back what was handed out `older_than_s` ago and never acknowledged: its worker died
        (or its task outlived `retry`, which the system checks keep above `timeout`)."""
        now = time.monotonic()
        for tag, since in list(self.outstanding.items()):
            if now - since > older_than_s:
                del self.outstanding[tag]
                self.takers.pop(tag, None)
                self.bodies.pop(tag, None)
                self.channel.basic_nack(tag, requeue=True)
                logger.warning("unacknowledged message requeued", extra={"queue": self.queue})

    def drain(self, wait_s: float) -> None:
        """Stop consuming; wait for what was handed out to be acknowledged; close."""
        try:
            self.channel.basic_cancel(self.consumer_tag)
            for ack_id, _body in self.delivered:  # fetched, never handed to the pool
                self.channel.basic_nack(int(ack_id.partition(":")[2]), requeue=True)
            deadline = time.monotonic() + wait_s
            while self.outstanding and time.monotonic() < deadline:
                self.connection.process_data_events(time_limit=0.2)
        except (AMQPError, OSError):
            pass
        self.close()  # the server requeues whatever is left
