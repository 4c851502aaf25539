"""Procrastinate's side of bench/peers.py, imported in its own virtualenv (var/peers/): the app
and its one no-op task. The worker is `procrastinate --app=procrastinate_app.app worker`."""
import os

import procrastinate

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=os.environ["PEERS_DATABASE_URL"]))


@app.task(name="noop")
def noop() -> None:
    pass
