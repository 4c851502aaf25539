"""The three statements every Django task call pays for, hand-written (bench/tasks_overhead.py
measured the ORM's versions at about twice the cost of the kernel's own job path): the call's
insert at enqueue, its claim and its completion in the worker, kept whole in tasks/queries.sql
(which says what each reads as the data grows). Each is one round trip, prepared once per
connection (scheduling.db.cursor). Values go in as the ORM would prepare them, and a claimed row
comes back as the model instance the ORM would load.
"""
import functools
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS, connections

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
    connection = connections[DEFAULT_DB_ALIAS]
    stored = TaskCall._meta.get_field("return_value").get_db_prep_save(value, connection)
    with db.cursor() as cursor:
        cursor.execute(QUERIES["complete"], {
            "return_value": stored, "now": connection.ops.adapt_datetimefield_value(now), "run_id": run_id,
            "call_id": TaskCall._meta.pk.get_db_prep_value(call.pk, connection)})
        return cursor.rowcount == 1
