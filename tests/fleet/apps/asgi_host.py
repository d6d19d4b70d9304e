"""The FastAPI app of test_in_app_hosts.py, served by `uvicorn --workers 4`: the replica
starts in the lifespan of each worker and its page is mounted under /scheduler. Each
answer says which worker gave it (X-Worker), and `/` whether it is the active replica."""

import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from scheduler import Replica

# The replica's INFO lines in the server's log, each with its worker's pid.
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
replica = Replica(config="config.yaml")


@asynccontextmanager
async def lifespan(app: FastAPI):
    async with replica:
        yield


app = FastAPI(lifespan=lifespan)


@app.middleware("http")
async def worker_header(request: Request, call_next):
    response = await call_next(request)
    response.headers["X-Worker"] = str(os.getpid())
    return response


app.mount("/scheduler", replica.asgi())


@app.get("/")
def home() -> dict[str, object]:
    return {"pid": os.getpid(), "active": replica.active}
