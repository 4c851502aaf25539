"""How the admins of every app write what a person reads: a long id in short (its full value on
hover and on the record's page), a held job's "eligible from" time, what a run's outcome means."""
import datetime as dt

from django.contrib import admin
from django.contrib.admin.utils import display_for_field
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince, timeuntil

from budgets.models import Budget
from scheduling.models import Outcome
from scheduling.waits import HoldShown

SHORT_ID = 8  # a UUID's first 8 hex digits: unique enough to tell the rows of a page apart


def short_id(value) -> SafeString | str:
    """The first SHORT_ID characters of a long id, the whole of it on hover."""
    text = "" if value is None else str(value)
    if len(text) <= SHORT_ID + 1:
        return text or "—"
    return format_html('<span class="short-id" title="{}">{}…</span>', text, text[:SHORT_ID])


def eligible_from(shown: HoldShown, *, now: dt.datetime) -> str:
    """One time, with how far away it is: "2026-12-05 00:00 UTC (in 6 hours)"; or, with no time
    known, what the job waits for ("when a worker is free"); a time gone by reads as due now."""
    if shown.eligible_from is None:
        return f"when {shown.waits_for}"
    at = f"{shown.eligible_from:%Y-%m-%d %H:%M} UTC"
    if shown.eligible_from <= now:
        return f"now (due since {at}, {timesince(shown.eligible_from, now)} ago)"
    return f"{at} (in {timeuntil(shown.eligible_from, now)})"


# What each outcome means to an operator, beside its name on a run's page.
OUTCOME_MEANS = {
    Outcome.RUNNING: "It has not finished yet.",
    Outcome.SUCCEEDED: "It did its work.",
    Outcome.SKIPPED: "Nothing to do (a duplicate delivery, or the work was already done): harmless.",
    Outcome.FAILED: "It failed for good; its error is below.",
    Outcome.RETRYING: "It failed with an error worth another try: the job waits in the holding area for its back-off.",
    Outcome.CANCELLED: "An operator or the requester cancelled it.",
    Outcome.REJECTED: "Its message was unusable (malformed, unknown job or version): nothing ran.",
    Outcome.DEFERRED: "It may not run now (budget, concurrency cap, rate limit): the job waits in the holding area.",
    Outcome.BUDGET_EXHAUSTED: "Its account's daily CPU budget on this queue ran out during the run, which stopped "
                              "cleanly; the job waits in the holding area for the next budget day (or a larger budget).",
    Outcome.LOST: "Its worker died mid-run; its reservation and slot were reclaimed once its lease expired.",
    Outcome.SLOT_LOST: "Its slot was reclaimed while its worker was frozen; the job waits in the holding area again.",
}


def outcome_explained(run) -> SafeString:
    """A run's outcome, what it means, and for a budget outcome a link to that budget."""
    means = format_html("<strong>{}</strong>: {}", run.get_outcome_display(), OUTCOME_MEANS.get(run.outcome, ""))
    if run.outcome not in (Outcome.BUDGET_EXHAUSTED, Outcome.DEFERRED) or run.account_id is None:
        return means
    budget = Budget.objects.filter(account_id=run.account_id, queue=run.queue).values_list("pk", flat=True).first()
    if budget is None:
        return means
    return format_html('{} <a class="budget-link" href="{}">{}\'s {} budget</a>', means,
                       reverse("admin:budgets_budget_change", args=[budget]), run.account, run.queue)


def short_time(value: dt.datetime | None, *, now: dt.datetime | None = None) -> SafeString | str:
    """A time in a narrow column: "17:43:02" today, "2026-12-03 17:43" before (UTC), the whole of
    it on hover (Django's "Dec. 4, 2026, 5:43 p.m." takes a column's width of its own)."""
    if value is None:
        return "—"
    now = now or timezone.now()
    value = value.astimezone(dt.UTC)
    text = f"{value:%H:%M:%S}" if value.date() == now.astimezone(dt.UTC).date() else f"{value:%Y-%m-%d %H:%M}"
    return format_html('<span class="short-time" title="{}">{}</span>', f"{value:%Y-%m-%d %H:%M:%S} UTC", text)


class LabelledAdmin(admin.ModelAdmin):
    """Human labels and help texts for a record's fields ("CPU used (ms)", not "Cpu used ms"), on
    its page and as its list's column headers, set in the admin: a model's wording changed in the
    model is a migration per wording, for a table other work also migrates."""

    labels: dict[str, str] = {}
    help_texts: dict[str, str] = {}

    def get_form(self, request, obj=None, **kwargs):
        # A view-only page shows each field as a read-only one, which takes its label and help
        # text from the form's Meta (django.contrib.admin.helpers.AdminReadonlyField).
        kwargs.setdefault("labels", self.labels)
        kwargs.setdefault("help_texts", self.help_texts)
        return super().get_form(request, obj, **kwargs)

    def get_list_display(self, request):
        return [self._labelled(name) if isinstance(name, str) and name in self.labels else name
                for name in super().get_list_display(request)]

    def _labelled(self, name: str):
        field = self.model._meta.get_field(name)

        @admin.display(description=self.labels[name], ordering=name)
        def column(obj):
            return display_for_field(getattr(obj, name), field, self.get_empty_value_display())
        column.__name__ = name  # the column's CSS class, as for the field itself
        return column
