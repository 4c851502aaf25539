"""Redaction of text before it is stored, logged or shown (SPEC §5: nothing sensitive at rest).

The one place that knows what a secret looks like. Exception messages from drivers and libraries
quote values freely: e-mail addresses, key values from constraint violations, connection strings
with passwords, AWS key ids, our own `fs_` API tokens. We keep the error class and the shape of
the message, and replace the values; a word that merely names a secret ("password
authentication failed") is kept, so the message still says what went wrong.

Used by the services that store errors (`describe_error`), by the logging filter on every
handler (`RedactingFilter`, config/settings.py) and by the admin of django-q2's own tables.
"""
import logging
import re

MAX_LENGTH = 1000

_SECRET_WORDS = r"password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|credentials?|" \
                r"authorization|signature|sig"
# A value written after a secret's name with only a space between ("password hunter2") is taken
# for the secret only when it looks like one: a digit or a symbol in it, or long. A plain word
# ("password authentication failed", "token expired") is the message, not the secret.
_CREDENTIAL_LIKE = r"(?=\S*[\d_/+=.~!$%^&*-])\S{4,}|\S{24,}"

_NAMES_A_SECRET = f"(?i:{_SECRET_WORDS})"  # the `needs` (below) of the patterns that find a value by its name

_DOTTED_PATH = re.compile(r"'[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+'")

# Each pattern with what every one of its matches contains (a regex, the `needs` column): a text
# with none of them cannot match any pattern and is returned as it is, at the cost of one search
# instead of a substitution per pattern - most log lines (a job name, an outcome) are such texts.
# tests/scheduling/test_redaction.py checks that every match of a pattern contains what it needs.
_PATTERNS = [
    # scheme://user:password@host -> scheme://***@host
    # (Bounded scheme length: unbounded, a long run of letters made this quadratic.)
    (re.compile(r"([a-z][a-z0-9+.-]{0,40}://)[^\s/@]+@", re.I), r"\1***@", "@"),
    # Authorization: Bearer … / Basic … - the scheme word is consumed with the value: replacing
    # only "Bearer" would leave the credential behind.
    # (A value with no digit or symbol is a word: "basic authentication failed" keeps its meaning.)
    (re.compile(r"\b(Bearer|Basic|Digest)\s+(?=[A-Za-z0-9._~+/=-]*[\d+/=._-])[A-Za-z0-9._~+/=-]{6,}", re.I),
     r"\1 ***", "(?i:bearer|basic|digest)"),
    # password=..., "token": "...", secret: ..., api_key=..., also inside a longer name when
    # assigned: access_token=…, DB_PASSWORD=…, client_secret: …, aws_secret_access_key=…
    (re.compile(rf"\b([\w-]{{0,40}}?(?:{_SECRET_WORDS})[\w-]{{0,40}}[\"']?)(\s*[=:]\s*)[\"']?"
                r"(?:(?:Bearer|Basic|Token|Digest)\s+)?[^\s\"',;&)]+[\"']?", re.I), r"\1\2***",
     _NAMES_A_SECRET),
    # password hunter2 (no = or :): only a credential-like value, see _CREDENTIAL_LIKE.
    (re.compile(rf"\b({_SECRET_WORDS})(\s+)(?:{_CREDENTIAL_LIKE})", re.I), r"\1\2***", _NAMES_A_SECRET),
    # AWS access key ids (long-term AKIA…, temporary ASIA…, and the other IAM id kinds).
    (re.compile(r"\b(AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{12,}\b"), r"\1***",
     "AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|ABIA|ACCA"),
    # Fairshare API tokens (budgets.models.ApiToken.PREFIX), wherever they appear.
    (re.compile(r"\bfs_[A-Za-z0-9_-]{6,}"), "fs_***", "fs_"),
    # Signed download links (exports/urls.py "file"): a path that is itself a credential.
    (re.compile(r"(/exports/file/)[^\s/?\"']+"), r"\1***", "/exports/file/"),
    # PostgreSQL constraint details: Key (email)=(a@b.c) -> Key (email)=(***)
    (re.compile(r"\)=\((.*?)\)(?=[ .,;]|$)"), ")=(***)", r"\)=\("),
    # Check and not-null violations quote the whole row: DETAIL:  Failing row contains (…).
    (re.compile(r"(Failing row contains )\(.*\)"), r"\1(***)", "Failing row contains "),
    # A rejected value ends the line in double quotes: invalid input syntax for type integer: "…"
    # (mid-sentence double quotes are identifiers - relation, constraint - and are kept).
    (re.compile(r'(:\s*)"[^"\n]*"(?=\s*(?:\n|$))'), r'\1"***"', '"'),
    # (A local part has at most 64 characters; unbounded, a long digit run made this quadratic.)
    (re.compile(r"[\w.+-]{1,64}@[\w-]+(\.[\w-]+)+"), "***@***", "@"),
    # Quoted literals can be customer values (not a quoted dotted Python path: 'scheduling.runtime.execute').
    (re.compile(r"'[^'\n]{1,500}'"), lambda m: m[0] if _DOTTED_PATH.fullmatch(m[0]) else "'***'", "'"),
    # Long digit runs: card numbers, phone numbers, account numbers.
    # (Not a segment of a UUID - an export id - that happens to be all digits.)
    (re.compile(r"\b(?<![0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-)\d{7,}\b"
                r"(?!-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b)", re.I), "***", r"\d{7}"),
    # Card numbers written in groups: 4111 1111 1111 1111, 3782-822463-10005.
    (re.compile(r"\b\d{4}(?:[ -]\d{4}){3}\b|\b\d{4}[ -]\d{6}[ -]\d{5}\b"), "***", r"\d{4}"),
]
_MAY_HOLD_A_SECRET = re.compile("|".join(dict.fromkeys(needs for _, _, needs in _PATTERNS)))


# Only this many times `max_length` of a message is redacted: a huge message (a dump in an
# exception) must not stall the worker that records it. Cut at whitespace, so no half secret
# escapes its pattern.
INPUT_FACTOR = 4


def redact(text: str, *, max_length: int = MAX_LENGTH) -> str:
    """`text` without its sensitive values, at most `max_length` characters (cut ones end in …)."""
    text = str(text)
    truncated = len(text) > INPUT_FACTOR * max_length
    if truncated:
        head = text[: INPUT_FACTOR * max_length]
        cut = max(head.rfind(" "), head.rfind("\n"))
        text = head[:cut] if cut > 0 else head
    if _MAY_HOLD_A_SECRET.search(text):
        for pattern, replacement, _needs in _PATTERNS:
            text = pattern.sub(replacement, text)
    if truncated or len(text) > max_length:
        text = text[: max_length - 1] + "…"
    return text


def describe_error(exc: BaseException) -> tuple[str, str]:
    """(error class, redacted message) — what we store about a failure, never the traceback."""
    cls = type(exc)
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return name[:200], redact(str(exc) or name)


# A log line may carry a traceback: allow more of it than a stored error message.
LOG_MAX_LENGTH = 8 * MAX_LENGTH


class RedactingFilter(logging.Filter):
    """On every handler (text and JSON): the message, its arguments, string `extra` values and
    the formatted traceback pass through `redact` before any formatter sees them."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage(), max_length=LOG_MAX_LENGTH)
        record.args = None
        for key, value in list(vars(record).items()):
            if key not in _RECORD_FIELDS and isinstance(value, str):
                setattr(record, key, redact(value, max_length=LOG_MAX_LENGTH))
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, max_length=LOG_MAX_LENGTH)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, max_length=LOG_MAX_LENGTH)
        return True


_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
