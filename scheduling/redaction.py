"""Redaction of error text before it is stored or logged (SPEC §5: nothing sensitive at rest).

Exception messages from drivers and libraries quote values freely: e-mail addresses, key values
from constraint violations, connection strings with passwords, tokens. We keep the error class
and the shape of the message, and replace the values.
"""
import re

MAX_LENGTH = 1000

_PATTERNS = [
    # scheme://user:password@host -> scheme://***@host
    (re.compile(r"([a-z][a-z0-9+.-]*://)[^\s/@]+@", re.I), r"\1***@"),
    # password=..., token: ..., secret ..., api_key=...
    (re.compile(r"\b(password|passwd|pwd|secret|token|api[_-]?key|authorization|signature|sig)\b(\s*[=:]\s*|\s+)\S+", re.I), r"\1\2***"),
    (re.compile(r"\bBearer\s+\S+", re.I), "Bearer ***"),
    # PostgreSQL constraint details: Key (email)=(a@b.c) -> Key (email)=(***)
    (re.compile(r"\)=\((.*?)\)(?=[ .,;]|$)"), ")=(***)"),
    (re.compile(r"[\w.+-]+@[\w-]+(\.[\w-]+)+"), "***@***"),
    # Quoted literals can be customer values.
    (re.compile(r"'[^'\n]{1,500}'"), "'***'"),
    # Long digit runs: card numbers, phone numbers, account numbers.
    (re.compile(r"\b\d{7,}\b"), "***"),
]


def redact(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    if len(text) > MAX_LENGTH:
        text = text[: MAX_LENGTH - 1] + "…"
    return text


def describe_error(exc: BaseException) -> tuple[str, str]:
    """(error class, redacted message) — what we store about a failure, never the traceback."""
    cls = type(exc)
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return name[:200], redact(str(exc) or name)
