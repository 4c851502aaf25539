"""Account scoping: who may act for which account, and the admin bases that show a tenant only
its own records. The lowest layer with budgets.models: every app may import it.

Roles (SPEC §3): viewers see; operators act on work; owners also manage members, budgets and API
tokens. Only superusers see across accounts. Every way into the admin is scoped here, once:
change lists and object URLs (another account's object is a 404, like a missing one), foreign-key
and many-to-many choices (so a submitted id of another account fails form validation), account
list filters, action querysets, and add/change/delete permissions by role.
"""
import dataclasses
import functools

from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import Http404

from budgets.models import Account, Membership, Role

# A role includes every role ranked below it.
ROLE_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.OWNER: 3}


def roles_at_least(role: str) -> list[str]:
    return [r for r, rank in ROLE_RANK.items() if rank >= ROLE_RANK[role]]


def membership_of(*, user, account: Account) -> Membership | None:
    if user is None or not user.is_authenticated:
        return None
    return Membership.objects.filter(user=user, account=account).first()


def can_export(*, user, account: Account) -> bool:
    """Superusers may export any account; others need an exporting role in it."""
    if user is None or not user.is_active:
        return False
    if user.is_superuser:
        return True
    membership = membership_of(user=user, account=account)
    return membership is not None and membership.can_export


def accounts_with_role(*, user, role: str = Role.VIEWER) -> QuerySet[Account]:
    """The accounts `user` holds at least `role` in (every account for a superuser)."""
    if user is None or not user.is_authenticated or not user.is_active:
        return Account.objects.none()
    if user.is_superuser:
        return Account.objects.all()
    return Account.objects.filter(memberships__user=user, memberships__role__in=roles_at_least(role))


def accounts_visible_to(*, user) -> QuerySet[Account]:
    return accounts_with_role(user=user, role=Role.VIEWER)


def users_visible_to(*, user):
    """Users who share an account with `user` (all users for a superuser)."""
    User = get_user_model()
    if user.is_superuser:
        return User.objects.all()
    return User.objects.filter(memberships__account__in=accounts_visible_to(user=user)).distinct()


def _account_relation(model, path: str | None) -> bool:
    """Whether `path` on `model` leads to budgets.Account (a relation to filter by account)."""
    if path is None:
        return False
    field = None
    for part in path.split("__"):
        field = model._meta.get_field(part)
        if not field.is_relation:
            return False
        model = field.related_model
    return model is Account


class AccountListFilter(admin.RelatedFieldListFilter):
    """The account filter offers only the accounts the user may see (no other account's slug)."""

    def field_choices(self, field, request, model_admin):
        return [(a.pk, str(a)) for a in accounts_visible_to(user=request.user)]


def action_role(role: str):
    """Mark an admin action with the least role it needs on each selected record's account."""
    def mark(func):
        func.required_role = role
        return func
    return mark


class AccountScopedAdmin(admin.ModelAdmin):
    """Staff who are not superusers see only the records of accounts they belong to (nothing at
    all of models with no account, `account_path = None`), and change them only with `write_role`
    in the record's account. Django's model permissions are needed as well, never instead."""

    account_path: str | None = "account"
    write_role: str = Role.OWNER

    # --- what a user sees -----------------------------------------------------------------
    def get_queryset(self, request):
        return self.scope(request, super().get_queryset(request))

    def scope(self, request, queryset: QuerySet, role: str = Role.VIEWER) -> QuerySet:
        if request.user.is_superuser:
            return queryset
        if self.account_path is None:
            return queryset.none()
        return queryset.filter(**{f"{self.account_path}__in": accounts_with_role(user=request.user, role=role)})

    def _get_obj_does_not_exist_redirect(self, request, opts, object_id):
        # Another account's object is answered exactly like a missing one: 404, no redirect.
        raise Http404(f"No {opts.verbose_name} with this id.")

    def get_list_filter(self, request):
        return [(entry, AccountListFilter) if isinstance(entry, str) and _account_relation(self.model, entry)
                else entry for entry in super().get_list_filter(request)]

    # --- what a form offers and accepts -------------------------------------------------------
    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if not request.user.is_superuser and "queryset" not in kwargs:
            kwargs["queryset"] = self.related_choices(request, db_field)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def formfield_for_manytomany(self, db_field, request, **kwargs):
        if not request.user.is_superuser and "queryset" not in kwargs:
            kwargs["queryset"] = self.related_choices(request, db_field)
        return super().formfield_for_manytomany(db_field, request, **kwargs)

    def related_choices(self, request, db_field) -> QuerySet:
        """What a relation may point at: accounts the user may write to, people who share an
        account with them, or records of their accounts. A submitted id outside it is invalid."""
        related = db_field.related_model
        if related is Account:
            return accounts_with_role(user=request.user, role=self.write_role)
        if related is get_user_model():
            return users_visible_to(user=request.user)
        path = next((f.name for f in related._meta.get_fields()
                     if f.is_relation and f.many_to_one and f.related_model is Account), None)
        if path is None:
            return related._default_manager.none()
        return related._default_manager.filter(**{f"{path}__in": accounts_visible_to(user=request.user)})

    # --- what a user may do -------------------------------------------------------------------
    def has_role(self, request, role: str, obj=None) -> bool:
        """`role` in `obj`'s account, or (no obj) in any account."""
        if request.user.is_superuser:
            return True
        if self.account_path is None:
            return False
        if obj is None:
            return accounts_with_role(user=request.user, role=role).exists()
        return self.scope(request, self.model._default_manager.filter(pk=obj.pk), role).exists()

    def has_view_permission(self, request, obj=None):
        return super().has_view_permission(request, obj) and self.has_role(request, Role.VIEWER, obj)

    def has_add_permission(self, request):
        return super().has_add_permission(request) and self.has_role(request, self.write_role)

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and self.has_role(request, self.write_role, obj)

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and self.has_role(request, self.write_role, obj)

    def get_actions(self, request, action_location=None):
        """Every action role-checked. Django 6.1 gives `Action` objects for a location (its default
        when None), 5.2 LTS (func, name, description) tuples."""
        actions = super().get_actions(request, *(() if action_location is None else (action_location,)))
        return {name: self._role_checked_action(action) for name, action in actions.items()}

    def _role_checked_action(self, action):
        if isinstance(action, tuple):
            func, name, description = action
            return self._role_checked(func), name, description
        return dataclasses.replace(action, func=self._role_checked(action.func))

    def _role_checked(self, func):
        """Run the action on the selected records whose account the user holds its role in
        (`action_role`, else `write_role`); say how many were left alone."""
        role = getattr(func, "required_role", self.write_role)

        @functools.wraps(func)
        def action(modeladmin, request, queryset):
            allowed = self.scope(request, queryset, role)
            refused = queryset.count() - allowed.count()
            if refused:
                self.message_user(request, f"{refused} selected record(s) left alone: that needs the {role} "
                                           "role in their account.", messages.ERROR)
                if not allowed.exists():
                    return None
            return func(modeladmin, request, allowed)
        return action


def action_parts(action) -> tuple:
    """(func, name, description) of one of get_actions()'s values: an `Action` on Django 6.1, a
    tuple on 5.2 LTS."""
    return action if isinstance(action, tuple) else (action.func, action.name, action.description)


class ReadOnlyAdmin(AccountScopedAdmin):
    """For records the system writes (task runs, attempts): inspect, never edit by hand."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser


class AccountInline(admin.TabularInline):
    """An inline of an account's page (members, budgets): editable only by the account's owners."""

    def _owner(self, request, obj) -> bool:
        return request.user.is_superuser or (
            obj is not None and accounts_with_role(user=request.user, role=Role.OWNER).filter(pk=obj.pk).exists())

    def has_add_permission(self, request, obj=None):
        return super().has_add_permission(request, obj) and self._owner(request, obj)

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and self._owner(request, obj)

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and self._owner(request, obj)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.related_model is get_user_model() and not request.user.is_superuser:
            kwargs["queryset"] = users_visible_to(user=request.user)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)
