"""Backends: where locks and ledger rows live. PostgreSQL for a fleet; SQLite for one host."""

from __future__ import annotations

from pathlib import Path

from scheduler.backends.base import Backend
from scheduler.config.settings import Settings

EMBEDDED_FILE = "scheduler.db"


def embedded_path(settings: Settings) -> Path:
    """The embedded ledger sits beside config.yaml."""
    return settings.config.resolve().parent / EMBEDDED_FILE


def open_backend(settings: Settings) -> Backend:
    if settings.database_url is None:
        from scheduler.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(
            embedded_path(settings),
            instance=settings.instance_name,
            namespace=settings.namespace,
        )
    from scheduler.backends.postgres import PostgresBackend

    return PostgresBackend(
        settings.database_url.get_secret_value(),
        instance=settings.instance_name,
        namespace=settings.namespace,
        holder_timeout=settings.holder_timeout,
        schema=settings.schema_name,
    )


__all__ = ["Backend", "embedded_path", "open_backend"]
