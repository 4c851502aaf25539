"""The three statements every Django task call pays for, kept whole in tasks/queries.sql (the ORM's
versions cost about twice the kernel's own job path): the call's insert, its claim and completion.
Values go in as the ORM prepares them; a claimed row comes back as the instance the ORM would load.
"""
import functools
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS, connections

from scheduling import db
from tasks.models import TaskCall

QUERIES = db.load_queries(Path(__file__).with_name("queries.sql"))
_FIELDS = tuple(TaskCall._meta.concrete_fields)


def insert(call: TaskCall) -> bool:
    """Store a new call; False when its account is missing or inactive (then stored without it)."""
    connection = connections[DEFAULT_DB_ALIAS]
    params = {f.column: f.get_db_prep_save(f.pre_save(call, True), connection) for f in _FIELDS}
    return db.fetch_one(QUERIES["insert"], params)["account_id"] == call.account_id


def _run(name: str, *, call_id, now, **params) -> dict | None:
    """Run the statement `name` on the call `call_id` at `now`, as the ORM would prepare them."""
    connection = connections[DEFAULT_DB_ALIAS]
    return db.fetch_one(QUERIES[name], {**params, "now": connection.ops.adapt_datetimefield_value(now),
                                        "call_id": TaskCall._meta.pk.get_db_prep_value(call_id, connection)})


def claim(*, call_id, worker: str, run_id: int, now) -> TaskCall | None:
    """READY -> RUNNING for the run `run_id` on `worker`: the call as the claim left it, loaded as
    the ORM would (its converters: JSON); None when the call was not READY with an attempt left."""
    row = _run("claim", call_id=call_id, now=now, run_id=run_id, worker=f"{worker}\n")
    if row is None:
        return None
    compiler, converters = _converters(connections[DEFAULT_DB_ALIAS])
    values = [row[f.column] for f in _FIELDS]
    (values,) = compiler.apply_converters([values], converters) if converters else [values]
    return TaskCall.from_db(DEFAULT_DB_ALIAS, [f.attname for f in _FIELDS], list(values))


@functools.lru_cache(maxsize=8)
def _converters(connection):
    """The ORM's converters of a TaskCall row, made once per connection wrapper (thread)."""
    compiler = TaskCall.objects.all().query.get_compiler(connection=connection)
    return compiler, compiler.get_converters([f.get_col(TaskCall._meta.db_table) for f in _FIELDS])


def complete(*, call: TaskCall, run_id: int, value, now) -> bool:
    """RUNNING -> SUCCESSFUL, while the run `run_id` still holds the call."""
    stored = TaskCall._meta.get_field("return_value").get_db_prep_save(value, connections[DEFAULT_DB_ALIAS])
    return _run("complete", call_id=call.pk, now=now, run_id=run_id, return_value=stored) is not None
