"""The holding area (DeferredTask, counted in Backlog): work that may not run now waits here with its
reason and the time it may go, instead of in the broker. This module writes these tables, and the
triggers that count it; budgets' ledger statements (budgets/ledger/queries.sql) claim, start and
release held jobs, through the SQL functions of the migrations (fairshare_*).

The words, each in one sense:
- hold: put a job in the holding area. It waits for a time of its own (a retry's back-off, a
  `run_after`, a resume), or, in its account's **line**, for its account (a free slot, budget).
- line: an account's held jobs that go as soon as the account may run, in order: highest priority
  first, then longest in line. A job whose own time came **lines up** (`line_up_due`).
- block: the account's whole line waits until a time (its budget is spent until the next budget
  day: `hold` blocks it; `unblock` when an operator gives it more).
- release: take held work out of the holding area and send it again; nothing else (a line's
  first jobs: budgets' `release` statement, sent by `send_on_commit_all`).
- claim: a worker takes the first job of a line to run it itself, straight away, without a broker
  round trip (budgets' statements, budgets/ledger/queries.sql `claim`); the row stays, marked with the worker and a lease, until that
  run starts. A claim whose lease expired (its worker died) is claimable again once its slot is given
  back (fairshare_claimable, budgets migration 0018).
- park: keep a message of a newer envelope version than this process speaks, unchanged, for a
  worker that speaks it; parked messages are never claimed.

What each question about held work reads (the cost model, as held jobs and accounts grow): a hold,
release, claim or unhold reads its own rows through an index, O(log n); "is anything of this
account's in line", "which accounts could run now" read Backlog (O(accounts that could run), never
the held jobs); lining up reads only what is due (the own-time index). EXPLAINed with 100,000 held
rows in tests/scheduling/test_held_work_cost.py.
"""
import datetime as dt
import hashlib
import json
from typing import Any

from django.db import transaction
from django.db.models import F, Q

from budgets.models import Account
from scheduling import clock
from scheduling.broker import send_message, send_on_commit
from scheduling.envelope import MAX_REF_LENGTH, Envelope, known_version
from scheduling.gates import enqueue_gates
from scheduling.models import ACCOUNT_WAITS_REASONS, NOT_BLOCKED, OWN_TIME_REASONS, Backlog, DeferReason, DeferredTask

# Claim order within an account's line: what the index deferred_line is sorted by.
LINE_ORDER = ("-priority", "in_line_since", "id")


def _in_line_since(reason: str, eligible_at: dt.datetime, now: dt.datetime) -> dt.datetime | None:
    """A job held for `reason` joins its account's line now, unless it waits for a time of its own
    that has not come."""
    return None if reason in OWN_TIME_REASONS and eligible_at > now else now


def hold(*, envelope: Envelope, queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """Put a job in the holding area (or refresh its reason if it is already held). A job held
    for its account's budget until a later time holds up the account's line until then."""
    now = clock.now()
    in_line_since = _in_line_since(reason, eligible_at, now)
    # Duplicate deliveries of one envelope are held once: the (job, ref) constraint decides.
    held, created = DeferredTask.objects.get_or_create(
        job=envelope.job, ref=envelope.ref,
        defaults={"account_id": envelope.account, "queue": queue, "reason": reason, "eligible_at": eligible_at,
                  "priority": envelope.priority, "in_line_since": in_line_since},
    )
    if not created:
        # Held again: a claim on it is void (its claimant's admission then finds it lost and does
        # not run it), and in line it keeps its place.
        DeferredTask.objects.filter(pk=held.pk).update(
            reason=reason, eligible_at=eligible_at, deferrals=F("deferrals") + 1, claimed_by="", claim_expires_at=None,
            in_line_since=None if in_line_since is None else (held.in_line_since or in_line_since),
        )
    if reason in ACCOUNT_WAITS_REASONS and eligible_at > now and envelope.account is not None:
        block(account_id=envelope.account, queue=queue, until=eligible_at, reason=reason)


def hold_many(*, envelopes: list[Envelope], queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """Put a batch of jobs in the holding area with one insert, in their order (a job already
    held keeps its row as it is)."""
    now = clock.now()
    in_line_since = _in_line_since(reason, eligible_at, now)
    DeferredTask.objects.bulk_create(
        [DeferredTask(account_id=e.account, queue=queue, job=e.job, ref=e.ref, reason=reason, eligible_at=eligible_at,
                      priority=e.priority, in_line_since=in_line_since) for e in envelopes],
        ignore_conflicts=True,
    )
    accounts = {e.account for e in envelopes if e.account is not None}
    if reason in ACCOUNT_WAITS_REASONS and eligible_at > now:
        for account_id in accounts:
            block(account_id=account_id, queue=queue, until=eligible_at, reason=reason)


def hold_scheduled(*, envelope: Envelope, queue: str, run_after: dt.datetime) -> None:
    """Hold work enqueued with a time before which it may not run (`enqueue(run_after=)`); it lines
    up once that time has come (`line_up_due`) and then goes as any held work."""
    hold(envelope=envelope, queue=queue, reason=DeferReason.SCHEDULED, eligible_at=run_after)


def block(*, account_id: int, queue: str, until: dt.datetime, reason: str = DeferReason.BUDGET_EXHAUSTED) -> None:
    """The account's line on the queue waits until `until` (or later, if it already waits longer),
    for `reason` (one of ACCOUNT_WAITS_REASONS: its budget is spent, its rate limit reached): its
    Backlog row says so (one row by key), which is what every job in the line is shown
    (scheduling.waits); no held row is written."""
    Backlog.objects.filter(account_id=account_id, queue=queue, blocked_until__lt=until).update(
        blocked_until=until, blocked_reason=reason)
    clock.set_alarm(until)  # this process's pulse lets it go then (another process's looks at its next tick)


def unblock(*, account_id: int, queue: str) -> int:
    """The account's line may go again now (its budget was raised); returns 1 when it was held up."""
    return Backlog.objects.filter(account_id=account_id, queue=queue, blocked_until__gt=NOT_BLOCKED).update(
        blocked_until=NOT_BLOCKED)


def unblock_due(now: dt.datetime) -> int:
    """The pulse's tick lets go the lines held up until a time that came (the next budget day, a
    rate limit's window): `ready` asks no time, so that a prepared statement's generic plan reads
    only the lines that could go. Reads only the lines whose time came (index backlog_held_up),
    LINE_UP_BATCH a tick, those no other transaction holds. Returns how many went."""
    with transaction.atomic():
        due = list(Backlog.objects.select_for_update(skip_locked=True)
                   .filter(blocked_until__gt=NOT_BLOCKED, blocked_until__lte=now)
                   .order_by("blocked_until").values_list("pk", flat=True)[:LINE_UP_BATCH])
        return Backlog.objects.filter(pk__in=due).update(blocked_until=NOT_BLOCKED) if due else 0


def next_unblock() -> dt.datetime | None:
    """When the first held-up line's time comes (None: none is): the first of backlog_held_up."""
    return (Backlog.objects.filter(blocked_until__gt=NOT_BLOCKED).order_by("blocked_until")
            .values_list("blocked_until", flat=True).first())


def park(*, message: dict[str, Any], version: int, queue: str) -> DeferredTask:
    """Keep a message of a newer envelope version than this worker speaks, unchanged, until a worker
    that speaks it releases it. Keyed like held work by (job, ref), read as far as this worker can."""
    job, account, ref = message.get("job"), message.get("account"), message.get("ref")
    job = job[:100] if isinstance(job, str) and job else "(newer envelope)"
    if not isinstance(ref, str) or len(ref) > MAX_REF_LENGTH:  # a shape v1 cannot key: its digest
        ref = hashlib.sha256(json.dumps(message, sort_keys=True, default=str).encode()).hexdigest()
    valid_account = type(account) is int and Account.objects.filter(pk=account).exists()
    parked, _ = DeferredTask.objects.update_or_create(
        job=job, ref=ref,
        defaults={"reason": DeferReason.NEEDS_NEWER_WORKER, "envelope_version": version, "message": message,
                  "claimed_by": "", "claim_expires_at": None, "in_line_since": None},
        create_defaults={"account_id": account if valid_account else None, "queue": queue,
                         "reason": DeferReason.NEEDS_NEWER_WORKER, "eligible_at": clock.now(),
                         "envelope_version": version, "message": message},
    )
    return parked


def unhold(*, job: str, ref: str) -> int:
    """Take a job out of the holding area without sending it (its work was cancelled); returns
    how many rows went (0 or 1)."""
    deleted, _ = DeferredTask.objects.filter(job=job, ref=ref).delete()
    return deleted


def ready() -> Q:
    """Backlog rows of accounts whose line could go now: something in line, not held up (a line
    whose time came is let go by the pulse's next tick: `unblock_due`). (Paused accounts are for
    the caller to leave out: scheduling.pausing.)"""
    return Q(lined=True, blocked_until=NOT_BLOCKED)


def in_line(*, account_id: int, queue: str) -> bool:
    """Whether the account has held work in its line on the queue."""
    return Backlog.objects.filter(account_id=account_id, queue=queue, in_line__gt=0).exists()


def claim_held(*, job: str, ref: str, worker: str) -> bool:
    """Whether `worker` still holds its claim on the job (a claim: budgets' statements, through
    budgets/ledger/queries.sql `claim`)."""
    return DeferredTask.objects.filter(job=job, ref=ref, claimed_by=worker).exists()


def unclaim(*, job: str, ref: str, worker: str) -> int:
    """Give back `worker`'s claim on the job: it died before starting it (its pool's sentinel saw
    it die), so the job is claimable again at once, in its place in line. Returns 1 when it held it."""
    return DeferredTask.objects.filter(job=job, ref=ref, claimed_by=worker).update(claimed_by="", claim_expires_at=None)


def release_now(*, deferred_ids: list[int]) -> int:
    """An operator's release: back to the broker now, whatever the reason it was held."""
    with transaction.atomic():
        held = list(DeferredTask.objects.select_for_update(skip_locked=True)
                    .filter(pk__in=deferred_ids, envelope_version__lte=known_version()))
        _send_back(held)
    return len(held)


# How many held jobs whose own time came one tick lines up (the next tick takes the rest).
LINE_UP_BATCH = 1000


def line_up_due(now: dt.datetime) -> tuple[int, int]:
    """Held jobs whose own time came (a back-off ended, a `run_after` passed) join their account's
    line, in the order their times came; account-less ones (scheduled system work) are sent. Reads
    only what is due (index deferred_own_time). Returns how many lined up and how many were sent."""
    with transaction.atomic():
        due = list(DeferredTask.objects.select_for_update(skip_locked=True)
                   .filter(in_line_since__isnull=True, message__isnull=True, eligible_at__lte=now)
                   .order_by("account_id", "queue", "eligible_at")[:LINE_UP_BATCH])
        # One account and queue after another (the order of `due`): their Backlog rows are locked
        # in one order by every process lining up, so two of them never wait for each other.
        lined_up = [task for task in due if task.account_id is not None]
        for task in lined_up:
            DeferredTask.objects.filter(pk=task.pk).update(in_line_since=task.eligible_at)
        _send_back([task for task in due if task.account_id is None])
    return len(lined_up), len(due) - len(lined_up)


def release_due(*, idle_workers: dict[str, int] | None = None) -> int:
    """The pulse's tick (and the `scheduling.release_deferred` schedule's): held-up lines whose time
    came are let go, held jobs whose own time came line up, then the enqueue gates send what may
    go now (the budget gate: the ready accounts' lines into their free slots, for `idle_workers` as
    many as there are idle workers, EnqueueGate.release_due); with no gate, every line that may go
    goes. Messages parked for a version this process speaks go back too. Returns how many went."""
    now = clock.now()
    unblock_due(now)
    _, sent = line_up_due(now)
    sent += release_parked()
    gates = enqueue_gates()
    if gates:
        return sent + sum(gate.release_due(idle_workers=idle_workers) for gate in gates)
    for account_id, queue in Backlog.objects.filter(ready()).values_list("account_id", "queue"):
        with transaction.atomic():  # no gate: no slots, no claims; the line's first jobs go
            first = list(DeferredTask.objects.select_for_update(skip_locked=True).filter(
                account_id=account_id, queue=queue, in_line_since__isnull=False).order_by(*LINE_ORDER)[:LINE_UP_BATCH])
            _send_back(first)
        sent += len(first)
    return sent


def release_parked() -> int:
    """Send back the messages parked for a newer envelope version that this process speaks."""
    with transaction.atomic():
        parked = list(DeferredTask.objects.select_for_update(skip_locked=True)
                      .filter(message__isnull=False, envelope_version__lte=known_version()))
        _send_back(parked)
    return len(parked)


def _send_back(held: list[DeferredTask]) -> None:
    """Take locked rows out of the holding area and ring the doorbell once the caller commits."""
    DeferredTask.objects.filter(pk__in=[task.pk for task in held]).delete()
    send_on_commit_all(held)


def send_on_commit_all(held: list[DeferredTask]) -> None:
    """Ring the doorbell for jobs taken out of the holding area (budgets' `release` statement takes
    a line's first ones) once the caller commits."""
    for task in held:
        # Sent straight to the broker: admission checks it again when it starts.
        if task.message is not None:  # a parked message goes back as it came
            message, queue, name, account = task.message, task.queue, f"{task.job}:{task.ref}", task.account_id
            transaction.on_commit(
                lambda m=message, q=queue, n=name, a=account: send_message(m, queue=q, name=n, account=a))
        else:
            send_on_commit(job=task.job, account=task.account_id, ref=task.ref, priority=task.priority)
