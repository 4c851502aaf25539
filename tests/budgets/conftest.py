"""The ledger backends (budgets.ledger): every in-process budgets test runs with each, on
PostgreSQL, so the portable (ORM) ledger is tested for real beside the PostgreSQL one. A test of
one backend's own behaviour (a statement count, the admission without the lock) says so with
`@pytest.mark.ledger("postgresql")`; a test with real worker processes runs with the PostgreSQL
ledger unless it names both (its workers get the backend through FAIRSHARE_LEDGER)."""
import pytest

LEDGERS = {"postgresql": "budgets.ledger.postgresql.Ledger", "portable": "budgets.ledger.portable.Ledger"}


def pytest_generate_tests(metafunc):
    if "ledger_backend" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("ledger")
    if marker is not None:
        names = list(marker.args)
    elif metafunc.definition.get_closest_marker("processes") is not None:
        names = ["postgresql"]
    else:
        names = sorted(LEDGERS)
    metafunc.parametrize("ledger_backend", names, indirect=True)


@pytest.fixture(autouse=True)
def ledger_backend(request, settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "LEDGER": LEDGERS[request.param]}
    return request.param
