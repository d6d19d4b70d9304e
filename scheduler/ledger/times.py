"""How the ledger keeps times (aware UTC, on both backends) and how it shows them (ISO 8601)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, TypeDecorator
from sqlalchemy.engine import Dialect


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in and out, on both backends.

    SQLite stores datetimes as text without a zone; normalising to UTC on the
    way in keeps the claim's primary key (job_key, scheduled_at) exact.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if isinstance(value, datetime):
            if value.tzinfo is None:
                raise ValueError(f"naive datetime {value!r} in the ledger")
            value = value.astimezone(UTC)
            return value.replace(tzinfo=None) if dialect.name == "sqlite" else value
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        stamp: datetime = value
        if stamp.tzinfo is None:
            return stamp.replace(tzinfo=UTC)
        return stamp.astimezone(UTC)


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()
