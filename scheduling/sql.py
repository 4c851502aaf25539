"""The kernel's tables in other apps' hand-written statements (budgets' ledger): each
function returns SQL over the kernel's own tables only, with named parameters (`%(name)s`, listed
in its docstring), for the caller to place in a statement of its own. A caller passes in the SQL
expressions a fragment needs from its statement (an account column, a condition on its own CTEs)
as arguments: no fragment knows the caller's aliases, and the caller never writes the kernel's
tables' SQL itself.

Cost, as held jobs and accounts grow (EXPLAINed in tests/scheduling/test_held_work_cost.py):
`claim` reads the first unclaimed rows of one account's line (index deferred_line; for each whose
claim expired, what the caller's `let_go` reads), `hold_in_line`
writes one row, its conflict found by the (job, ref) key, `in_line` and
`ready_accounts`/`any_ready` read Backlog (its unique key; index backlog_ready over the accounts
whose line could go now), `complete_claim` and `claim_held` one row by (job, ref), a rate limit's
window (`recent_starts`, `rate_frees_at`) at most the limit's count of TaskRun index entries.
"""
from scheduling.models import NOT_BLOCKED, NOT_STARTED, Backlog, DeferredTask, Pause, TaskRun

_DEFERRED = DeferredTask._meta.db_table
_BACKLOG = Backlog._meta.db_table
_RUNS = TaskRun._meta.db_table
# "Not held up", as a constant in the statement (not a parameter): the planner then knows from the
# statistics how few lines could go, also in the generic plan a prepared statement settles on.
_NOT_BLOCKED = f"'{NOT_BLOCKED.isoformat()}'::timestamptz"


def claim(*, only_if: str = "TRUE", let_go=None) -> str:
    """Claim the first job of an account's line for a worker, when the caller's condition `only_if`
    holds: an UPDATE returning the claimed job's (job, ref, priority), or no row. SKIP LOCKED: two
    claimants never take the same job and neither waits for the other. A job whose claim expired is
    taken over only where the caller's `let_go(account=, queue=, job=, ref=)` (SQL over the job's
    columns, given as SQL expressions) says its claimant let it go.
    Parameters: account_id, queue, worker, claim_expires_at, now."""
    taken_over = "TRUE" if let_go is None else let_go(account="d.account_id", queue="d.queue", job="d.job", ref="d.ref")
    return f"""
UPDATE {_DEFERRED} SET claimed_by = %(worker)s, claim_expires_at = %(claim_expires_at)s
 WHERE id = (SELECT d.id FROM {_DEFERRED} d
              WHERE d.account_id = %(account_id)s AND d.queue = %(queue)s AND d.in_line_since IS NOT NULL
                AND (d.claim_expires_at IS NULL OR (d.claim_expires_at < %(now)s AND {taken_over})) AND ({only_if})
              ORDER BY d.priority DESC, d.in_line_since, d.id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING job, ref, priority"""


def hold_in_line(*, source: str, reason: str) -> str:
    """Hold a job in its account's line, one row for each row of the caller's `source` (a CTE of
    its statement; none, none held), for `reason` (SQL), due now: an INSERT returning 1 per job
    held. A job already held keeps its row as it is (no row returned): the caller then decides
    under the account's lock. Backlog's triggers count it in the same statement.
    Parameters: account_id, queue, job, ref, priority, now, created_at (the wall clock's)."""
    return f"""
INSERT INTO {_DEFERRED} (account_id, queue, job, ref, reason, eligible_at, created_at, in_line_since, deferrals,
                         priority, claimed_by, claim_expires_at, envelope_version, message)
SELECT %(account_id)s, %(queue)s, %(job)s, %(ref)s, {reason}, %(now)s, %(created_at)s, %(now)s, 1, %(priority)s, '', NULL, 1,
       NULL FROM {source}
ON CONFLICT (job, ref) DO NOTHING RETURNING 1"""


def complete_claim(*, only_if: str = "TRUE") -> str:
    """The claimed job's run starts: it leaves the holding area if the claimant still holds its
    claim and the caller's condition holds; returns a row when it did.
    Parameters: job, ref, worker."""
    return (f"DELETE FROM {_DEFERRED} WHERE job = %(job)s AND ref = %(ref)s AND claimed_by = %(worker)s "
            f"AND ({only_if}) RETURNING 1")


def claim_held() -> str:
    """Whether a worker still holds its claim on a job (NULL `claimant`: no claim, matches nothing).
    Parameters: job, ref, claimant."""
    return (f"EXISTS (SELECT 1 FROM {_DEFERRED} c WHERE c.job = %(job)s AND c.ref = %(ref)s "
            "AND c.claimed_by = %(claimant)s)")


def in_line(*, account: str, queue: str) -> str:
    """Whether the account (SQL expression `account`) has held work in its line on `queue`. Its one
    Backlog row by its unique key (the condition is on the row, not in the WHERE, so that no
    other index can look better). No parameters."""
    return f"COALESCE((SELECT k.in_line > 0 FROM {_BACKLOG} k WHERE k.account_id = {account} AND k.queue = {queue}), FALSE)"


def blocked(*, account: str, queue: str) -> str:
    """Whether the account's line on `queue` waits for a time (its budget was spent). Its one
    Backlog row by its unique key. Parameters: now."""
    return (f"COALESCE((SELECT k.blocked_until > %(now)s FROM {_BACKLOG} k "
            f"WHERE k.account_id = {account} AND k.queue = {queue}), FALSE)")


def ready_accounts() -> str:
    """The accounts whose line on a queue could go now: something in line, not held up, not paused
    (scheduling.holding.ready); a SELECT of (account_id, head_since: when the first of its line
    joined it). Parameters: queue."""
    return f"""
SELECT k.account_id,
       (SELECT d.in_line_since FROM {_DEFERRED} d
         WHERE d.account_id = k.account_id AND d.queue = k.queue AND d.in_line_since IS NOT NULL
         ORDER BY d.priority DESC, d.in_line_since, d.id LIMIT 1) AS head_since
  FROM {_BACKLOG} k
 WHERE k.queue = %(queue)s AND k.lined AND k.blocked_until = {_NOT_BLOCKED}
   AND NOT {paused(account="k.account_id", queue="k.queue")}"""


def any_ready() -> str:
    """Whether any account's line on a queue could go now (pause aside: a paused account's line
    makes a free worker look, and find nothing). Parameters: queue."""
    return (f"EXISTS (SELECT 1 FROM {_BACKLOG} k WHERE k.queue = %(queue)s AND k.lined "
            f"AND k.blocked_until = {_NOT_BLOCKED})")


def _window(*, account: str, queue: str, period_s: str) -> str:
    return (f"FROM {_RUNS} t WHERE t.account_id = {account} AND t.queue = {queue} "
            f"AND t.started_at > %(wall_now)s - make_interval(secs => {period_s}) "
            f"AND t.outcome NOT IN ({', '.join(repr(str(o)) for o in NOT_STARTED)})")


def recent_starts(*, account: str, queue: str, limit: str, period_s: str) -> str:
    """How many runs of the account started on the queue in the last `period_s` seconds (a rate
    limit's window), counted no further than `limit` (SQL expressions all). Reads at most `limit`
    entries of index taskrun_account_queue_started, whatever the history holds.
    Parameters: wall_now (TaskRun's clock: the database's, not the kernel's)."""
    return f"(SELECT COUNT(*) FROM (SELECT 1 {_window(account=account, queue=queue, period_s=period_s)} LIMIT {limit}) n)"


def rate_frees_at(*, account: str, queue: str, limit: str, period_s: str) -> str:
    """When the account's `limit`-th latest start in the window leaves it (NULL: fewer started): from
    then it may start one more. Reads at most `limit` index entries, as `recent_starts`.
    Parameters: wall_now."""
    return (f"(SELECT t.started_at + make_interval(secs => {period_s}) {_window(account=account, queue=queue, period_s=period_s)} "
            f"ORDER BY t.started_at DESC OFFSET {limit} - 1 LIMIT 1)")


def paused(*, account: str, queue: str) -> str:
    """Whether a pause covers the account's work on the queue (SQL expressions `account`, `queue`):
    the account's on every queue, the account's on this one, or the whole queue's
    (scheduling.pausing). No parameters."""
    return (f"EXISTS (SELECT 1 FROM {Pause._meta.db_table} p WHERE (p.account_id = {account} AND "
            f"p.queue IN ('', {queue})) OR (p.account_id IS NULL AND p.queue = {queue}))")


def is_held(*, job: str, ref: str) -> str:
    """Whether the job (SQL expressions `job`, `ref`) is in the holding area. No parameters."""
    return f"EXISTS (SELECT 1 FROM {_DEFERRED} h WHERE h.job = {job} AND h.ref = {ref})"
