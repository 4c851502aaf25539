"""The fair-share view (/admin/fairshare/): who is using the workers right now, and who waits,
why and for how long (budgets.fairshare), with the operator actions one click away.

Scoped like the dashboard and the admin: a superuser sees every account, anyone else only the
accounts they are a member of (budgets.tenancy). The table is also served on its own
(/admin/fairshare/table/): as the HTML fragment the page's script fetches every few seconds, and
with `?format=json` for scripts.
"""
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils import timezone

from budgets.fairshare import MAX_TOP, TOP, WINDOWS_S, fair_share_now
from budgets.tenancy import accounts_visible_to
from scheduling.charts import burn_down
from scheduling.dashboard import refresh_s
from scheduling.waits import wait_text

SEARCH_MAX_CHARS = 100


def _query(request) -> tuple[str, int]:
    search = request.GET.get("q", "").strip()[:SEARCH_MAX_CHARS]
    try:
        top = min(max(int(request.GET.get("top", TOP)), 1), MAX_TOP)
    except ValueError:
        top = TOP
    return search, top


def _table(request, search: str, top: int) -> dict:
    now = timezone.now()
    rows = fair_share_now(accounts=accounts_visible_to(user=request.user), superuser=request.user.is_superuser,
                          search=search, top=top, now=now)
    return {"rows": rows, "now": now, "search": search, "top": top, "windows": [w // 60 for w in WINDOWS_S],
            "cells": [_cells(row, now) for row in rows]}


def _cells(row, now) -> dict:
    s = row.status
    return {
        "row": row,
        "shares": [(row.share(w), row.busy_s.get(w, 0.0) / w) for w in WINDOWS_S],
        "burn_down": burn_down(used=s.cpu_used_ms // 1000, reserved=s.cpu_reserved_ms // 1000,
                               limit=s.cpu_limit_ms // 1000, unit="CPU s"),
        "oldest_wait_s": row.oldest_wait_s(now),
        "cpu_used_s": s.cpu_used_ms / 1000, "cpu_limit_s": s.cpu_limit_ms / 1000,
        "reasons": [(reason.replace("_", " "), n) for reason, n in
                    sorted(row.held_by_reason.items(), key=lambda item: -item[1])],
        "oldest_reason": (wait_text(row.line_wait, now) if row.line_wait is not None
                          and row.oldest_held_reason == row.line_wait.reason else row.oldest_held_reason.replace("_", " ")),
    }


@staff_member_required
def fair_share(request):
    search, top = _query(request)
    table = _table(request, search, top)
    from django.contrib import admin  # the site's header, user links and theme

    return render(request, "admin/fairshare.html", {
        **admin.site.each_context(request), "title": "Fair share now", "refresh_s": refresh_s(request),
        "table_html": render_to_string("admin/ops/fairshare_table.html", table, request=request), **table})


@staff_member_required
def fair_share_table(request):
    search, top = _query(request)
    table = _table(request, search, top)
    if request.GET.get("format") == "json":
        return JsonResponse({"generated_at": table["now"].isoformat(), "search": search, "top": top,
                             "rows": [row.as_json(table["now"]) for row in table["rows"]]})
    return HttpResponse(render_to_string("admin/ops/fairshare_table.html", table, request=request))
