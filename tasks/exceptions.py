"""What Fairshare's Tasks backend raises, and the errors it records for calls that did not run to
the end on their own. Recorded errors name their class by dotted path (`TaskError.exception_class`
imports it), so each lives here, importable."""
from tasks.compat import InvalidTask


class CallRefused(InvalidTask):
    """`enqueue()` refused a call; nothing was stored or sent. A subclass of the framework's
    InvalidTask, so code that catches that for any backend catches this too. `code` is stable:

    account_missing, account_invalid, account_unknown, account_inactive, account_not_allowed
    (a system task given an account), arguments_not_json, arguments_too_large.
    """

    def __init__(self, message: str, *, code: str):
        super().__init__(message)
        self.code = code


class ArgumentsNotJSON(CallRefused, TypeError):
    """`enqueue()` refused arguments JSON cannot hold (code `arguments_not_json`). Also a TypeError:
    the framework's own backends raise TypeError("Unsupported type ...") for such an argument, and
    portable code that catches that around `enqueue()` must catch Fairshare's refusal too."""

    def __init__(self, message: str):
        super().__init__(message, code="arguments_not_json")


class ResultTooLarge(ValueError):
    """A task returned a value whose JSON is larger than FAIRSHARE["TASKS_MAX_RESULT_BYTES"]."""


class WorkerLost(Exception):
    """Recorded, not raised: the worker running the call died (SIGKILL, the OOM killer, a lost
    host) and the reconciler found its run lost."""


class Cancelled(Exception):
    """Recorded, not raised: an operator cancelled the call before it ran."""


class NotATask(Exception):
    """Recorded: the call's task path no longer names a Task (the code changed since it was sent)."""


class OutOfAttempts(Exception):
    """Recorded: a message for the call arrived after it had used all its attempts."""
