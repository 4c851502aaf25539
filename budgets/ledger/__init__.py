"""The usage ledger and the slots: every change to them is one transition of a slot, a function of
this package (call them as `ledger.<transition>`, `from budgets import ledger`).

A slot is a Reservation row; its states and the one transition that moves it between them:

    (a job held)                                             (none)
        | claim_for (claim_next, fetch_next)                   | dispatch / dispatch_or_hold (enqueue)
        v                                                      v
    ACTIVE on a claim's lease (admitted ahead)                 DISPATCHED ── activate (admission) ──> ACTIVE
    ACTIVE on a claim's lease ── start_admitted ──>  ACTIVE (running; the watcher renews its lease)
    (a line's first held jobs) ── release (to the broker, sent once committed) ──> DISPATCHED
    ACTIVE ── charge (settlement; may pass the slot on: a new ACTIVE one for the next held job,
              which may carry the run's charge on: see budgets.ledger.settling) ──> (deleted)
    ACTIVE ── reclaim (lease expired: charged what it reported) ──> RECLAIMED ── charge of the rest ──> (deleted)
    RECLAIMED ── revive (its worker was only frozen, and a slot is free) ──> ACTIVE
    DISPATCHED ── undispatch (send failed) / drop (held again) / reclaim (message lost) ──> (deleted)
    ACTIVE on a claim's lease ── unadmit (never started) ──> (deleted)
    ACTIVE ── renew (lease, CPU reported), grow (more CPU) ──> ACTIVE

Whatever ends a slot (charge, reclaim, unadmit) also charges what it carried: the figures of the
runs it was passed on from, whose CPU its day still holds as reserved.

By module: reads (the lock, the standing, the fair order), admitting (a slot dispatched or
admitted, or given back before its run), settling (a running slot's lease, and its end); one named
statement of queries.sql a transition. All run under the account's lock (budgets.locks) but three
that still cannot pass a cap (their modules say why): the charge, its pass-on, `admit_at_once`.
"""
from budgets.ledger.admitting import (
    activate, admit_at_once, claim_for, dispatch, dispatch_many, dispatch_or_hold, drop, redispatch, release,
    reserve_more, start_admitted, unadmit, undispatch,
)
from budgets.ledger.reads import (
    IN_FLIGHT, broker_waiting, idle_workers, lock, ready_accounts, standing, usage_id,
)
from budgets.ledger.settling import charge, grow, reclaim, renew, revive
from budgets.ledger.values import AdmittedAtOnce, Charged, Claimed, EnqueueCheck, PassOn, Ready

__all__ = [
    "IN_FLIGHT", "AdmittedAtOnce", "Charged", "Claimed", "EnqueueCheck", "PassOn", "Ready", "activate", "admit_at_once",
    "broker_waiting", "charge", "claim_for", "dispatch", "dispatch_many", "dispatch_or_hold", "drop", "grow",
    "idle_workers", "lock", "ready_accounts", "reclaim", "redispatch", "release", "renew", "reserve_more",
    "revive", "standing", "start_admitted", "unadmit", "undispatch", "usage_id",
]
