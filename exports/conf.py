"""The exports app's FAIRSHARE settings (see scheduling/conf.py for how apps declare them).

Importable before Django is set up (config/settings.py imports it): no django.conf here.
"""
from scheduling.conf import Setting

SETTINGS = (
    Setting("EXPORT_MAX_RANGE_DAYS", "FAIRSHARE_EXPORT_MAX_RANGE_DAYS", 366, parse=int, unit="days",
            doc="longest export range"),
    Setting("EXPORT_MAX_ROWS", "FAIRSHARE_EXPORT_MAX_ROWS", 5_000_000, parse=int, unit="rows",
            doc="most rows an export may hold (checked at request time)"),
    Setting("EXPORT_BATCH_ROWS", "FAIRSHARE_EXPORT_BATCH_ROWS", 10_000, parse=int, unit="rows",
            doc="rows between an attempt's checkpoints (progress, lease renewal, cancellation, deadline "
                "and budget)"),
    Setting("EXPORT_STREAM", "FAIRSHARE_EXPORT_STREAM", "auto",
            doc="`copy` (PostgreSQL `COPY … TO STDOUT`), `cursor` (server-side cursor) or `orm`; "
                "`auto` = `copy`"),
    # The lease is renewed at every checkpoint, so it must outlast the slowest batch; batches are
    # counted in rows and the lease in seconds, so no start-up check can compare them.
    Setting("EXPORT_LEASE_S", "FAIRSHARE_EXPORT_LEASE", 120, parse=int, unit="s",
            doc="how long an export attempt's claim lasts without a checkpoint (renewed every batch): a "
                "dead worker's export is sent again once it expires"),
    Setting("EXPORT_ATTEMPT_DEADLINE_S", "FAIRSHARE_EXPORT_ATTEMPT_DEADLINE", 1500, parse=int, unit="s",
            doc="how long one export attempt may take (checked at checkpoints); below the exports "
                "queue's timeout"),
    Setting("EXPORT_STALE_AFTER_S", "FAIRSHARE_EXPORT_STALE_AFTER", 120, parse=int, unit="s",
            doc="the reconciler sends again a queued export nobody has run or held for this long"),
    Setting("EXPORT_DOWNLOAD_TTL_S", "FAIRSHARE_EXPORT_DOWNLOAD_TTL", 15 * 60, parse=int, unit="s",
            doc="how long a download link lives"),
    Setting("EXPORT_RETENTION_DAYS", "FAIRSHARE_EXPORT_RETENTION_DAYS", 7, parse=int, unit="days",
            doc="days a finished export's file is kept"),
)
