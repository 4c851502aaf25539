"""What an operator may see of a failure: the error's class and shape, never the sensitive values."""
import collections
import datetime as dt
import logging
import random
import re

import pytest
from django.contrib.auth import get_user_model
from django.db import DataError, IntegrityError, connection, transaction

from exports.models import ExportRecord
from scheduling.envelope import ContractError
from scheduling.redaction import _MAY_HOLD_A_SECRET, _PATTERNS, MAX_LENGTH, RedactingFilter, describe_error, redact
from scheduling.registry import UnknownJob

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        pytest.param("could not connect to postgres://fairshare:s3cr3t-pw@db.internal:5432/prod", "s3cr3t-pw",
                     id="postgres-url"),
        pytest.param("Error 111 connecting to redis://:hunter2@cache:6379/0", "hunter2", id="redis-url-no-user"),
        pytest.param("https://AKIAEXAMPLE:wJalrXUtnFEMI@s3.example.com/bucket", "wJalrXUtnFEMI", id="https-url"),
    ],
)
def test_credentials_in_connection_urls_are_removed_but_the_host_stays(text, secret):
    redacted = redact(text)

    assert secret not in redacted
    assert "://***@" in redacted
    # What an operator needs to diagnose the failure is still there.
    assert text.split("@", 1)[1] in redacted


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        # Password, token and key assignments.
        pytest.param("connection failed: host=db user=app password=hunter2 dbname=prod", "hunter2", id="dsn"),
        pytest.param("PASSWORD: hunter2", "hunter2", id="colon-uppercase"),
        pytest.param("passwd=hunter2;", "hunter2", id="passwd"),
        pytest.param("bad token=fs_Zx81kq0aa", "fs_Zx81kq0aa", id="token"),
        pytest.param("api_key=AKIAIOSFODNN7 rejected", "AKIAIOSFODNN7", id="api-key"),
        pytest.param("secret: correct-horse-battery", "correct-horse-battery", id="secret"),
        pytest.param("?X-Amz-Signature=9f86d081884c7d65 expired", "9f86d081884c7d65", id="signature"),
        # Longer names that contain one of the words, as in URLs and environment dumps.
        pytest.param("HTTPSConnectionPool(host='api.example.com', port=443): Max retries exceeded with url: "
                     "/oauth/cb?code=1&access_token=ya29.a0AfH6SMBx", "ya29.a0AfH6SMBx", id="access-token-in-url"),
        pytest.param("DB_PASSWORD=hunter2 is not set correctly", "hunter2", id="env-var"),
        pytest.param("client_secret: 8c1f0e6a-secret", "8c1f0e6a", id="client-secret"),
        pytest.param("aws_secret_access_key=wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI", id="aws-key"),
        # Bearer tokens and Authorization headers.
        pytest.param("401 for Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "eyJhbGci", id="bearer"),
        pytest.param("sent Authorization: Bearer fs_live_Q2xvdWQ", "fs_live_Q2xvdWQ", id="authorization-bearer"),
        pytest.param("sent Authorization: Basic dXNlcjpwYXNzd29yZA== to proxy", "dXNlcjpwYXNzd29yZA", id="basic"),
        # Long digit runs: card, phone and account numbers.
        pytest.param("card 4111111111111111 declined", "4111111111111111", id="card"),
        pytest.param("call 0612345678 back", "0612345678", id="phone"),
        pytest.param("IBAN account 1234567", "1234567", id="seven-digits"),
        pytest.param("card 4111 1111 1111 1111 declined", "1111 1111", id="card-in-groups"),
        pytest.param("card 4111-1111-1111-1111 declined", "1111-1111", id="card-with-dashes"),
        pytest.param("amex 3782-822463-10005 declined", "822463", id="amex-groups"),
    ],
)
def test_credentials_and_long_numbers_are_removed(text, secret):
    redacted = redact(text)

    assert secret not in redacted
    assert "***" in redacted


@pytest.mark.parametrize(
    "email",
    ["bob@example.com", "alice.smith+invoices@mail.example.co.uk", "OBrien@example.ie"],
)
def test_email_addresses_are_removed(email):
    redacted = redact(f"could not notify {email} about the export")

    assert email not in redacted
    assert redacted == "could not notify ***@*** about the export"


def test_postgresql_key_details_lose_their_values_but_keep_the_column_names():
    text = ('duplicate key value violates unique constraint "auth_user_email_key"\n'
            "DETAIL:  Key (email)=(x@y.z) already exists.")

    redacted = redact(text)

    assert "x@y.z" not in redacted
    assert "Key (email)=(***) already exists." in redacted
    assert '"auth_user_email_key"' in redacted


def test_multi_column_key_details_are_redacted_whole():
    redacted = redact("DETAIL:  Key (account_id, idempotency_key)=(12, Nightly report for Carol) already exists.")

    assert "Carol" not in redacted
    assert "Key (account_id, idempotency_key)=(***) already exists." in redacted


def test_single_quoted_literals_are_removed():
    redacted = redact("invalid input syntax for type date: 'Carol Jones' at LINE 1: WHERE name = 'Carol Jones'")

    assert "Carol" not in redacted
    assert redacted.count("'***'") == 2


def test_short_numbers_and_identifiers_that_help_diagnosis_are_kept():
    text = ("export 6f1c2a9e-4a57-4c1e-9d0a-0b7f6d1f3c11 for 2026-03-01..2026-03-31 timed out after 300 s "
            "on attempt 3 of 5 (batch 123456) at 12:30:05")

    assert redact(text) == text


# What the patterns look for, cut into pieces that random texts are made of: every one of the
# patterns' words, prefixes and symbols, and the characters around them.
_PIECES = ["password", "PassWd", "pwd", "secret", "TOKEN", "api-key", "access_key", "private-key", "credential",
           "authorization", "Signature", "sig", "Bearer", "basic", "DIGEST", "AKIA", "ASIA", "ACCA", "ABCDEFGHIJKLMN",
           "fs_", "Zx81kq0aa", "/exports/file/", "Failing row contains (", ")=(", "(", ")", "Key (email)", '"', "'",
           "@", "example.com", "://", "postgres", ': "', "4111", "4111 ", "4111-", "1111 1111 1111 ", "3782-822463-",
           "1234567", "12", "0", "-", " ", "\n", "=", ":", ";", ".", "_", "/", "a", "x9", "hunter2",
           "6f1c2a9e-4a57-4c1e-9d0a-"]


def test_every_match_of_a_pattern_holds_what_the_shortcut_looks_for():
    """`redact` returns a text as it is when none of the patterns' `needs` is in it: for that to
    be safe, each pattern must match only where its `needs` is found."""
    rng = random.Random(27)
    matched = collections.Counter()
    for _ in range(20_000):
        text = "".join(rng.choices(_PIECES, k=rng.randint(1, 14)))
        for pattern, _replacement, needs in _PATTERNS:
            if pattern.search(text):
                matched[pattern] += 1
                assert re.search(needs, text), (pattern.pattern, text)
    # Every pattern was put to the test: the random texts matched each of them, often.
    assert [p.pattern for p, _, _ in _PATTERNS if matched[p] < 20] == []


@pytest.mark.parametrize("text", ["task finished", "scheduling.noop", "succeeded", "export built in 300 s"])
def test_a_text_no_pattern_can_match_is_returned_as_it_is(text):
    assert not _MAY_HOLD_A_SECRET.search(text)
    assert redact(text) == text


def test_a_log_line_with_a_secret_in_an_extra_value_is_still_redacted():
    record = logging.LogRecord("scheduling.middleware", logging.INFO, __file__, 1, "task finished", (), None)
    record.job, record.outcome, record.detail = "scheduling.noop", "succeeded", "retry with token=fs_Zx81kq0aa"

    RedactingFilter().filter(record)

    assert (record.msg, record.job, record.outcome) == ("task finished", "scheduling.noop", "succeeded")
    assert "Zx81kq0aa" not in record.detail and record.detail.startswith("retry with token=")


@pytest.mark.parametrize(
    "export_id",
    [
        pytest.param("12345678-4a57-4c1e-9d0a-0b7f6d1f3c11", id="digits-first-segment"),
        pytest.param("6f1c2a9e-4a57-4c1e-9d0a-123456789012", id="digits-last-segment"),
        pytest.param("12345678-1234-4123-8123-123456789012", id="all-digits"),
    ],
)
def test_export_ids_survive_even_when_a_segment_is_all_digits(export_id):
    # About 1 in 40 random UUIDs has an all-digit segment of 8 or 12 characters.
    text = f"export {export_id} failed: card 4111111111111111"

    assert redact(text) == f"export {export_id} failed: card ***"


def test_redacted_text_is_bounded_in_length():
    redacted = redact("x" * 50_000)

    assert len(redacted) == MAX_LENGTH
    assert redacted.endswith("…")


@pytest.mark.parametrize(
    "dump",
    [
        pytest.param("0123456789abcdef" * 6_250, id="hex-dump"),
        pytest.param("4111111111111111" * 6_250, id="digit-run"),
        pytest.param("row " * 25_000, id="many-words"),
    ],
)
def test_a_huge_message_is_cut_to_the_bound_and_marked_as_cut(dump):
    redacted = redact(dump)

    assert len(redacted) <= MAX_LENGTH
    assert redacted.endswith("…")
    assert "4111111111111111" not in redacted


def test_a_secret_near_where_a_huge_message_is_cut_is_still_removed():
    text = "Failing row contains (" + "Carol Jones, " * 300 + ") then password=hunter2 " + "pad " * 5_000

    redacted = redact(text)

    assert "hunter2" not in redacted and "Carol" not in redacted
    assert len(redacted) <= MAX_LENGTH


def test_text_within_the_bound_is_not_truncated():
    text = "y" * MAX_LENGTH

    assert redact(text) == text


def test_describe_error_bounds_the_stored_message_of_a_huge_exception():
    _, message = describe_error(RuntimeError("row dump " + "z" * 100_000))

    assert len(message) <= MAX_LENGTH


def test_describe_error_redacts_the_message_and_never_includes_a_traceback():
    try:
        raise ValueError("card 4111111111111111 for bob@example.com")
    except ValueError as exc:
        error_class, message = describe_error(exc)

    assert error_class == "ValueError"
    assert message == "card *** for ***@***"
    assert "Traceback" not in message


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        pytest.param(ValueError("x"), "ValueError", id="ValueError"),
        pytest.param(KeyError("x"), "KeyError", id="KeyError"),
        pytest.param(TimeoutError("x"), "TimeoutError", id="TimeoutError"),
        pytest.param(ContractError("x"), "scheduling.envelope.ContractError", id="ContractError"),
        pytest.param(UnknownJob("x"), "scheduling.registry.UnknownJob", id="UnknownJob"),
        pytest.param(IntegrityError("x"), "django.db.utils.IntegrityError", id="IntegrityError"),
    ],
)
def test_error_classes_are_module_qualified_except_builtins(exc, expected):
    assert describe_error(exc)[0] == expected


def test_nested_error_classes_keep_their_qualified_name():
    class Outer:
        class Failure(Exception):
            pass

    error_class, _ = describe_error(Outer.Failure("x"))

    assert error_class.startswith(f"{__name__}.")
    assert error_class.endswith("Outer.Failure")


def test_an_error_without_a_message_is_described_by_its_class():
    assert describe_error(ContractError()) == ("scheduling.envelope.ContractError", "scheduling.envelope.ContractError")


# Real PostgreSQL errors, as a job would meet them through the ORM.

def test_a_real_unique_violation_keeps_the_constraint_and_loses_the_value():
    User = get_user_model()
    User.objects.create(username="carol.jones@example.com")
    with pytest.raises(IntegrityError) as excinfo, transaction.atomic():
        User.objects.create(username="carol.jones@example.com")

    error_class, message = describe_error(excinfo.value)

    assert error_class == "django.db.utils.IntegrityError"
    assert "carol" not in message.lower()
    assert "duplicate key value violates unique constraint" in message
    assert "Key (username)=(***)" in message


def test_a_real_check_violation_does_not_store_the_failing_row(account):
    with pytest.raises(IntegrityError) as excinfo, transaction.atomic():
        ExportRecord.objects.create(
            account=account, start_date=dt.date(2026, 3, 5), end_date=dt.date(2026, 3, 1), source="activity",
            idempotency_key="Carol Jones quarterly",
        )

    _, message = describe_error(excinfo.value)

    assert "Carol" not in message
    assert 'violates check constraint "export_start_le_end"' in message
    assert "Failing row contains (***)" in message


def test_a_real_invalid_input_error_does_not_store_the_rejected_value():
    with pytest.raises(DataError) as excinfo, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT %s::integer", ["Carol Jones"])

    error_class, message = describe_error(excinfo.value)

    assert error_class == "django.db.utils.DataError"
    assert "Carol" not in message
    assert "invalid input syntax for type integer" in message
