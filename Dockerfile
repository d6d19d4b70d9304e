# The image a fleet deploys: one replica per container, N containers.
FROM python:3.11-slim
LABEL org.opencontainers.image.title="fleet-scheduler"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The distribution first, from this checkout (fleet-scheduler: the package and the
# command `scheduler`; its dependencies change rarely), then the jobs and their
# schedules, which a deployment may replace with a mount at /app/jobs and
# /app/config.yaml.
COPY pyproject.toml README.md ./
COPY scheduler ./scheduler
RUN pip install . \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin scheduler \
    && chown scheduler /app
COPY --chown=scheduler config.yaml ./config.yaml
COPY --chown=scheduler jobs ./jobs

USER scheduler
ENV SCHEDULER_CONFIG=/app/config.yaml \
    SCHEDULER_HTTP_HOST=0.0.0.0 \
    SCHEDULER_HTTP_PORT=8080 \
    SCHEDULER_LOG_FORMAT=json
EXPOSE 8080

HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]

# SIGTERM: no new runs, wait up to SCHEDULER_SHUTDOWN_GRACE (30 s), release every lock.
STOPSIGNAL SIGTERM
CMD ["scheduler", "run"]
