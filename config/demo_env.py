"""The running demo's settings, for commands typed in another terminal.

`scripts/demo` writes `<FAIRSHARE_VAR_DIR>/demo.env` while it runs (and removes it when it stops):
the URL of its embedded PostgreSQL, its SECRET_KEY, DEBUG and the rest of the environment its own
processes have. Without it, `.venv/bin/python manage.py budget_status` in a second terminal would
know neither the database (the embedded server's port is chosen at start) nor the key the demo's
workers verify messages with (settings refuse to start without one when DEBUG is off).

A process that names its own database (DATABASE_URL in its environment: production, the test
suite, the demo's own processes) never reads the file: a demo run in a deployment's checkout cannot
turn DEBUG on there or point it at another database. A process without DATABASE_URL reads it, and a
variable its environment sets still wins over the file's.

No side effects on import and no django.conf: config/settings.py calls `apply` first of all.
"""
import os
from pathlib import Path

FILE_NAME = "demo.env"


def read(path: Path) -> dict[str, str]:
    """`NAME=value` lines (the value as written, to the end of the line: no quoting); blank lines
    and `#` comments skipped."""
    found = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() and not name.lstrip().startswith("#"):
            found[name.strip()] = value
    return found


def apply(var_dir: Path, environ=os.environ) -> Path | None:
    """Sets the demo file's variables the environment lacks; returns the file when it was read."""
    path = Path(var_dir) / FILE_NAME
    if "DATABASE_URL" in environ or not path.is_file():
        return None
    for name, value in read(path).items():
        environ.setdefault(name, value)
    return path
