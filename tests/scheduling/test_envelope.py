"""The queue message contract (v1 and v2): what a worker accepts, and what it refuses as a ContractError."""
import pytest

from scheduling.envelope import MAX_REF_LENGTH, VERSION, ContractError, Envelope, NeedsNewerWorker, parse

VALID = {"v": 1, "job": "exports.build", "account": 12, "ref": "6f1c2a9e-4a57-4c1e-9d0a-0b7f6d1f3c11"}
VALID_V2 = {**VALID, "v": 2, "priority": 0}


def test_a_v1_envelope_parses_into_its_fields():
    envelope = parse(dict(VALID))

    assert envelope == Envelope(job="exports.build", account=12, ref=VALID["ref"], v=1)


def test_a_parsed_envelope_round_trips_to_the_same_message():
    assert parse(dict(VALID)).to_message() == VALID


def test_an_envelope_without_an_account_is_accepted_for_system_jobs():
    envelope = parse({**VALID, "job": "scheduling.purge_expired_exports", "account": None, "ref": ""})

    assert envelope.account is None and envelope.ref == ""


def test_a_ref_of_exactly_the_maximum_length_is_accepted():
    assert parse({**VALID, "ref": "x" * MAX_REF_LENGTH}).ref == "x" * MAX_REF_LENGTH


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        pytest.param("exports.build", "must be an object", id="string"),
        pytest.param(None, "must be an object", id="none"),
        pytest.param([1, "exports.build", 12, "ref"], "must be an object", id="list"),
        pytest.param(b'{"v": 1}', "must be an object", id="bytes"),
    ],
)
def test_a_message_that_is_not_an_object_is_refused(message, reason):
    with pytest.raises(ContractError, match=reason):
        parse(message)


@pytest.mark.parametrize("missing", ["job", "account", "ref"])
def test_a_message_missing_a_field_is_refused_naming_the_missing_field(missing):
    message = {k: v for k, v in VALID.items() if k != missing}

    with pytest.raises(ContractError, match=f"envelope is missing {missing} "):
        parse(message)


def test_a_message_missing_several_fields_names_them_all():
    with pytest.raises(ContractError, match="envelope is missing account, ref "):
        parse({"v": 1, "job": "exports.build"})


def test_a_message_without_a_version_is_refused_as_an_unsupported_version():
    message = {k: v for k, v in VALID.items() if k != "v"}

    with pytest.raises(ContractError, match="unsupported envelope version None"):
        parse(message)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"email": "bob@example.com"}, id="customer-data"),
        pytest.param({"timeout": 5}, id="option-like-kwarg"),
        pytest.param({"attempt": 2}, id="attempt"),
    ],
)
def test_a_message_with_an_extra_field_is_refused(extra):
    with pytest.raises(ContractError, match=r"envelope has 1 unexpected field\(s\)") as excinfo:
        parse({**VALID, **extra})
    assert repr(next(iter(extra))) in str(excinfo.value)


@pytest.mark.parametrize(
    ("version", "shown"),
    [
        pytest.param(0, "0", id="v0"),
        pytest.param(-1, "-1", id="negative"),
        pytest.param("1", "'1'", id="string-1"),
        pytest.param(1.5, "1.5", id="float"),
        pytest.param(1.0, r"1\.0", id="float-equal-to-1"),
    ],
)
def test_any_version_other_than_a_positive_integer_is_refused(version, shown):
    with pytest.raises(ContractError, match=f"unsupported envelope version {shown}"):
        parse({**VALID, "v": version})


def test_a_true_version_is_refused_even_though_true_equals_1():
    # bool is an int subclass and True == 1: a JSON `true` must not pass as version 1.
    with pytest.raises(ContractError, match="unsupported envelope version True"):
        parse({**VALID, "v": True})


@pytest.mark.parametrize(
    "account",
    [
        pytest.param(True, id="true"),
        pytest.param(False, id="false"),
        pytest.param("12", id="string"),
        pytest.param(12.0, id="float"),
    ],
)
def test_an_account_that_is_not_an_integer_id_is_refused(account):
    with pytest.raises(ContractError, match="field account must be an integer id or null"):
        parse({**VALID, "account": account})


@pytest.mark.parametrize(
    "job",
    [pytest.param("", id="empty"), pytest.param(None, id="null"), pytest.param(7, id="number")],
)
def test_an_empty_or_non_string_job_is_refused(job):
    with pytest.raises(ContractError, match="field job must be a non-empty string"):
        parse({**VALID, "job": job})


@pytest.mark.parametrize(
    "ref",
    [
        pytest.param("x" * (MAX_REF_LENGTH + 1), id="too-long"),
        pytest.param(12345, id="number"),
        pytest.param(None, id="null"),
    ],
)
def test_a_ref_that_is_too_long_or_not_a_string_is_refused(ref):
    with pytest.raises(ContractError, match=f"field ref must be a string of at most {MAX_REF_LENGTH} characters"):
        parse({**VALID, "ref": ref})


def test_a_v2_envelope_carries_its_priority_and_round_trips():
    envelope = parse({**VALID_V2, "priority": -40})

    assert envelope == Envelope(job="exports.build", account=12, ref=VALID["ref"], v=2, priority=-40)
    assert envelope.to_message() == {**VALID_V2, "priority": -40}


def test_a_v1_envelope_is_priority_0_and_a_v1_message_carries_no_priority():
    assert parse(dict(VALID)).priority == 0
    assert Envelope(job="exports.build", account=12, ref="r", v=1, priority=50).to_message() == {
        "v": 1, "job": "exports.build", "account": 12, "ref": "r"}


def test_each_version_has_exactly_its_own_fields():
    with pytest.raises(ContractError, match=r"envelope is missing priority \(v2 fields"):
        parse({**VALID, "v": 2})
    with pytest.raises(ContractError, match=r"unexpected field\(s\) \['priority'\] \(v1 fields"):
        parse({**VALID, "priority": 0})


@pytest.mark.parametrize("priority", [101, -101, 1.0, True, "5", None])
def test_a_priority_outside_minus_100_to_100_or_not_an_integer_is_refused(priority):
    with pytest.raises(ContractError, match="field priority must be an integer from -100 to 100"):
        parse({**VALID_V2, "priority": priority})


@pytest.mark.parametrize("version", [VERSION + 1, 99])
def test_a_version_newer_than_the_worker_speaks_needs_a_newer_worker_not_a_rejection(version):
    # Rolling upgrades: the runner parks it in the holding area (tests/scheduling/test_upgrades.py).
    with pytest.raises(NeedsNewerWorker) as excinfo:
        parse({**VALID, "v": version})

    assert excinfo.value.version == version
    assert not isinstance(excinfo.value, ContractError)


def test_a_worker_told_it_speaks_a_newer_version_parses_it(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "SPEAKS_ENVELOPE_VERSION": VERSION + 1}

    assert parse({**VALID_V2, "v": VERSION + 1}) == Envelope(job="exports.build", account=12, ref=VALID["ref"],
                                                            v=VERSION + 1)
