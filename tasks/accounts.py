"""How a Django task call names its account.

The call says it with a keyword argument, `account` unless the backend's OPTIONS["ACCOUNT_KWARG"]
names another: `send_invoice.enqueue(invoice.pk, account=acme)`, an Account or its id. Fairshare
takes that keyword for itself: the call is that account's work (its budget, its cap, its place in
the fair share). A function that has a parameter of the same name receives the account's id in
it; any other function does not see it.

Checked at enqueue, before anything is stored or sent: an unknown or inactive account, a value
that is neither an Account nor an id, or no account at all is refused (`CallRefused`). Tasks that
belong to no account are listed by module path in OPTIONS["SYSTEM_TASKS"]: they run as system
work (no budget, no cap), and passing an account to one is refused too, since it would be ignored.
"""
import functools
import inspect

from budgets.models import Account
from tasks.exceptions import CallRefused


def account_of_call(*, task, kwargs: dict, name: str, system: bool) -> int | None:
    """The account id a call is for (None: system work), taken out of `kwargs`; whether that
    account exists and is active is checked as the call is stored (`refused` says why not)."""
    if system:
        if name in kwargs:
            raise CallRefused(f"{task.module_path} is a system task (OPTIONS['SYSTEM_TASKS']) and runs for no "
                              f"account: call it without {name}=", code="account_not_allowed")
        return None
    if name not in kwargs:
        raise CallRefused(f"say which account this call is for: {task.name}.enqueue(..., {name}=<an Account or "
                          "its id>); a task that belongs to no account is listed in OPTIONS['SYSTEM_TASKS']",
                          code="account_missing")
    value = kwargs.pop(name)
    if isinstance(value, Account):
        return value.pk
    if type(value) is int:  # not bool, not a numeric string: an id is an int
        return value
    raise CallRefused(f"{name}= must be an Account or its id (an int), not {type(value).__name__}",
                      code="account_invalid")


def refused(account_id: int) -> CallRefused:
    """Why the call's account may not have work: unknown or inactive. (Whether it may is asked by
    the call's own insert, tasks/statements.py: no round trip of its own.)"""
    if Account.objects.filter(pk=account_id).exists():
        return CallRefused(f"the account {account_id} is inactive: its work is not accepted", code="account_inactive")
    return CallRefused(f"no account has the id {account_id}", code="account_unknown")


@functools.cache
def takes_account(func, name: str) -> bool:
    """Whether `func` has a parameter called `name` that a keyword can fill."""
    try:
        parameter = inspect.signature(func).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def call_kwargs(*, func, kwargs: dict, account_id: int | None, name: str) -> dict:
    """The keyword arguments the function receives: the stored ones, and the account's id when the
    function asks for it by name."""
    if account_id is not None and takes_account(func, name):
        return {**kwargs, name: account_id}
    return kwargs
