"""Redaction of error text before it is stored or logged (SPEC §5: nothing sensitive at rest).

Exception messages from drivers and libraries quote values freely: e-mail addresses, key values
from constraint violations, connection strings with passwords, tokens. We keep the error class
and the shape of the message, and replace the values.
"""
import re

MAX_LENGTH = 1000

_PATTERNS = [
    # scheme://user:password@host -> scheme://***@host
    # (Bounded scheme length: unbounded, a long run of letters made this quadratic.)
    (re.compile(r"([a-z][a-z0-9+.-]{0,40}://)[^\s/@]+@", re.I), r"\1***@"),
    # password=..., token: ..., secret ..., api_key=..., Authorization: Bearer ... (the scheme word
    # is consumed with the value: replacing only "Bearer" would leave the credential behind).
    (re.compile(r"\b(password|passwd|pwd|secret|token|api[_-]?key|authorization|signature|sig)\b(\s*[=:]\s*|\s+)"
                r"(?:(?:Bearer|Basic|Token|Digest)\s+)?\S+", re.I), r"\1\2***"),
    # The same inside a longer name, when assigned: access_token=…, DB_PASSWORD=…, client_secret: …
    (re.compile(r"\b([\w-]{0,40}?(?:password|passwd|secret|token|api[_-]?key|signature)[\w-]{0,40})(\s*[=:]\s*)\S+",
                re.I), r"\1\2***"),
    (re.compile(r"\bBearer\s+\S+", re.I), "Bearer ***"),
    # PostgreSQL constraint details: Key (email)=(a@b.c) -> Key (email)=(***)
    (re.compile(r"\)=\((.*?)\)(?=[ .,;]|$)"), ")=(***)"),
    # Check and not-null violations quote the whole row: DETAIL:  Failing row contains (…).
    (re.compile(r"(Failing row contains )\(.*\)"), r"\1(***)"),
    # A rejected value ends the line in double quotes: invalid input syntax for type integer: "…"
    # (mid-sentence double quotes are identifiers - relation, constraint - and are kept).
    (re.compile(r'(:\s*)"[^"\n]*"(?=\s*(?:\n|$))'), r'\1"***"'),
    # (A local part has at most 64 characters; unbounded, a long digit run made this quadratic.)
    (re.compile(r"[\w.+-]{1,64}@[\w-]+(\.[\w-]+)+"), "***@***"),
    # Quoted literals can be customer values.
    (re.compile(r"'[^'\n]{1,500}'"), "'***'"),
    # Long digit runs: card numbers, phone numbers, account numbers.
    # (Not a segment of a UUID - an export id - that happens to be all digits.)
    (re.compile(r"\b(?<![0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-)\d{7,}\b"
                r"(?!-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b)", re.I), "***"),
    # Card numbers written in groups: 4111 1111 1111 1111, 3782-822463-10005.
    (re.compile(r"\b\d{4}(?:[ -]\d{4}){3}\b|\b\d{4}[ -]\d{6}[ -]\d{5}\b"), "***"),
]


# Only this much of a message is redacted and kept: a huge message (a dump in an exception) must
# not stall the worker that records it. Cut at whitespace, so no half secret escapes its pattern.
MAX_INPUT_LENGTH = 4 * MAX_LENGTH


def redact(text: str) -> str:
    truncated = len(text) > MAX_INPUT_LENGTH
    if truncated:
        head = text[:MAX_INPUT_LENGTH]
        cut = max(head.rfind(" "), head.rfind("\n"))
        text = head[:cut] if cut > 0 else head
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    if truncated or len(text) > MAX_LENGTH:
        text = text[: MAX_LENGTH - 1] + "…"
    return text


def describe_error(exc: BaseException) -> tuple[str, str]:
    """(error class, redacted message) — what we store about a failure, never the traceback."""
    cls = type(exc)
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return name[:200], redact(str(exc) or name)
