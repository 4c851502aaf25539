"""django-tasks-db's no-op task for bench/peers.py."""
from django_tasks import task


@task()
def noop() -> None:
    pass
