"""The three statements every Django task call pays for, hand-written (bench/tasks_overhead.py
measured the ORM's versions at about twice the cost of the kernel's own job path): the call's
insert at enqueue, its claim and its completion in the worker, kept whole in tasks/queries.sql
(which says what each reads as the data grows), prepared once per connection (scheduling.db.cursor).
In the worker the claim and the completion cost no round trip or commit of their own when they
can go along with the run's admission and its settlement (`claim_along`, `complete_along`:
scheduling.db.send_along); each is one round trip of its own otherwise. Values go in as the ORM
would prepare them, and a claimed row comes back as the model instance the ORM would load.
"""
import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

from scheduling import db
from tasks.models import TaskCall

QUERIES = db.load_queries(Path(__file__).with_name("queries.sql"))
_FIELDS = tuple(TaskCall._meta.concrete_fields)


def insert(call: TaskCall) -> bool:
    """Store a new call; False when its account is missing or inactive, in which case the row went
    in without it: the caller undoes it (tasks.services.call_enqueue)."""
    connection = connections[DEFAULT_DB_ALIAS]
    params = {f.column: f.get_db_prep_save(f.pre_save(call, True), connection) for f in _FIELDS}
    with db.cursor() as cursor:
        cursor.execute(QUERIES["insert"], params)
        (account_id,) = cursor.fetchone()
    return account_id == call.account_id


def claim(*, call_id, worker: str, run_id: int, now) -> TaskCall | None:
    """READY -> RUNNING for the run `run_id` on `worker` (tasks/queries.sql `claim`): the call as the
    claim left it; None when the call was not READY with an attempt left."""
    connection = connections[DEFAULT_DB_ALIAS]
    with db.cursor() as cursor:
        cursor.execute(QUERIES["claim"], {
            "run_id": run_id, "worker": f"{worker}\n", "now": connection.ops.adapt_datetimefield_value(now),
            "call_id": TaskCall._meta.pk.get_db_prep_value(call_id, connection)})
        row = cursor.fetchone()
        return None if row is None else _decode(row, [column.name for column in cursor.description])


@dataclass(frozen=True)
class Prior:
    """What a claim changed on the call, as it was before it (`claim_along`'s `prior_*`)."""

    run_id: int | None
    started_at: dt.datetime | None
    last_attempted_at: dt.datetime | None


def claim_along(*, call_id, worker: str, run, then: Callable[[TaskCall | None, Prior | None], None]) -> object:
    """`claim`, sent along with the next of Fairshare's statements on this connection: the run's
    admission, which records `run` (tasks/queries.sql `claim_along`). `then(call, prior)` gets the
    call as the claim left it and what it changed as it was, or (None, None) when it claimed nothing
    (the admission recorded no run, or the call was not READY with an attempt left). Returns its
    place in the queue (scheduling.db.withdraw_along)."""
    connection = connections[DEFAULT_DB_ALIAS]
    call_key = TaskCall._meta.pk.get_db_prep_value(call_id, connection)

    def params() -> dict:  # when it is sent: the admission has set the run's start time by then
        now = connection.ops.adapt_datetimefield_value(timezone.now())
        return {"call_id": call_key, "worker": f"{worker}\n", "now": now, "ref": run.ref, "job": run.job,
                "run_worker": run.worker, "run_started_at": connection.ops.adapt_datetimefield_value(run.started_at)}

    def read(cursor) -> None:
        row = cursor.fetchone()
        if row is None:
            return then(None, None)
        columns = [column.name for column in cursor.description]
        by_column = dict(zip(columns, row))
        prior = Prior(by_column["prior_run_id"], by_column["prior_started_at"], by_column["prior_last_attempted_at"])
        return then(_decode(row, columns), prior)

    return db.send_along(QUERIES["claim_along"], params, then=read)


def _decode(row, columns: list[str]) -> TaskCall:
    """A returned row (its columns by name) as the model instance the ORM would load (the same
    converters: JSON)."""
    by_column = dict(zip(columns, row))
    compiler, converters = _converters(connections[DEFAULT_DB_ALIAS])
    values = [by_column[f.column] for f in _FIELDS]
    (values,) = compiler.apply_converters([values], converters) if converters else [values]
    return TaskCall.from_db(DEFAULT_DB_ALIAS, [f.attname for f in _FIELDS], list(values))


@functools.lru_cache(maxsize=8)
def _converters(connection):
    """The ORM's converters of a TaskCall row, made once per connection wrapper (thread)."""
    compiler = TaskCall.objects.all().query.get_compiler(connection=connection)
    return compiler, compiler.get_converters([f.get_col(TaskCall._meta.db_table) for f in _FIELDS])


def complete(*, call: TaskCall, run_id: int, value, now) -> bool:
    """RUNNING -> SUCCESSFUL, while the run `run_id` still holds the call."""
    with db.cursor() as cursor:
        cursor.execute(QUERIES["complete"], _completion(call=call, run_id=run_id, value=value, now=now))
        return cursor.rowcount == 1


def complete_along(*, call: TaskCall, run_id: int, value, now, then: Callable[[bool], None]) -> None:
    """`complete`, sent along with the next of Fairshare's statements on this connection (the
    run's settlement); `then(completed)` gets its verdict once it is committed."""
    params = _completion(call=call, run_id=run_id, value=value, now=now)
    db.send_along(QUERIES["complete"], lambda: params, then=lambda cursor: then(cursor.rowcount == 1))


def _completion(*, call: TaskCall, run_id: int, value, now) -> dict:
    connection = connections[DEFAULT_DB_ALIAS]
    return {"return_value": TaskCall._meta.get_field("return_value").get_db_prep_save(value, connection),
            "now": connection.ops.adapt_datetimefield_value(now), "run_id": run_id,
            "call_id": TaskCall._meta.pk.get_db_prep_value(call.pk, connection)}
