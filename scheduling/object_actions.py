"""The actions of a change list, offered again as buttons on each record's page (a held job's
page has its "release", an export's its "retry" and "cancel"): an operator who opened one record
acts on it there instead of finding it again in the list.

Each button posts to `<id>/act/<action>/`, which runs the very action the list runs, on a queryset
of that one record: the same role check (budgets.tenancy wraps every action), the same service,
the same messages and admin log entry. The record is found through the admin's own scoped
`get_object`: another account's record is a 404, as a missing one.
"""
from django.contrib import admin
from django.contrib.admin.utils import model_format_dict, quote, unquote
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse

from budgets.tenancy import action_parts

# Deleting has its own link on the page, with Django's confirmation.
NOT_A_BUTTON = {"delete_selected"}


def button(label: str):
    """The words of an action's button on a record's page, where the list's "… selected …" would
    read oddly (a list action without one is shown with its own description)."""
    def mark(func):
        func.button = label
        return func
    return mark


class ObjectActionsAdmin(admin.ModelAdmin):
    change_form_template = "admin/object_actions_change_form.html"

    def get_urls(self):
        name = f"{self.opts.app_label}_{self.opts.model_name}_act"
        return [path("<path:object_id>/act/<str:action>/", self.admin_site.admin_view(self.object_action_view), name=name),
                *super().get_urls()]

    def object_actions(self, request, obj) -> list[tuple[str, str]]:
        """(name, words) of the list's actions this user may run that apply to `obj` now."""
        return [(name, getattr(func, "button", None) or str(description) % model_format_dict(self.opts))
                for name, (func, _, description) in ((n, action_parts(a)) for n, a in self.get_actions(request).items())
                if name not in NOT_A_BUTTON and self.object_action_applies(obj, name)]

    def object_action_applies(self, obj, name: str) -> bool:
        """Whether action `name` has a button on `obj`'s page (no "retry" on a succeeded export). Only
        what is offered: the action's service still decides, under its lock, as from the list."""
        return True

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        context["object_actions"] = [] if obj is None else self.object_actions(request, obj)
        return super().render_change_form(request, context, add=add, change=change, form_url=form_url, obj=obj)

    def object_action_view(self, request, object_id: str, action: str):
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        obj = self.get_object(request, unquote(object_id))
        actions = self.get_actions(request)
        if obj is None or action not in actions or action in NOT_A_BUTTON:
            raise Http404("No such record or action.")
        func = action_parts(actions[action])[0]
        response = func(self, request, self.get_queryset(request).filter(pk=obj.pk))
        if response is not None:
            return response
        info = self.opts.app_label, self.opts.model_name
        if self.get_queryset(request).filter(pk=obj.pk).exists():  # still here (a retried export): its page
            return HttpResponseRedirect(reverse("admin:%s_%s_change" % info, args=[quote(obj.pk)]))
        return HttpResponseRedirect(reverse("admin:%s_%s_changelist" % info))  # gone (a released job)
