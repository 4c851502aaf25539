"""The three statements every Django task call pays for, hand-written (bench/tasks_overhead.py
measured the ORM's versions at about twice the cost of the kernel's own job path): the call's
insert at enqueue, its claim and its completion in the worker. Each is one round trip, prepared
once per connection (scheduling.db.cursor): a scalar sub-select in VALUES, INSERT and UPDATE ...
RETURNING, `||`.

What each reads as the data grows: one row of budgets_account by its primary key (the insert's
check that the account is there and active); one row of tasks_taskcall by its primary key (claim,
completion). Neither grows with the number of calls kept, waiting or running
(tests/tasks/test_statements.py EXPLAINs them on a large table).
"""
import functools

from django.db import DEFAULT_DB_ALIAS, connections

from budgets.models import Account
from scheduling import db
from tasks.compat import TaskResultStatus as Status
from tasks.models import TaskCall

_TABLE = TaskCall._meta.db_table
_FIELDS = tuple(TaskCall._meta.concrete_fields)


def _column(name: str) -> str:
    return connections[DEFAULT_DB_ALIAS].ops.quote_name(TaskCall._meta.get_field(name).column)


@functools.cache
def _insert(scoped: bool) -> str:
    """The insert. Scoped: the account is written only if it exists and is active (a scalar
    sub-select by its id, NULL otherwise), and RETURNING says which, so the check costs no round
    trip of its own; the parameters stay in VALUES, where both databases type them by column."""
    columns = ", ".join(_column(f.name) for f in _FIELDS)
    account = Account._meta
    active = f"(SELECT a.{account.pk.column} FROM {account.db_table} a WHERE a.{account.pk.column} = %s AND a.is_active)"
    values = ", ".join(active if scoped and f.name == "account" else "%s" for f in _FIELDS)
    return f"INSERT INTO {_TABLE} ({columns}) VALUES ({values}) RETURNING {_column('account')}"


def insert(call: TaskCall) -> bool:
    """Store a new call; False when its account is missing or inactive, in which case the row went
    in without it: the caller undoes it (tasks.services.call_enqueue)."""
    connection = connections[DEFAULT_DB_ALIAS]
    params = [f.get_db_prep_save(f.pre_save(call, True), connection) for f in _FIELDS]
    with db.cursor() as cursor:
        cursor.execute(_insert(call.account_id is not None), params)
        (account_id,) = cursor.fetchone()
    return account_id == call.account_id


@functools.cache
def _claim() -> str:
    returned = ", ".join(_column(f.name) for f in _FIELDS)
    return f"""
UPDATE {_TABLE}
   SET status = %s, run_id = %s, workers = workers || %s, attempt_count = attempt_count + 1,
       started_at = COALESCE(started_at, %s), last_attempted_at = %s
 WHERE id = %s AND status = %s AND attempt_count < attempt_limit
RETURNING {returned}"""


def claim(*, call_id, worker: str, run_id: int, now) -> TaskCall | None:
    """READY -> RUNNING for the run `run_id` on `worker`, in one statement that returns the call
    as the claim left it; None when the call was not READY with an attempt left. Two deliveries
    of one message: the row lock of the UPDATE makes the second find the call RUNNING."""
    connection = connections[DEFAULT_DB_ALIAS]
    when = connection.ops.adapt_datetimefield_value(now)
    pk = TaskCall._meta.pk.get_db_prep_value(call_id, connection)
    with db.cursor() as cursor:
        cursor.execute(_claim(), [Status.RUNNING, run_id, f"{worker}\n", when, when, pk, Status.READY])
        row = cursor.fetchone()
    return None if row is None else _decode(row)


def _decode(row) -> TaskCall:
    """A returned row as the model instance the ORM would load (the same converters: JSON)."""
    compiler, converters = _converters(connections[DEFAULT_DB_ALIAS])
    (values,) = compiler.apply_converters([list(row)], converters) if converters else [row]
    return TaskCall.from_db(DEFAULT_DB_ALIAS, _ATTNAMES, list(values))


_ATTNAMES = [f.attname for f in _FIELDS]


@functools.lru_cache(maxsize=8)
def _converters(connection):
    """The ORM's converters of a TaskCall row, made once per connection wrapper (thread)."""
    compiler = TaskCall.objects.all().query.get_compiler(connection=connection)
    return compiler, compiler.get_converters([f.get_col(_TABLE) for f in _FIELDS])


@functools.cache
def _complete() -> str:
    return (f"UPDATE {_TABLE} SET status = %s, return_value = %s, finished_at = %s "
            "WHERE id = %s AND status = %s AND run_id = %s")


def complete(*, call: TaskCall, run_id: int, value, now) -> bool:
    """RUNNING -> SUCCESSFUL, while the run `run_id` still holds the call."""
    connection = connections[DEFAULT_DB_ALIAS]
    stored = TaskCall._meta.get_field("return_value").get_db_prep_save(value, connection)
    with db.cursor() as cursor:
        cursor.execute(_complete(), [Status.SUCCESSFUL, stored, connection.ops.adapt_datetimefield_value(now),
                                     TaskCall._meta.pk.get_db_prep_value(call.pk, connection), Status.RUNNING,
                                     run_id])
        return cursor.rowcount == 1
