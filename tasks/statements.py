"""The three statements every Django task call pays for, kept whole in tasks/queries.sql (the ORM's
versions cost about twice the kernel's own job path): the call's insert, its claim and completion.
In the worker the claim and the completion go along with the run's admission and its settlement
(`claim_along`, `complete_along`: scheduling.db.send_along), in their round trip and commit; each
is one round trip of its own otherwise. Values go in as the ORM prepares them; a claimed row comes
back as the instance the ORM would load.
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
    """Store a new call; False when its account is missing or inactive (then stored without it)."""
    connection = connections[DEFAULT_DB_ALIAS]
    params = {f.column: f.get_db_prep_save(f.pre_save(call, True), connection) for f in _FIELDS}
    return db.fetch_one(QUERIES["insert"], params)["account_id"] == call.account_id


def _params(*, call_id, now, **params) -> dict:
    """A statement's parameters on the call `call_id` at `now`, as the ORM would prepare them."""
    connection = connections[DEFAULT_DB_ALIAS]
    return {**params, "now": connection.ops.adapt_datetimefield_value(now),
            "call_id": TaskCall._meta.pk.get_db_prep_value(call_id, connection)}


def claim(*, call_id, worker: str, run_id: int, now) -> TaskCall | None:
    """READY -> RUNNING for the run `run_id` on `worker`: the call as the claim left it; None when the
    call was not READY with an attempt left."""
    row = db.fetch_one(QUERIES["claim"], _params(call_id=call_id, now=now, run_id=run_id, worker=f"{worker}\n"))
    return None if row is None else _decode(row)


@dataclass(frozen=True)
class Prior:
    """What a claim changed on the call, as it was before it (`claim_along`'s `prior_*`)."""

    run_id: int | None
    started_at: dt.datetime | None
    last_attempted_at: dt.datetime | None


def claim_along(*, call_id, worker: str, run, then: Callable[[TaskCall | None, Prior | None], None]) -> object:
    """`claim`, sent along with the run's admission, which records `run` (tasks/queries.sql
    `claim_along`). `then(call, prior)` gets the call as the claim left it and what it changed as it
    was, or (None, None) when it claimed nothing (the admission recorded no run, or the call was not
    READY with an attempt left). Returns its place in the queue (scheduling.db.withdraw_along)."""
    connection = connections[DEFAULT_DB_ALIAS]

    def params() -> dict:  # when it is sent: the admission has set the run's start time by then
        return _params(call_id=call_id, now=timezone.now(), worker=f"{worker}\n", ref=run.ref, job=run.job,
                       run_worker=run.worker, run_started_at=connection.ops.adapt_datetimefield_value(run.started_at))

    def read(cursor) -> None:
        rows = db.named_rows(QUERIES["claim_along"], cursor)
        if not rows:
            return then(None, None)
        by_column = rows[0]
        prior = Prior(by_column["prior_run_id"], by_column["prior_started_at"], by_column["prior_last_attempted_at"])
        return then(_decode(by_column), prior)

    return db.send_along(QUERIES["claim_along"], params, then=read)


def _decode(row: dict) -> TaskCall:
    """A returned row (by column name) as the model instance the ORM would load (its converters: JSON)."""
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
    return db.fetch_one(QUERIES["complete"], _completion(call=call, run_id=run_id, value=value, now=now)) is not None


def complete_along(*, call: TaskCall, run_id: int, value, now, then: Callable[[bool], None]) -> None:
    """`complete`, sent along with the run's settlement; `then(completed)` gets its verdict once it
    is committed."""
    params = _completion(call=call, run_id=run_id, value=value, now=now)
    db.send_along(QUERIES["complete"], lambda: params, then=lambda cursor: then(cursor.fetchone() is not None))


def _completion(*, call: TaskCall, run_id: int, value, now) -> dict:
    stored = TaskCall._meta.get_field("return_value").get_db_prep_save(value, connections[DEFAULT_DB_ALIAS])
    return _params(call_id=call.pk, now=now, run_id=run_id, return_value=stored)
