"""Settings and config.yaml: everything a replica is told, validated strictly.

A leaf module: no database code. Settings come from pydantic-settings with
the precedence command-line flag > environment (``SCHEDULER_``) >
``config.yaml`` ``scheduler:`` section > default. Job schedules come from the
``jobs:`` section. Unknown fields are errors everywhere: a typo must not
silently drop a setting.
"""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from scheduler.errors import ConfigError
from scheduler.schedules import cron_trigger, parse_duration, zone

ENV_PREFIX = "SCHEDULER_"
DEFAULT_LOCK_NAMESPACE = 0x53434844  # the ASCII bytes "SCHD": 1396918340
MAX_APPLICATION_NAME = 63  # PostgreSQL truncates application_name beyond this


def default_instance_name() -> str:
    pid = f"-{os.getpid()}"
    return socket.gethostname()[: MAX_APPLICATION_NAME - len(pid)] + pid


class JobConfig(BaseModel):
    """One entry of the `jobs:` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cron: str | None = None
    interval: timedelta | None = None
    timezone: str | None = None
    start: datetime | None = None
    skip_alert_after: PositiveInt | None = None
    fail_alert_after: PositiveInt | None = None
    ping_url: str | None = None
    enabled: bool = True
    catch_up: Literal["off", "latest"] = "off"
    misfire_grace: timedelta | None = None

    @field_validator("interval", "misfire_grace", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta | None:
        return None if value is None else parse_duration(value)

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        if value is not None:
            zone(value)
        return value

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str | None) -> str | None:
        if value is not None:
            cron_trigger(value, UTC)
        return value

    @field_validator("ping_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value

    @model_validator(mode="after")
    def _one_schedule(self) -> JobConfig:
        if (self.cron is None) == (self.interval is None):
            raise ValueError("needs exactly one of `cron` or `interval`")
        if self.start is not None and self.interval is None:
            raise ValueError("`start` anchors an interval grid; it has no meaning with `cron`")
        return self


class Settings(BaseSettings):
    """Everything a replica is configured with (see the settings table in README.md)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
    )

    database_url: SecretStr | None = None
    config: Path = Path("config.yaml")
    jobs_path: Path | None = None
    instance_name: str = Field(default_factory=default_instance_name)
    timezone: str = "UTC"
    skip_alert_after: PositiveInt = 3
    fail_alert_after: PositiveInt = 3
    alert_webhook_url: SecretStr | None = None
    holder_timeout: float = Field(default=30.0, ge=2.0)
    lock_namespace: int = Field(default=DEFAULT_LOCK_NAMESPACE, ge=-(2**31), le=2**31 - 1)
    shutdown_grace: float = Field(default=30.0, ge=0)
    max_workers: PositiveInt = 10
    misfire_grace: float = Field(default=30.0, gt=0)
    retention_days: float = Field(default=14.0, gt=0)
    http_host: str = "0.0.0.0"
    http_port: int | None = Field(default=None, ge=0, le=65535)
    log_format: Literal["text", "json"] = "text"

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        zone(value)
        return value

    @field_validator("instance_name")
    @classmethod
    def _instance(cls, value: str) -> str:
        if not value or len(value.encode()) > MAX_APPLICATION_NAME:
            raise ValueError(f"must be 1 to {MAX_APPLICATION_NAME} bytes (a PostgreSQL name)")
        return value

    @field_validator("database_url")
    @classmethod
    def _database(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        scheme = value.get_secret_value().split("://", 1)[0]
        if scheme not in ("postgresql", "postgres", "postgresql+psycopg"):
            raise ValueError("must be a postgresql:// URL (leave it unset for the embedded mode)")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if settings_cls.model_config.get("yaml_file"):
            sources.append(YamlConfigSettingsSource(settings_cls))
        return tuple(sources)

    @property
    def embedded(self) -> bool:
        return self.database_url is None

    @property
    def resolved_jobs_path(self) -> Path:
        return self.jobs_path if self.jobs_path is not None else self.config.parent / "jobs"

    def job_timezone(self, job: JobConfig) -> str:
        return job.timezone or self.timezone

    def skip_threshold(self, job: JobConfig | None) -> int:
        return (job.skip_alert_after if job else None) or self.skip_alert_after

    def fail_threshold(self, job: JobConfig | None) -> int:
        return (job.fail_alert_after if job else None) or self.fail_alert_after

    def grace(self, job: JobConfig | None) -> timedelta:
        if job is not None and job.misfire_grace is not None:
            return job.misfire_grace
        return timedelta(seconds=self.misfire_grace)


class Config:
    """A loaded config.yaml: the settings and every job's schedule."""

    def __init__(self, path: Path, settings: Settings, jobs: dict[str, JobConfig]) -> None:
        self.path = path
        self.settings = settings
        self.jobs = jobs


_TOP_LEVEL = {"scheduler", "jobs"}


def config_path(flag: str | None) -> Path:
    return Path(flag or os.environ.get(f"{ENV_PREFIX}CONFIG") or "config.yaml")


def load_config(flag_config: str | None = None, **flags: Any) -> Config:
    """Read and validate config.yaml and the settings; raise ConfigError on anything wrong."""
    path = config_path(flag_config)
    document = _read_yaml(path)
    section = document.get("scheduler") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: scheduler: must be a mapping of settings")
    if "config" in section:
        raise ConfigError(
            f"{path}: scheduler.config: the config file cannot name itself; "
            "use --config or SCHEDULER_CONFIG"
        )
    overrides = {k: v for k, v in flags.items() if v is not None}
    overrides["config"] = path
    settings = _settings(path if document.get("scheduler") else None, overrides)
    jobs_section = document.get("jobs") or {}
    if not isinstance(jobs_section, dict):
        raise ConfigError(f"{path}: jobs: must be a mapping of job name to schedule")
    jobs: dict[str, JobConfig] = {}
    for name, body in jobs_section.items():
        jobs[str(name)] = _job(path, str(name), body)
    return Config(path, settings, jobs)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: config file not found (set --config or SCHEDULER_CONFIG)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: must be a mapping with `scheduler:` and `jobs:` sections")
    unknown = sorted(str(k) for k in document if k not in _TOP_LEVEL)
    if unknown:
        raise ConfigError(
            f"{path}: unknown top-level field {unknown[0]!r} (expected `scheduler` and `jobs`)"
        )
    return document


def _settings(section_file: Path | None, overrides: dict[str, Any]) -> Settings:
    """Settings, with the `scheduler:` section of `section_file` as the YAML source."""
    path = overrides["config"]

    class FromFile(Settings):
        model_config = (
            SettingsConfigDict(yaml_file=section_file, yaml_config_section="scheduler")
            if section_file
            else SettingsConfigDict()
        )

    try:
        return FromFile(**overrides)
    except ValidationError as exc:
        raise ConfigError(_settings_message(path, exc, overrides)) from None
    except (TypeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: scheduler: {exc}") from None


def _settings_message(path: Path, exc: ValidationError, overrides: dict[str, Any]) -> str:
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "scheduler"
        env_name = f"{ENV_PREFIX}{field.upper()}"
        flag = field.replace("_", "-")
        if field in overrides and field != "config":
            where = f"--{flag}"
        elif env_name in os.environ:
            where = f"environment {env_name}"
        else:
            where = f"{path}: scheduler.{field}"
        value = _shown_value(field, error.get("input"))
        message = _sentence(error["msg"])
        if error["type"] == "extra_forbidden":
            message = "unknown setting"
        lines.append(f"{where}: {message}{value}")
    return "\n".join(lines)


def _job(path: Path, name: str, body: Any) -> JobConfig:
    where = f"{path}: jobs.{name}"
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: must be a mapping with `cron` or `interval`")
    try:
        job = JobConfig.model_validate(body)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            message = _sentence(error["msg"])
            if error["type"] == "extra_forbidden":
                message = "unknown field"
            location = f"{where}.{field}" if field else where
            lines.append(f"{location}: {message}{_shown_value(field, error.get('input'))}")
        raise ConfigError("\n".join(lines)) from None
    return job


def _sentence(message: str) -> str:
    message = message.removeprefix("Value error, ")
    return message[:1].lower() + message[1:]


_SECRET_FIELDS = {"database_url", "alert_webhook_url", "ping_url"}


def _shown_value(field: str, value: Any) -> str:
    if value is None or isinstance(value, dict):
        return ""
    if field.split(".")[-1] in _SECRET_FIELDS:
        return " (value hidden: it may hold a secret)"
    return f" (got {value!r})"
