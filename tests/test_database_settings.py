"""The database settings: PostgreSQL only, refused by name otherwise; and the running demo's file
(var/demo.env, config/demo_env.py), read by a command typed beside the demo and by nothing that
names its own database."""
import os
import subprocess
import sys

from config import demo_env
from tests.conftest import REPO

DEMO_FILE = "# written by scripts/demo\nDATABASE_URL={url}\nSECRET_KEY=the-demo's key=with equals\nDEBUG=1\n"


def bare_env(var_dir, **extra: str) -> dict[str, str]:
    """A new shell's environment: no Django, database or Fairshare variable but the var dir."""
    keep = {"PATH", "HOME", "LANG", "TMPDIR"}
    return {**{k: v for k, v in os.environ.items() if k in keep}, "FAIRSHARE_VAR_DIR": str(var_dir), **extra}


def settings_seen(environ: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("from django.conf import settings as s; "
            "print(s.DEBUG, repr(s.SECRET_KEY), s.DATABASES['default']['NAME'], sep='|')")
    return subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=120)


def test_a_database_other_than_postgresql_is_refused_at_start_up_by_name(tmp_path):
    for url in (f"sqlite:///{tmp_path}/fairshare.sqlite3", "mysql://root@127.0.0.1/fairshare"):
        done = subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, capture_output=True, text=True,
                              env=bare_env(tmp_path, DATABASE_URL=url, SECRET_KEY="k"), timeout=120)
        assert done.returncode == 1
        assert "DATABASE_URL must be a PostgreSQL URL" in done.stderr, done.stderr
        assert f"it is {url.partition(':')[0]}: Fairshare runs on PostgreSQL only" in done.stderr, done.stderr
    assert not (tmp_path / "fairshare.sqlite3").exists()


def test_without_a_database_a_command_says_what_to_set_and_where_the_demo_leaves_its_own(tmp_path):
    done = subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, capture_output=True, text=True,
                          env=bare_env(tmp_path, SECRET_KEY="k"), timeout=120)
    assert done.returncode == 1
    assert "DATABASE_URL must be a PostgreSQL URL" in done.stderr and "it is not set" in done.stderr, done.stderr
    assert str(tmp_path / "demo.env") in done.stderr


def test_a_command_beside_the_demo_takes_the_demo_s_database_key_and_debug_from_its_file(tmp_path):
    url = os.environ["DATABASE_URL"]
    (tmp_path / "demo.env").write_text(DEMO_FILE.format(url=url))

    done = settings_seen(bare_env(tmp_path))

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"True|\"the-demo's key=with equals\"|{url.rsplit('/', 1)[1]}"


def test_the_environment_wins_over_the_demo_s_file(tmp_path):
    environ = {"SECRET_KEY": "mine", "DEBUG": "0"}
    (tmp_path / "demo.env").write_text(DEMO_FILE.format(url="postgres://demo@127.0.0.1:1/fairshare"))

    assert demo_env.apply(tmp_path, environ) == tmp_path / "demo.env"

    assert environ == {"SECRET_KEY": "mine", "DEBUG": "0", "DATABASE_URL": "postgres://demo@127.0.0.1:1/fairshare"}


def test_a_process_that_names_its_own_database_never_reads_the_demo_s_file(tmp_path):
    # A production deployment (its DATABASE_URL, its SECRET_KEY, DEBUG unset) in a checkout where the
    # demo once ran: DEBUG stays off and the key stays its own.
    (tmp_path / "demo.env").write_text(DEMO_FILE.format(url="postgres://demo@127.0.0.1:1/fairshare"))
    environ = {"DATABASE_URL": os.environ["DATABASE_URL"], "SECRET_KEY": "production"}

    assert demo_env.apply(tmp_path, dict(environ)) is None

    done = settings_seen(bare_env(tmp_path, **environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"False|'production'|{environ['DATABASE_URL'].rsplit('/', 1)[1]}"


def test_without_the_demo_s_file_nothing_is_read(tmp_path):
    environ = {"SECRET_KEY": "mine"}
    assert demo_env.apply(tmp_path, environ) is None
    assert environ == {"SECRET_KEY": "mine"}
