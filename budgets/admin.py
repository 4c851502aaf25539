from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django.http import Http404
from django.shortcuts import render
from django.utils import timezone
from django.utils.html import format_html_join

from budgets.adjust import budget_adjust
from budgets.models import Account, ApiToken, Budget, BudgetAdjustment, Membership, Reservation, Role, UsageDay
from budgets.selectors import budget_status
from budgets.tenancy import (ROLE_RANK, AccountInline, AccountScopedAdmin, ReadOnlyAdmin, accounts_with_role,
                             action_role, users_visible_to)
from scheduling.admin_display import LabelledAdmin
from scheduling.charts import burn_down
from scheduling.operator import message_results
from scheduling.holding import unblock
from scheduling.pausing import pause, resume

# The ledger's words, as a person reads them on its records' pages and lists.
TIMES = {"wall_ms": "wall time (ms)", "db_wait_ms": "database wait (ms)", "storage_wait_ms": "storage wait (ms)"}
CPU_A_DAY = {"cpu_seconds_per_day": "CPU seconds a day"}


class MembershipInline(AccountInline):
    model = Membership
    extra = 0


class BudgetInline(AccountInline):
    model = Budget
    extra = 0


@admin.register(Account)
class AccountAdmin(AccountScopedAdmin):
    account_path = "pk"
    list_display = ["slug", "name", "plan", "is_active", "budget_today"]
    list_filter = ["plan", "is_active"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline, BudgetInline]
    actions = ["pause_accounts", "resume_accounts"]

    @admin.action(description="Pause: hold the selected accounts' new work")
    @action_role(Role.OPERATOR)
    def pause_accounts(self, request, queryset):
        message_results(self, request, [pause(user=request.user, account=account) for account in queryset])

    @admin.action(description="Resume: release the selected accounts' paused work")
    @action_role(Role.OPERATOR)
    def resume_accounts(self, request, queryset):
        message_results(self, request, [resume(user=request.user, account=account) for account in queryset])

    def has_add_permission(self, request):
        return request.user.is_superuser  # a new tenant is the platform's decision

    def changelist_view(self, request, extra_context=None):
        # The page's accounts' status in a few queries (not one per row, nor one per account that
        # exists): the response renders later, once the page is known.
        response = super().changelist_view(request, extra_context)
        page = getattr(response, "context_data", {}).get("cl")
        self._status = {}
        if page is not None:
            for row in budget_status(accounts=Account.objects.filter(pk__in=[a.pk for a in page.result_list])):
                self._status.setdefault(row.account, []).append(row)
        return response

    @admin.display(description="today's CPU per queue (used, reserved, limit) and work")
    def budget_today(self, obj):
        rows = getattr(self, "_status", {}).get(obj.slug, [])
        return format_html_join(
            "", '<div class="budget-row">{} {} {}: {} / {} s used, {} s reserved; {}/{} running, {} sent, {} held; '
                'weight {}{}</div>',
            ((burn_down(used=r.cpu_used_ms, reserved=r.cpu_reserved_ms, limit=r.cpu_limit_ms), r.queue,
              f"({round(100 * r.cpu_used_ms / r.cpu_limit_ms) if r.cpu_limit_ms else 0}%)",
              round(r.cpu_used_ms / 1000, 1), r.cpu_limit_ms // 1000, round(r.cpu_reserved_ms / 1000, 1),
              r.running, r.max_concurrent, r.sent, r.held, r.weight,
              f"; rate {r.rate}" + (" (reached)" if r.rate_full else "") if r.rate else "") for r in rows),
        ) or "—"


class MembershipForm(forms.ModelForm):
    """An owner grants at most the role they hold in the account (SPEC §3)."""

    class Meta:
        model = Membership
        fields = ["user", "account", "role"]

    def clean(self):
        data = super().clean()
        user, account, role = self.granted_by, data.get("account"), data.get("role")
        if account is not None and role and not user.is_superuser:
            held = Membership.objects.filter(user=user, account=account).values_list("role", flat=True).first()
            if held is None or ROLE_RANK[role] > ROLE_RANK[held]:
                self.add_error("role", "You cannot grant a role above your own in this account.")
        return data


@admin.register(Membership)
class MembershipAdmin(AccountScopedAdmin):
    form = MembershipForm
    list_display = ["user", "account", "role", "created_at"]
    list_filter = ["role", "account"]
    search_fields = ["user__username", "user__email", "account__slug"]

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)
        form.granted_by = request.user
        return form


class AdjustForm(forms.Form):
    cpu_seconds_per_day = forms.IntegerField(min_value=0, label="CPU seconds per day")
    today_only = forms.BooleanField(required=False, initial=True, label="For today only (back at the next budget day)")


@admin.register(Budget)
class BudgetAdmin(LabelledAdmin, AccountScopedAdmin):
    """An account's limits on one queue: its plan tier's (budgets/conf.py PLAN_BUDGETS) until an
    operator changes them here. The daily CPU budget changes through the adjust action (kept as its
    history); the cap, the weight and the rate limit in the form."""

    list_display = ["account", "queue", "cpu_seconds_per_day", "max_concurrent", "weight", "rate_limit"]
    labels = {**CPU_A_DAY, "max_concurrent": "concurrency cap", "rate_starts": "rate limit: starts",
              "rate_period_s": "rate limit: window (s)"}
    list_filter = ["queue", "account"]
    actions = ["adjust"]

    @admin.display(description="rate limit")
    def rate_limit(self, obj):
        return "—" if obj.rate_starts is None else f"{obj.rate_starts} starts per {obj.rate_period_s} s"

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        if change and {"rate_starts", "rate_period_s", "max_concurrent"} & set(form.changed_data):
            # A line held up by the old limits may go now: the next look under the lock (the
            # pulse's, a pull's) sees the new ones and holds it up again if it must.
            unblock(account_id=obj.account_id, queue=obj.queue)

    @admin.action(description="Adjust the daily CPU budget (today only or for good)")
    def adjust(self, request, queryset):
        form = AdjustForm(request.POST if "apply" in request.POST else None)
        if form.is_valid():
            message_results(self, request, [
                budget_adjust(user=request.user, budget_id=budget.pk, today_only=form.cleaned_data["today_only"],
                              cpu_seconds_per_day=form.cleaned_data["cpu_seconds_per_day"]) for budget in queryset])
            return None
        return render(request, "admin/budgets/adjust.html", {
            **self.admin_site.each_context(request), "title": "Adjust budgets", "form": form, "budgets": queryset,
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME), "opts": self.model._meta,
        })


@admin.register(BudgetAdjustment)
class BudgetAdjustmentAdmin(LabelledAdmin, ReadOnlyAdmin):
    account_path = "budget__account"
    labels = {**CPU_A_DAY, "previous_cpu_seconds": "previous CPU seconds a day", "until_day": "until (budget day)",
              "ended_at": "ended", "adjusted_by": "adjusted by", "created_at": "adjusted"}
    list_display = ["budget", "previous_cpu_seconds", "cpu_seconds_per_day", "until_day", "ended_at", "adjusted_by",
                    "created_at"]
    list_filter = ["until_day"]


@admin.register(ApiToken)
class ApiTokenAdmin(AccountScopedAdmin):
    """Each person issues their own tokens, for an account they belong to, and sees the raw token
    once; the account's owners see and revoke its tokens. Revoked tokens are kept, marked."""

    list_display = ["name", "user", "account", "hint", "created_at", "expires_at", "last_used_at", "revoked_at",
                    "revoked_by"]
    list_filter = ["account"]
    fields = ["account", "name", "expires_at", "user", "hint", "created_at", "last_used_at", "revoked_at",
              "revoked_by"]
    readonly_fields = ["user", "hint", "created_at", "last_used_at", "revoked_at", "revoked_by"]
    actions = ["revoke"]
    write_role = Role.VIEWER  # anyone may issue a token for themselves (it acts with their own role)

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        return qs.filter(user=request.user) | qs.filter(account__in=accounts_with_role(user=request.user,
                                                                                       role=Role.OWNER))

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # revoked, never deleted: the record says who used what

    def has_revoke_permission(self, request):
        return request.user.has_perm("budgets.change_apitoken") and self.has_role(request, Role.VIEWER)

    def save_model(self, request, obj, form, change):
        token, raw = ApiToken.issue(user=request.user, account=obj.account, name=obj.name, expires_at=obj.expires_at)
        obj.pk = token.pk
        self.message_user(request, f"Token created. Copy it now, it is not shown again: {raw}", messages.WARNING)

    @admin.action(description="Revoke selected tokens", permissions=["revoke"])
    @action_role(Role.VIEWER)
    def revoke(self, request, queryset):
        # Own tokens, or any of an account one owns (get_queryset); already revoked ones stay as they were.
        for token in queryset.filter(revoked_at__isnull=True):
            ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
                revoked_at=timezone.now(), revoked_by=request.user)
            self.log_change(request, token, "Revoked")
            self.message_user(request, f"Revoked {token}.", messages.SUCCESS)


@admin.register(UsageDay)
class UsageDayAdmin(LabelledAdmin, ReadOnlyAdmin):
    labels = {"day": "budget day", "cpu_used_ms": "CPU used (ms)", "cpu_reserved_ms": "CPU reserved (ms)", **TIMES,
              "deferrals": "times held", "cap_hits": "stopped at the cap"}
    help_texts = {"cpu_used_ms": "CPU its runs were charged: what the daily CPU budget counts",
                  "cpu_reserved_ms": "Reserved by jobs running now, charged when they settle",
                  "deferrals": "How often its jobs were held in the holding area this day",
                  "cap_hits": "Runs stopped because the daily CPU budget ran out"}
    list_display = ["day", "account", "queue", "cpu_used_ms", "cpu_reserved_ms", "wall_ms", "db_wait_ms",
                    "storage_wait_ms", "runs", "deferrals", "cap_hits"]
    list_filter = ["queue", "account"]
    date_hierarchy = "day"


@admin.register(Reservation)
class ReservationAdmin(LabelledAdmin, ReadOnlyAdmin):
    labels = {"ref": "reference", "task_run": "task run", "cpu_reserved_ms": "CPU reserved (ms)",
              "cpu_reported_ms": "CPU reported (ms)", "cpu_charged_ms": "CPU charged (ms)", "carried_runs": "runs carried",
              "carried_cpu_ms": "CPU carried (ms)", "carried_wall_ms": "wall time carried (ms)",
              "carried_db_wait_ms": "database wait carried (ms)", "carried_storage_wait_ms": "storage wait carried (ms)",
              "carried_since": "carried since", "created_at": "created", "lease_expires_at": "lease expires"}
    help_texts = {"cpu_reserved_ms": "The job's CPU estimate, held against its account's daily budget while it runs",
                  "carried_runs": "Runs this slot was passed on from whose use its day's ledger has not been charged "
                                  "yet (charged when the slot ends)",
                  "lease_expires_at": "Reclaimed after this if its worker stops renewing it"}
    list_display = ["job", "ref", "account", "queue", "status", "cpu_reserved_ms", "cpu_reported_ms", "worker",
                    "created_at", "lease_expires_at"]
    list_filter = ["status", "queue", "account"]


# People: staff see the users they share an account with, and change none (superusers manage
# logins, staff flags and permissions); groups are the superusers' alone.
admin.site.unregister(get_user_model())
admin.site.unregister(Group)


class SuperuserWrites:
    """People and groups are the platform's: only superusers add, change or delete them."""

    def has_add_permission(self, request):
        return request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_superuser

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser


@admin.register(get_user_model())
class ScopedUserAdmin(SuperuserWrites, UserAdmin):
    def get_queryset(self, request):
        return users_visible_to(user=request.user) if not request.user.is_superuser else super().get_queryset(request)

    def get_list_filter(self, request):
        return super().get_list_filter(request) if request.user.is_superuser else ["is_active"]

    def _get_obj_does_not_exist_redirect(self, request, opts, object_id):
        raise Http404("No user with this id.")


@admin.register(Group)
class SuperuserGroupAdmin(SuperuserWrites, GroupAdmin):
    def has_module_permission(self, request):
        return request.user.is_superuser

    def has_view_permission(self, request, obj=None):
        return request.user.is_superuser
