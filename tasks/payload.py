"""What a Django task call stores besides identifiers: its arguments and its return value as JSON
of bounded size (FAIRSHARE["TASKS_MAX_ARGS_BYTES"], ["TASKS_MAX_RESULT_BYTES"]), and each failure
as the framework's TaskError fields, its traceback redacted (scheduling.redaction) before it is
stored: a traceback quotes values (a customer's e-mail address, a connection string) as freely as
an exception message does.
"""
import json
import re
import traceback

from django.conf import settings

from scheduling.redaction import LOG_MAX_LENGTH, redact
from tasks.compat import normalize_json
from tasks.exceptions import ArgumentsNotJSON, CallRefused, ResultTooLarge

# A stored traceback keeps its last this many characters: the end names the exception.
TRACEBACK_MAX_LENGTH = LOG_MAX_LENGTH


def _json_size(value) -> int:
    """Bytes of `value` as JSON; ValueError for what JSON cannot hold (NaN, infinities)."""
    return len(json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode())


def arguments(args, kwargs) -> dict:
    """The call's arguments as they are stored (and as the function receives them: tuples become
    lists, as in the framework's own TaskResult); CallRefused when they cannot be stored (ArgumentsNotJSON,
    also a TypeError, for what JSON cannot hold)."""
    try:
        value = {"args": normalize_json(list(args)), "kwargs": normalize_json(dict(kwargs))}
        size = _json_size(value)
    except (TypeError, ValueError) as exc:
        raise ArgumentsNotJSON(f"the arguments of the task cannot be stored as JSON ({_unquoted(exc)}); pass ids, "
                               "strings, numbers, lists and dicts") from None
    limit = settings.FAIRSHARE["TASKS_MAX_ARGS_BYTES"]
    if size > limit:
        raise CallRefused(f"the arguments of the task are {size:,} bytes as JSON, more than the {limit:,} allowed "
                          "(FAIRSHARE_TASKS_MAX_ARGS_BYTES); pass an id and load the data in the task",
                          code="arguments_too_large")
    return value


def return_value(value):
    """The return value as it is stored; TypeError or ValueError when JSON cannot hold it,
    ResultTooLarge past the limit. Raised inside the run, so the call fails with it."""
    try:
        value = normalize_json(value)
        size = _json_size(value)
    except (TypeError, ValueError) as exc:
        # Said without quotes: the stored traceback is redacted, and redaction blanks quoted text.
        raise type(exc)(f"the return value of the task is not JSON serializable ({_unquoted(exc)})") from None
    limit = settings.FAIRSHARE["TASKS_MAX_RESULT_BYTES"]
    if size > limit:
        raise ResultTooLarge(f"the return value of the task is {size:,} bytes as JSON, more than the {limit:,} "
                             "allowed (FAIRSHARE_TASKS_MAX_RESULT_BYTES); store it and return its id")
    return value


def _unquoted(exc: Exception) -> str:
    """normalize_json's "Unsupported type: <class 'function'>" as "Unsupported type: function"."""
    return re.sub(r"<class '([\w.]+)'>", r"\1", str(exc))


def task_error(exc: BaseException) -> dict:
    """A failure as stored: the exception's class path (what TaskError.exception_class imports)
    and its redacted traceback, the end kept when it is long."""
    cls = type(exc)
    return {"exception_class_path": f"{cls.__module__}.{cls.__qualname__}",
            "traceback": redacted_traceback("".join(traceback.format_exception(exc)))}


def recorded_error(cls: type[BaseException], message: str) -> dict:
    """An error Fairshare records for a call itself (worker lost, cancelled): no traceback to tell,
    so the traceback is the exception line, as Python would print it."""
    return {"exception_class_path": f"{cls.__module__}.{cls.__qualname__}",
            "traceback": redacted_traceback(f"{cls.__module__}.{cls.__qualname__}: {message}\n")}


def redacted_traceback(text: str) -> str:
    if len(text) > TRACEBACK_MAX_LENGTH:
        start = text.find("\n", len(text) - TRACEBACK_MAX_LENGTH)
        text = "…\n" + text[start + 1:] if start != -1 else "…" + text[-TRACEBACK_MAX_LENGTH:]
    # Room to spare: redaction must not cut the end it was given.
    return redact(text, max_length=2 * TRACEBACK_MAX_LENGTH)
