"""The ledger's statements (its transitions' modules use them), with named parameters;
the settlement's, which use the rules here, are budgets.ledger.settling's. Times: `now` is the kernel's clock (scheduling.clock: the holding area's times, which tests may
shift), the slots' own times (`created_at`, leases) are the wall clock's.

Each rule is one function here, used by every statement that needs it; the kernel's tables come
in through scheduling.sql and scheduling.services (`task_run_*_sql`), never written here. Above
each statement: what it reads as held jobs, accounts and history grow (tests EXPLAIN them on large
tables: tests/scheduling/test_held_work_cost.py).
"""
import functools

from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from scheduling import sql
from scheduling.models import DeferReason

B, U, R = Budget._meta.db_table, UsageDay._meta.db_table, Reservation._meta.db_table
ACTIVE, DISPATCHED = f"'{ReservationStatus.ACTIVE.value}'", f"'{ReservationStatus.DISPATCHED.value}'"
QUEUED_BEHIND, WORKERS_BUSY = DeferReason.QUEUED_BEHIND.value, DeferReason.WORKERS_BUSY.value


# --- The rules ------------------------------------------------------------------------------------

def unreserved(*, limit_s: str, usage: str) -> str:
    """"Unreserved CPU" (ms): the daily limit (`limit_s`, CPU seconds) less what the usage row
    `usage` (an alias, possibly of an outer join) records as used and reserved."""
    return (f"(CAST({limit_s} AS BIGINT) * 1000 - COALESCE({usage}.cpu_used_ms, 0) "
            f"- COALESCE({usage}.cpu_reserved_ms, 0))")


def slots(*, account: str, queue: str, statuses: tuple[str, ...] = (DISPATCHED, ACTIVE), but: str = "NULL") -> str:
    """How many of the account's slots on the queue are in `statuses` (taken: dispatched or
    running; running: ACTIVE), leaving out the slot whose id `but` gives. Reads the account's slots
    (index reservation_slots): bounded by its cap, not by its held work."""
    return (f"(SELECT COUNT(*) FROM {R} x WHERE x.account_id = {account} AND x.queue = {queue} "
            f"AND x.status IN ({', '.join(statuses)}) AND x.id IS DISTINCT FROM {but})")


def running(*, account: str, queue: str, but: str = "NULL") -> str:
    return slots(account=account, queue=queue, statuses=(ACTIVE,), but=but)


def broker_waiting() -> str:
    """"A job sent to the broker on the queue waits for a worker": a dispatched slot sent within
    budgets.ledger.reads.broker_window whose job is not held (a claimed job's slot is not one).
    Reads the queue's dispatched slots sent in that window (index reservation_age).
    Parameters: queue, broker_since, broker_forgets."""
    return (f"EXISTS (SELECT 1 FROM {R} w WHERE w.queue = %(queue)s AND w.status = {DISPATCHED} "
            "AND w.created_at < %(broker_since)s AND w.created_at > %(broker_forgets)s "
            f"AND NOT {sql.is_held(job='w.job', ref='w.ref')})")


def let_go(*, account: str, queue: str, job: str, ref: str) -> str:
    """"Its claimant let the job go" (a held job whose claim expired, given by SQL expressions): no
    slot taken for it is still there. Until the reclaim gives the claim's slot back, its claimant
    may have started the run (a start writes nothing to the slot), and whoever took it over would
    run it a second time, its first run then taken for lost. One probe of index reservation_slots.
    (order.let_go is the ORM's form.)"""
    return (f"NOT EXISTS (SELECT 1 FROM {R} c WHERE c.account_id = {account} AND c.queue = {queue} "
            f"AND c.status IN ({DISPATCHED}, {ACTIVE}) AND c.job = {job} AND c.ref = {ref})")


def claim(*, only_if: str = "TRUE") -> str:
    """The kernel's claim (scheduling.sql.claim), taking over an expired claim only once `let_go`."""
    return sql.claim(only_if=only_if, let_go=let_go)


def others_ready() -> str:
    """"Another account's turn comes first": one whose line on the queue could go (Backlog, index
    backlog_ready: in line, not held up, not paused), below its cap, with fewer slots in use for its
    weight than the settling account will have once its run's slot is freed (ties: the settling
    account keeps its turn). What a pull reads, to its first such account. Parameters: account_id
    (the settling account), queue."""
    mine_after = (f"(({slots(account='%(account_id)s', queue='%(queue)s')} - 1)::float / "
                  f"(SELECT weight FROM {B} WHERE account_id = %(account_id)s AND queue = %(queue)s))")
    return (f"EXISTS (SELECT 1 FROM ({sql.ready_accounts()}) k LEFT JOIN {B} b ON b.account_id = k.account_id "
            "AND b.queue = %(queue)s WHERE k.account_id <> %(account_id)s "
            f"AND {slots(account='k.account_id', queue='%(queue)s')} < COALESCE(b.max_concurrent, 1) "
            f"AND {slots(account='k.account_id', queue='%(queue)s')}::float / COALESCE(b.weight, 1) < {mine_after})")


# --- The statements -------------------------------------------------------------------------------

# The lock: a write that changes nothing, so that the row gets a new version (xmin) each time it is
# locked, which the admission without the lock checks (ADMIT_AT_ONCE). One row by its unique key.
LOCK = f"UPDATE {B} SET max_concurrent = max_concurrent WHERE account_id = %(account_id)s AND queue = %(queue)s RETURNING 1"

# The account's standing (budgets.standing.Standing): its Budget and day's usage by unique key, the
# job's own slot by (job, ref) in the slots' index, the slots taken (only for a job without a slot
# of its own: CASE evaluates the count only then), its Backlog row, the pauses, its claim by (job,
# ref), and for a rate-limited account its window: at most rate_starts TaskRun index entries.
_WINDOW = {"account": "b.account_id", "queue": "b.queue", "limit": "b.rate_starts", "period_s": "b.rate_period_s"}
STANDING = f"""
SELECT b.cpu_seconds_per_day::bigint * 1000 AS cpu_limit_ms, b.max_concurrent, u.id AS usage_id,
       COALESCE(u.cpu_used_ms, 0) AS cpu_used_ms, COALESCE(u.cpu_reserved_ms, 0) AS cpu_reserved_ms,
       CASE WHEN o.id IS NULL THEN {slots(account='b.account_id', queue='b.queue')} END AS in_flight,
       {running(account='b.account_id', queue='b.queue')} AS active,
       {sql.in_line(account='b.account_id', queue='b.queue')} AS in_line,
       {sql.blocked(account='b.account_id', queue='b.queue')} AS blocked, o.id AS own_slot,
       {sql.paused(account='b.account_id', queue='b.queue')} AS paused, {sql.claim_held()} AS claimed,
       b.weight, b.rate_starts, b.rate_period_s,
       CASE WHEN b.rate_starts IS NOT NULL THEN {sql.recent_starts(**_WINDOW)} ELSE 0 END AS recent_starts,
       CASE WHEN b.rate_starts IS NOT NULL THEN {sql.rate_frees_at(**_WINDOW)} END AS rate_frees_at
  FROM {B} b
  LEFT JOIN {U} u ON u.account_id = b.account_id AND u.queue = b.queue AND u.day = %(day)s
  LEFT JOIN LATERAL (SELECT MIN(r.id) AS id FROM {R} r WHERE r.account_id = b.account_id AND r.queue = b.queue
                        AND r.status = {DISPATCHED} AND r.job = %(job)s AND r.ref = %(ref)s) o ON TRUE
 WHERE b.account_id = %(account_id)s AND b.queue = %(queue)s"""

SLOT_COLUMNS = ("account_id, queue, day, job, ref, status, lease_expires_at, created_at, worker, "
                 "cpu_reserved_ms, cpu_reported_ms, cpu_charged_ms, task_run_id")

# The enqueue check's common case, no lock: the account has budget left today, a free slot on the
# queue, no slot of the job's own and no rate limit (a rate-limited account's starts are decided
# under the lock: budgets.standing) (`a`). Then the job takes a dispatched slot (`d`) when nothing is
# in the account's line, a worker is free to start it (%(workers_free)s: budgets.ledger.idle_workers)
# and no job sent to the broker on the queue waits for a worker; otherwise it
# joins the line (`h`): behind the account's held work, or, every worker being busy, to be taken by
# a busy worker's loop in the fair order instead of waiting in the broker's first-in-first-out; its
# deferral counted on the day's usage row (`c`; without that row yet, the lock decides). Returns
# the slot's id (NULL: held), no row when the lock must decide. Reads the account's Budget, usage row, slots and Backlog row, and the
# queue's dispatched slots (index reservation_age).
DISPATCH_OR_HOLD = f"""
WITH a AS (
  SELECT b.account_id, u.id AS usage_id, {sql.in_line(account='b.account_id', queue='b.queue')} AS in_line,
         (NOT %(workers_free)s OR {broker_waiting()}) AS busy
    FROM {B} b LEFT JOIN {U} u ON u.account_id = b.account_id AND u.queue = b.queue AND u.day = %(day)s
   WHERE b.account_id = %(account_id)s AND b.queue = %(queue)s AND b.rate_starts IS NULL
     AND {unreserved(limit_s='b.cpu_seconds_per_day', usage='u')} > 0
     AND b.max_concurrent > {slots(account='b.account_id', queue='b.queue')}
     AND NOT EXISTS (SELECT 1 FROM {R} r WHERE r.account_id = b.account_id AND r.queue = b.queue
                        AND r.status = {DISPATCHED} AND r.job = %(job)s AND r.ref = %(ref)s)),
d AS (
  INSERT INTO {R} ({SLOT_COLUMNS})
  SELECT a.account_id, %(queue)s::varchar, %(day)s::date, %(job)s::varchar, %(ref)s::varchar, {DISPATCHED},
         %(lease)s::timestamptz, %(created_at)s::timestamptz, '', 0, 0, 0, NULL
    FROM a WHERE NOT a.in_line AND NOT a.busy
  RETURNING id),
w AS (SELECT a.in_line FROM a WHERE (a.in_line OR a.busy) AND a.usage_id IS NOT NULL),
h AS ({sql.hold_in_line(source='w', reason=f"CASE WHEN w.in_line THEN '{QUEUED_BEHIND}' ELSE '{WORKERS_BUSY}' END")}),
c AS (UPDATE {U} SET deferrals = deferrals + 1 WHERE id = (SELECT usage_id FROM a) AND EXISTS (SELECT 1 FROM h)
      RETURNING 1)
SELECT (SELECT id FROM d) WHERE EXISTS (SELECT 1 FROM d) OR EXISTS (SELECT 1 FROM h)"""

# The admission's common case without taking the lock first (a job sent with a slot of its own,
# its account below its cap on running jobs with a step left): it writes the account's Budget row
# as the lock does (`b`), but only if the row is still the version its snapshot saw: every lock
# holder writes that row, so a later version means one committed since (or, waited for, just did)
# and whatever it counted is not in this snapshot; then nothing else happens. Holding that row to
# its commit, it decides on counts as exact as under the lock (a rate-limited account's it leaves to
# the lock): the running slots (`s`: only a lock
# holder adds one; the lock-free settlement and pass-on never add to them), the own slot locked
# (`o`), and the budget by a conditional UPDATE of the day's usage row, checked on its latest version
# (`u`: the lock-free pass-on and RESERVE_IF_LEFT change it too). The run's record (`t`) and the
# slot made active (`k`) follow only from `u`. Reads the account's Budget, slots and usage row.
ADMIT_AT_ONCE = f"""
WITH b AS (
  UPDATE {B} SET max_concurrent = max_concurrent
   WHERE account_id = %(account_id)s AND queue = %(queue)s
     AND xmin = (SELECT xmin FROM {B} WHERE account_id = %(account_id)s AND queue = %(queue)s)
  RETURNING account_id, queue, cpu_seconds_per_day, max_concurrent, rate_starts),
o AS (
  SELECT r.id FROM {R} r
   WHERE r.id = (SELECT MIN(x.id) FROM {R} x WHERE x.account_id = %(account_id)s AND x.queue = %(queue)s
                   AND x.status = {DISPATCHED} AND x.job = %(job)s AND x.ref = %(ref)s)
     AND r.status = {DISPATCHED}
  FOR UPDATE),
s AS (
  SELECT o.id AS own_id, b.cpu_seconds_per_day FROM b, o
   WHERE {running(account='b.account_id', queue='b.queue')} < b.max_concurrent AND b.rate_starts IS NULL),
u AS (
  UPDATE {U} AS day_usage SET cpu_reserved_ms = day_usage.cpu_reserved_ms + %(reserve_ms)s FROM s
   WHERE day_usage.account_id = %(account_id)s AND day_usage.queue = %(queue)s AND day_usage.day = %(day)s
     AND {unreserved(limit_s='s.cpu_seconds_per_day', usage='day_usage')} >= %(reserve_ms)s
  RETURNING day_usage.id),
t AS ({{run}}),
k AS (
  UPDATE {R} SET status = {ACTIVE}, day = %(day)s, worker = %(worker)s, cpu_reserved_ms = %(reserve_ms)s,
         lease_expires_at = %(lease)s, task_run_id = (SELECT id FROM t)
   WHERE id = (SELECT own_id FROM s) AND EXISTS (SELECT 1 FROM u)
  RETURNING id, task_run_id)
SELECT EXISTS (SELECT 1 FROM b) AS fresh, (SELECT id FROM k) AS slot_id, (SELECT task_run_id FROM k) AS task_run_id,
       {sql.paused(account='%(account_id)s', queue='%(queue)s')} AS paused"""

# The admission under the lock (budgets.admission.admit, which read the standing): the CPU reserved
# on the day's usage row (`u`), the run's record inserted (`t`, a `{run}` part: scheduling.services)
# or given (%(run_id)s), a claimed job's claim completed (`k`, a `{complete_claim}` part:
# scheduling.sql), its slot made ACTIVE: its own (%(own)s) or a new one. One statement for each of
# the eight shapes, keyed (own slot, run inserted, claim completed). Rows by key.
RESERVE = f"UPDATE {U} SET cpu_reserved_ms = cpu_reserved_ms + %(reserve_ms)s WHERE id = %(usage_id)s"


def _activate(own: bool, insert_run: bool, claimed: bool) -> str:
    run_id = "(SELECT id FROM t)" if insert_run else "%(run_id)s"
    parts = [f"u AS ({RESERVE} RETURNING 1)"] + (["t AS ({run})"] if insert_run else []) + \
        (["k AS ({complete_claim})"] if claimed else [])
    slot = (f"UPDATE {R} SET status = {ACTIVE}, day = %(day)s, worker = %(worker)s, cpu_reserved_ms = %(reserve_ms)s, "
            f"lease_expires_at = %(lease)s, task_run_id = {run_id} WHERE id = %(own)s RETURNING id, task_run_id"
            if own else
            f"INSERT INTO {R} ({SLOT_COLUMNS}) VALUES (%(account_id)s, %(queue)s, %(day)s, %(job)s, %(ref)s, {ACTIVE}, "
            f"%(lease)s, %(created_at)s, %(worker)s, %(reserve_ms)s, 0, 0, {run_id}) RETURNING id, task_run_id")
    return f"WITH {', '.join(parts)} {slot}"


ACTIVATE = {(own, insert_run, claimed): _activate(own, insert_run, claimed)
            for own in (True, False) for insert_run in (True, False) for claimed in (True, False)}


# A hand-off under the lock (which read the standing): the first job of the account's line claimed
# (`c`) and admitted ahead in the same statement: its run recorded (`t`), a step reserved (`u`), its
# slot inserted ACTIVE on the claim's lease. Reads the first unclaimed rows of the line.
CLAIM_AND_ADMIT = (
    "WITH c AS ({claim}), t AS ({new_run}), "
    f"u AS ({RESERVE} AND EXISTS (SELECT 1 FROM c) RETURNING 1) "
    f"INSERT INTO {R} ({SLOT_COLUMNS}) SELECT %(account_id)s::bigint, %(queue)s::varchar, %(day)s::date, c.job, "
    f"c.ref, {ACTIVE}, %(slot_lease)s::timestamptz, %(created_at)s::timestamptz, %(worker)s::varchar, "
    "%(reserve_ms)s::bigint, 0, 0, (SELECT id FROM t) FROM c "
    "RETURNING job, ref, id, task_run_id, (SELECT priority FROM c) AS priority")
# The same without admitting (the account may not start it now): a dispatched slot on the claim's lease.
CLAIM_FOR = (
    "WITH c AS ({claim}) "
    f"INSERT INTO {R} ({SLOT_COLUMNS}) SELECT %(account_id)s::bigint, %(queue)s::varchar, %(day)s::date, c.job, "
    f"c.ref, {DISPATCHED}, %(slot_lease)s::timestamptz, %(created_at)s::timestamptz, '', 0, 0, 0, NULL FROM c "
    "RETURNING job, ref, id, (SELECT priority FROM c) AS priority")

# A job admitted ahead starts: its claim completes if its slot is still there, the slot's row
# locked (not written: its claim's lease runs until the run's watcher renews it, well before the
# lease ends: budgets.watcher) so that a reclaim taking it at the same moment goes first or finds it
# started. Two rows by key.
START_ADMITTED = (f"WITH s AS (SELECT id FROM {R} WHERE id = %(slot_id)s AND status = {ACTIVE} FOR NO KEY UPDATE) "
                  f"{sql.complete_claim(only_if='EXISTS (SELECT 1 FROM s)')}")

# `ms` more for a slot admitted ahead, when its account has that much left unreserved (checked on
# the usage row's latest version: two of these never reserve the same budget twice). Rows by key.
RESERVE_IF_LEFT = f"""
WITH u AS (UPDATE {U} u SET cpu_reserved_ms = u.cpu_reserved_ms + %(ms)s FROM {B} b
            WHERE u.id = %(usage_id)s AND b.account_id = u.account_id AND b.queue = u.queue
              AND {unreserved(limit_s='b.cpu_seconds_per_day', usage='u')} >= %(ms)s RETURNING 1)
UPDATE {R} SET cpu_reserved_ms = cpu_reserved_ms + %(ms)s WHERE id = %(slot_id)s AND EXISTS (SELECT 1 FROM u)
RETURNING 1"""

# budgets.ledger.reads.broker_waiting, a prepared statement (asked by every hand-off, release
# and pull): the queue's dispatched slots sent in the broker window (index reservation_age).
BROKER_WAITING = f"SELECT {broker_waiting()}"

# Accounts whose line on the queue could go now and that have a free slot, in fair order (the
# scheduling order's first half: docs/architecture.md): fewest slots in use for their weight first,
# then the one whose first held job has waited longest in line. Reads the Backlog of the accounts
# whose line could go now (index backlog_ready), their Budget, slots and first held job:
# O(accounts that could run), whatever is held. An account whose plan's Budget row on the queue is
# not made yet (a brand-new account's work held for a time: the row is made under its lock, which
# the release takes: budgets.locks.lock) counts as one free slot of weight 1 until then.
READY_ACCOUNTS = f"""
SELECT c.account_id, c.in_flight::float / c.weight FROM (
  SELECT k.account_id, k.head_since, COALESCE(b.max_concurrent, 1) AS max_concurrent, COALESCE(b.weight, 1) AS weight,
         {slots(account='k.account_id', queue='%(queue)s')} AS in_flight
    FROM ({sql.ready_accounts()}) k LEFT JOIN {B} b ON b.account_id = k.account_id AND b.queue = %(queue)s) c
 WHERE c.in_flight < c.max_concurrent
 ORDER BY c.in_flight::float / c.weight, c.head_since
 LIMIT %(limit)s"""


@functools.cache
def compose(template: str, **parts: str) -> str:
    """A statement of a template here with the kernel's SQL for its parts (a run's insert and end, a
    claim), composed once per shape and then the same string object, whose hash and conversion
    the cursor keeps (the pass-on's is 8 KB, sent for each task)."""
    return template.format(**parts)


# A hand-off's claim, and the same unless a job sent to the broker waits for a worker.
CLAIM, CLAIM_YIELDING = claim(), claim(only_if=f"NOT {broker_waiting()}")
