"""README.md's first host-code example (a `@task` and its call) runs as written: its module part
is written where it says, its caller part is run, and the call then runs through the chain."""
import re
import sys
from importlib.util import find_spec

import pytest

from scheduling.runtime import execute
from tasks.compat import TaskResultStatus
from tests.conftest import REPO

pytestmark = pytest.mark.django_db(transaction=True)


def first_python_block() -> str:
    return re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)


@pytest.fixture
def host_package(tmp_path, monkeypatch):
    """A folder on the import path for the example's `billing` package; forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "billing" or m.startswith("billing.")]:
        del sys.modules[name]


def test_the_readmes_first_host_code_example_runs_as_written(account, host_package, capsys):
    block = first_python_block()
    assert "@task" in block and block.startswith("# billing/tasks.py")
    module, caller = block.split("\n# anywhere", 1)
    if find_spec("django.tasks") is None:  # Django 5.2 LTS, as the example's comment says
        module = module.replace("from django.tasks import task", "from django_tasks import task")
    (host_package / "billing").mkdir()
    (host_package / "billing" / "__init__.py").write_text("")
    (host_package / "billing" / "tasks.py").write_text(module)

    namespace: dict = {}
    exec("# anywhere" + caller, namespace)  # noqa: S102 - the README's own code
    result = namespace["result"]
    assert capsys.readouterr().out.split() == [result.id, "READY"]

    execute({"v": 1, "job": "tasks.run.default", "account": account.pk, "ref": result.id})
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == f"invoice 42 sent for account {account.pk}"
