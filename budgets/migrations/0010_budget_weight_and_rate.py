"""Weights and rate limits on budgets (tiered fair share). Existing budgets get their plan tier's
weight as budgets/conf.py gives it on the day of this migration (free 1, standard 2, enterprise 4);
none gets a rate limit it did not have (an operator sets one in the admin, new accounts get their
tier's)."""
from django.db import migrations, models

WEIGHTS = {"free": 1, "standard": 2, "enterprise": 4}


def weigh_by_plan(apps, schema_editor):
    Budget = apps.get_model("budgets", "Budget")
    for plan, weight in WEIGHTS.items():
        Budget.objects.filter(account__plan=plan).update(weight=weight)


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0009_reservation_age_and_lease'),
    ]

    operations = [
        migrations.AddField(
            model_name='budget',
            name='rate_period_s',
            field=models.PositiveIntegerField(default=60, help_text="The rate limit's window, in seconds"),
        ),
        migrations.AddField(
            model_name='budget',
            name='rate_starts',
            field=models.PositiveIntegerField(blank=True, help_text='At most this many runs start per rate period; empty: no rate limit', null=True),
        ),
        migrations.AddField(
            model_name='budget',
            name='weight',
            field=models.PositiveSmallIntegerField(default=1, help_text="Its share of busy workers against other accounts' (1 or more): weight 3 gets three times the worker time of weight 1 when both wait"),
        ),
        migrations.AddConstraint(
            model_name='budget',
            constraint=models.CheckConstraint(condition=models.Q(('rate_period_s__gte', 1), ('weight__gte', 1)), name='budget_weight_and_rate_period_positive'),
        ),
        migrations.RunPython(weigh_by_plan, migrations.RunPython.noop),
    ]
