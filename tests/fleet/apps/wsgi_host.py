"""The Flask app of test_in_app_hosts.py, served by `gunicorn -w 4` (gunicorn_host.py):
its page is mounted under /scheduler with werkzeug's DispatcherMiddleware. Each answer
says which worker gave it (X-Worker), and `/` whether it is the active replica."""

import json
import logging
import os

from flask import Flask
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from scheduler import Replica

# The replica's INFO lines in the server's log, each with its worker's pid.
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
replica = Replica(config="config.yaml")


def create_app():
    app = Flask(__name__)

    @app.get("/")
    def home() -> str:
        return json.dumps({"pid": os.getpid(), "active": replica.active})

    app.wsgi_app = DispatcherMiddleware(app.wsgi_app, {"/scheduler": replica.wsgi()})
    return worker_header(app)


def worker_header(app):
    def answer(environ, start_response):
        def start(status, headers, *rest):
            return start_response(status, [*headers, ("X-Worker", str(os.getpid()))], *rest)

        return app(environ, start)

    return answer
