"""The capacity rehearsal: set the budget before raising processes (seed 003).

Replays one realistic backlog — N exports of the dedicated "rehearsal" account, then M small jobs
arriving while they run — against real `qcluster` processes, once per export-worker count, and
compares what each count bought: useful exports per minute, the oldest job's wait, p95 latency,
errors, where the exports' time went (CPU, database wait, storage wait), peak memory per worker and
host load. The stop rule: when one more step of concurrency improves throughput by less than 10%
while the database-wait share grows, stop raising it — more processes will not remove that
bottleneck.

Run it against a scratch database: it creates the account "rehearsal" with its own activity rows
and, before every round, deletes that account's exports, files, task runs, held work and usage
(nothing of any other account). Exports use the configured export storage; e-mail goes to an
in-memory backend, so nobody is notified.

- `plan`: the plan, the account and its rows, the backlog, the reset before each round;
- `round`: one round's workers, backlog and figures;
- `report`: every round, the stop rule's recommendation, the table and the JSON report.
"""
from exports.rehearsal.plan import RehearsalError, RehearsalPlan
from exports.rehearsal.report import MIN_GAIN, Recommendation, recommend, rehearse, table
from exports.rehearsal.round import RoundResult

__all__ = ["MIN_GAIN", "Recommendation", "RehearsalError", "RehearsalPlan", "RoundResult", "recommend", "rehearse",
           "table"]
