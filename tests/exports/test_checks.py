"""The exports app's settings invariants are system checks with named ids."""
from tests.conftest import fairshare_checks


def test_an_attempts_deadline_must_come_before_the_queues_timeout(settings):
    alt = settings.Q_CLUSTER["ALT_CLUSTERS"]
    settings.Q_CLUSTER = {**settings.Q_CLUSTER,
                          "ALT_CLUSTERS": {**alt, "exports": {**alt["exports"], "timeout": 600, "retry": 660}}}
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_ATTEMPT_DEADLINE_S": 600}
    assert fairshare_checks() == [(
        "exports.E001",
        'FAIRSHARE["EXPORT_ATTEMPT_DEADLINE_S"] (600 s) must be shorter than the exports queue\'s timeout (600 s).')]


def test_an_unknown_stream_strategy_is_refused(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_STREAM": "fast"}
    assert fairshare_checks() == [(
        "exports.E002",
        "FAIRSHARE[\"EXPORT_STREAM\"]: unknown export stream strategy 'fast'; choose from ('copy', 'cursor', 'orm').")]
