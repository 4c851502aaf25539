"""The door for other services: a message on RabbitMQ becomes one Django task call of its account
(docs/door.md has the contract and a producer in plain pika).

    exchange  FAIRSHARE["RABBITMQ_PREFIX"] + ".door"  (direct, durable), routing key "task"
    queue     FAIRSHARE["RABBITMQ_PREFIX"] + ".door"  (durable, quorum where the server has them)
    dead      FAIRSHARE["RABBITMQ_PREFIX"] + ".door.dead"

    {"message_id": "billing-4711", "account": "acme", "task": "billing.tasks.send_invoice",
     "args": [4711], "kwargs": {"reminder": false}}

`message_id` (1 to 100 characters, unique per producer's intent) is the idempotency key: a message
delivered again (its consumer died before acknowledging it) finds the call the first delivery
recorded and creates nothing. `account` is the account's slug; `task` a module path listed in
FAIRSHARE["DOOR_TASKS"]; `args` (a list) and `kwargs` (an object) are optional. The call goes
through the ordinary enqueue (`Task.enqueue`, tasks/backend.py): budgets, caps, weights, rate limits
and the holding area apply as to any call of that account.

A message that is not the contract (not JSON, a field missing or of the wrong type, an unknown
account or task, arguments or a body over the limits) is refused (`Refused`): the consumer records
its reason (scheduling.dead_letters, shown in the admin and counted in /metrics) and rejects it to
the dead-letter queue. Nothing is dropped.
"""
import inspect
import json
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils.module_loading import import_string

from budgets.models import Account
from scheduling import amqp
from tasks.accounts import takes_account
from tasks.compat import Task
from tasks.exceptions import CallRefused
from tasks.models import DoorMessage

ROUTING_KEY = "task"
ACCOUNT_KWARG = "account"  # the TASKS backend's OPTIONS["ACCOUNT_KWARG"] (config/settings.py)
MESSAGE_ID_MAX = 100
FIELDS = {"message_id": str, "account": str, "task": str, "args": list, "kwargs": dict}
REQUIRED = ("message_id", "account", "task")


class Refused(Exception):
    """A message that is not the contract: `reason` says why, for an operator."""

    def __init__(self, reason: str, *, account_id: int | None = None, message_id: str | None = None):
        super().__init__(reason)
        self.reason, self.account_id, self.message_id = reason, account_id, message_id


@dataclass(frozen=True)
class DoorCall:
    message_id: str
    account_id: int
    task: Task
    args: list
    kwargs: dict


def exchange_name() -> str:
    return amqp.queue_name("door")


def declare(channel, connection) -> str:
    """The door's exchange, queue (with its dead-letter queue) and their binding; returns the queue."""
    queue = amqp.queue_name("door")
    channel.exchange_declare(exchange_name(), exchange_type="direct", durable=True)
    amqp.declare(channel, connection, queue)
    channel.queue_bind(queue, exchange_name(), routing_key=ROUTING_KEY)
    return queue


def parse(body: bytes) -> DoorCall:
    """The call a message asks for, or Refused."""
    limit = settings.FAIRSHARE["DOOR_MAX_BYTES"]
    if len(body) > limit:
        raise Refused(f"the body is {len(body):,} bytes, more than the {limit:,} allowed (FAIRSHARE_DOOR_MAX_BYTES)")
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise Refused("the body is not JSON (UTF-8)") from None
    if not isinstance(message, dict):
        raise Refused(f"the body must be a JSON object, got {type(message).__name__}")
    if missing := [name for name in REQUIRED if name not in message]:
        raise Refused(f"missing field(s): {', '.join(missing)} (contract: {', '.join(FIELDS)})")
    if unexpected := sorted(set(map(str, message)) - set(FIELDS)):
        raise Refused(f"{len(unexpected)} unexpected field(s) {unexpected} (contract: {', '.join(FIELDS)})")
    for name, kind in FIELDS.items():
        if name in message and not isinstance(message[name], kind):
            raise Refused(f"field {name} must be a JSON {_json_kind(kind)}, got {_json_kind(type(message[name]))}")
    message_id = message["message_id"]
    if ACCOUNT_KWARG in message.get("kwargs", {}):
        raise Refused(f"kwargs may not have {ACCOUNT_KWARG}: field account names the account", message_id=message_id)
    if not 0 < len(message_id) <= MESSAGE_ID_MAX:
        raise Refused(f"field message_id must have 1 to {MESSAGE_ID_MAX} characters")
    account_id = Account.objects.filter(slug=message["account"], is_active=True).values_list("pk", flat=True).first()
    if account_id is None:
        raise Refused("no active account has the slug given in field account", message_id=message_id)
    if message["task"] not in settings.FAIRSHARE["DOOR_TASKS"]:
        raise Refused("field task names no task the door accepts (FAIRSHARE_DOOR_TASKS)",
                      account_id=account_id, message_id=message_id)
    try:
        task = import_string(message["task"])
    except ImportError:
        raise Refused("field task names a task listed in FAIRSHARE_DOOR_TASKS that cannot be imported",
                      account_id=account_id, message_id=message_id) from None
    return DoorCall(message_id=message_id, account_id=account_id, task=task,
                    args=message.get("args", []), kwargs=message.get("kwargs", {}))


def _json_kind(kind: type) -> str:
    return {str: "string", list: "array", dict: "object", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(kind, kind.__name__)


def accept(call: DoorCall) -> tuple[str, bool]:
    """Enqueue the call once per message id: (the call's id, whether this delivery created it).
    The call's row and the message id commit together; the call is sent once they have."""
    try:
        with transaction.atomic():
            known = DoorMessage.objects.filter(message_id=call.message_id).values_list("call_id", flat=True).first()
            if known is not None:
                return str(known), False
            own = {ACCOUNT_KWARG: call.account_id} if takes_account(call.task.func, ACCOUNT_KWARG) else {}
            try:
                # A wrong arity or keyword would fail every attempt at run time: refused here instead.
                inspect.signature(call.task.func).bind(*call.args, **call.kwargs, **own)
            except TypeError as exc:
                raise Refused(f"the arguments do not fit the task: {exc}", account_id=call.account_id,
                              message_id=call.message_id) from None
            try:
                result = call.task.enqueue(*call.args, account=call.account_id, **call.kwargs)
            except CallRefused as exc:
                raise Refused(str(exc), account_id=call.account_id, message_id=call.message_id) from None
            # Two deliveries of one id at once (a redelivery while the first consumer still works on
            # it): the message id's unique index makes the second wait for the first, then fail here.
            DoorMessage.objects.create(message_id=call.message_id, call_id=result.id, account_id=call.account_id)
            return str(result.id), True
    except IntegrityError:  # the same id recorded meanwhile by another delivery: its call stands
        known = DoorMessage.objects.filter(message_id=call.message_id).values_list("call_id", flat=True).first()
        return str(known), False
