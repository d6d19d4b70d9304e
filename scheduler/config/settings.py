"""Settings and config.yaml: everything a replica is told, validated strictly.

A leaf module: no database code. Settings come from pydantic-settings with
the precedence command-line flag > environment (``SCHEDULER_``) >
``config.yaml`` ``scheduler:`` section > default. Job schedules come from the
``jobs:`` section. Unknown fields are errors everywhere: a typo must not
silently drop a setting.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
import socket
import zlib
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from scheduler.config.schedules import cron_trigger, parse_duration, zone
from scheduler.config.urls import redact_http_url, validate_database_url, validate_http_url
from scheduler.errors import SHOWN_MAX, ConfigError, one_line, shorten

ENV_PREFIX = "SCHEDULER_"
SCHEMA_NAME = re.compile(r"(?!pg_)[a-z_][a-z0-9_]{0,62}")
DEFAULT_LOCK_NAMESPACE = 0x53434844  # the ASCII bytes "SCHD": 1396918340
MAX_APPLICATION_NAME = 63  # PostgreSQL truncates application_name beyond this
INSTANCE_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_APPLICATION_NAME}}}")
MAX_THRESHOLD = 1_000_000
MIN_INTERVAL = timedelta(seconds=1)
MAX_INTERVAL = timedelta(days=3650)
MAX_MISFIRE_GRACE = timedelta(days=1)
MAX_CONFIG_BYTES = 10 * 1024 * 1024
MAX_YAML_DEPTH = 50
MIN_TOKEN = 16  # characters of http_token: guessing it must be hopeless


def default_instance_name() -> str:
    """`<hostname>-<pid>`, each character of the host name not allowed in a name made `-`."""
    pid = f"-{os.getpid()}"
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "scheduler"
    return host[: MAX_APPLICATION_NAME - len(pid)] + pid


def _number(value: Any) -> int | float:
    """A number as YAML, the environment or a flag gives it; a boolean is not one."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return float(value.strip())
    raise ValueError("not a number")


def _ranged(
    low: float, high: float, message: str, *, whole: bool = False, above: bool = False
) -> BeforeValidator:
    """A number in [low, high] (or (low, high] when `above`); NaN and infinity never are."""

    def check(value: Any) -> Any:
        if value is None:
            return None
        try:
            number = _number(value)
            finite = math.isfinite(number)
        except (ValueError, OverflowError):
            raise ValueError(message) from None
        if not finite or (whole and number != int(number)):
            raise ValueError(message)
        if number < low or (above and number == low) or number > high:
            raise ValueError(message)
        return int(number) if whole else number

    return BeforeValidator(check)


def _whole(low: int, high: int) -> BeforeValidator:
    return _ranged(low, high, f"must be a whole number between {low} and {high}", whole=True)


def _lowercase(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
HOST_LOCK_OFF = "off"


def _host_lock(value: Any) -> Any:
    """`off` (or false, or empty) turns the host lock off; else a file path, kept as text."""
    if value is None:
        return None
    if value is False or (isinstance(value, str) and value.strip().lower() in ("", "off")):
        return HOST_LOCK_OFF
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str) or "\0" in value:
        raise ValueError("must be a file path, or `off`")
    return value


def _module_names(value: Any) -> Any:
    """Dotted module names: a list, or one string of names separated by commas."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple):
        raise ValueError("must be a list of module names, such as [myapp.jobs]")
    for name in value:
        if not isinstance(name, str) or not MODULE_NAME.fullmatch(name):
            raise ValueError(f"{_shown(name)} is not a module name (such as myapp.jobs)")
    return list(value)


Threshold = Annotated[int, _whole(1, MAX_THRESHOLD)]


def _infinite(value: Any) -> bool:
    """NaN or infinity, written as a number (parse_duration would take them)."""
    if isinstance(value, bool):
        return False
    try:
        number = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        return False
    except OverflowError:
        return True
    return not math.isfinite(number)


def _duration(
    value: Any, low: timedelta, high: timedelta, message: str, *, above: bool = False
) -> timedelta | None:
    if value is None:
        return None
    if _infinite(value):
        raise ValueError(message)
    try:
        delta = parse_duration(value)
    except OverflowError:
        raise ValueError(message) from None
    if delta < low or (above and delta == low) or delta > high:
        raise ValueError(message)
    return delta


class JobConfig(BaseModel):
    """One entry of the `jobs:` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cron: str | None = None
    interval: timedelta | None = None
    timezone: str | None = None
    start: datetime | None = None
    skip_alert_after: Threshold | None = None
    fail_alert_after: Threshold | None = None
    ping_url: str | None = None
    enabled: bool = True
    catch_up: Literal["off", "latest", "all"] = "off"
    # `all`: ticks no replica started within this window are run when the fleet comes
    # back (default: misfire_grace), at most `catch_up_limit` of them, the newest ones.
    catch_up_window: timedelta | None = None
    catch_up_limit: Annotated[int, _whole(1, 1000)] = 10
    misfire_grace: timedelta | None = None
    retries: Annotated[int, _whole(0, 100)] | None = None  # more attempts of a failed tick
    retry_delay: timedelta | None = None  # before the first retry; doubles for each next one
    retry_delay_max: timedelta | None = None
    spread: timedelta | None = None  # each tick moved by an offset in [0, spread) from the key
    timeout: timedelta | None = None  # a run past it is told (ctx.timed_out) and fails

    @field_validator("interval", mode="before")
    @classmethod
    def _interval(cls, value: Any) -> timedelta | None:
        """At least a second (a shorter grid burns a core), at most ten years."""
        return _duration(value, MIN_INTERVAL, MAX_INTERVAL, "must be between 1 s and 3650 days")

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, value: Any) -> timedelta | None:
        return _duration(value, MIN_INTERVAL, timedelta(days=30), "must be between 1 s and 30 days")

    @field_validator("retry_delay", "retry_delay_max", mode="before")
    @classmethod
    def _retry_delay(cls, value: Any) -> timedelta | None:
        return _duration(value, MIN_INTERVAL, timedelta(days=1), "must be between 1 s and 1 day")

    @field_validator("catch_up_window", mode="before")
    @classmethod
    def _catch_up_window(cls, value: Any) -> timedelta | None:
        return _duration(value, MIN_INTERVAL, timedelta(days=7), "must be between 1 s and 7 days")

    @field_validator("spread", mode="before")
    @classmethod
    def _spread(cls, value: Any) -> timedelta | None:
        """Whole seconds from 1 s to a day: offsets are whole seconds."""
        spread = _duration(value, MIN_INTERVAL, timedelta(days=1), "must be between 1 s and 1 day")
        if spread is not None and spread.total_seconds() != int(spread.total_seconds()):
            raise ValueError("must be whole seconds, such as 90s or 10m")
        return spread

    @field_validator("misfire_grace", mode="before")
    @classmethod
    def _misfire_grace(cls, value: Any) -> timedelta | None:
        return _duration(
            value,
            timedelta(0),
            MAX_MISFIRE_GRACE,
            "must be above 0 s and at most 1 day",
            above=True,
        )

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
        return None if value is None else validate_http_url(value)

    @model_validator(mode="after")
    def _one_schedule(self) -> JobConfig:
        if (self.cron is None) == (self.interval is None):
            raise ValueError("needs exactly one of `cron` or `interval`")
        if self.start is not None and self.interval is None:
            raise ValueError("`start` anchors an interval grid; it has no meaning with `cron`")
        if self.retry_delay and self.retry_delay_max and self.retry_delay_max < self.retry_delay:
            raise ValueError("`retry_delay_max` must be at least `retry_delay`")
        if self.catch_up != "all" and "catch_up_window" in self.model_fields_set:
            raise ValueError("`catch_up_window` has a meaning only with `catch_up: all`")
        if self.catch_up != "all" and "catch_up_limit" in self.model_fields_set:
            raise ValueError("`catch_up_limit` has a meaning only with `catch_up: all`")
        return self


def _shown_default(text: str) -> dict[str, Any]:
    """How the settings reference shows a default the code computes (docs/hooks.py)."""
    return {"default_shown": text}


class Settings(BaseSettings):
    """Everything a replica is configured with.

    Each field's description is its row in the settings reference (docs/configuration.md),
    generated from this model.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        validate_default=True,
    )
    # The `scheduler:` section of config.yaml: the source below the environment.
    yaml_section: ClassVar[dict[str, Any]] = {}

    database_url: SecretStr | None = Field(
        None,
        description="`postgresql://…` for a fleet; unset: the embedded mode (SQLite file"
        " `scheduler.db` beside config.yaml, and file locks; one host only)",
    )
    config: Path = Field(Path("config.yaml"), description="path of config.yaml")
    jobs_path: Path | None = Field(
        None,
        description="folder of job modules",
        json_schema_extra=_shown_default("`jobs/` beside the config"),
    )
    instance_name: str = Field(
        default_factory=default_instance_name,
        description="this replica's name: 1 to 63 characters, letters, digits, `.`, `_`, `-`"
        " (other characters of the host name become `-`); also its PostgreSQL"
        " `application_name` (over any `application_name` in the URL) and, in embedded mode,"
        " its presence file's name",
        json_schema_extra=_shown_default("`<hostname>-<pid>`"),
    )
    timezone: str = Field("UTC", description="default zone for cron schedules")
    skip_alert_after: Threshold = Field(
        3, description="consecutive skipped ticks of a job before an alert (1 to 1,000,000)"
    )
    fail_alert_after: Threshold = Field(
        3, description="consecutive failed runs of a job before an alert (1 to 1,000,000)"
    )
    alert_webhook_url: SecretStr | None = Field(
        None,
        description="where alerts are POSTed (optional; treated as a secret); a"
        " `user:password@` in it is sent as HTTP Basic auth",
    )
    holder_timeout: Annotated[
        float, _ranged(2, 3600, "must be a number of seconds between 2 and 3600")
    ] = Field(
        30.0,
        description="seconds; the longest a frozen or cut-off replica keeps a job's lock"
        " (2 to 3600)",
    )
    # None: DEFAULT_LOCK_NAMESPACE for the schema `public`, else derived from the schema's
    # name, so fleets in separate schemas never meet on a lock (see `namespace`).
    lock_namespace: Annotated[int, _whole(-(2**31), 2**31 - 1)] | None = Field(
        None,
        description="first integer of every advisory lock key",
        json_schema_extra=_shown_default(
            f"{DEFAULT_LOCK_NAMESPACE} for schema `public`, else derived from the schema"
        ),
    )
    schema_name: str = Field(
        default="public",
        validation_alias=AliasChoices("schema", f"{ENV_PREFIX}SCHEMA"),
        description="the PostgreSQL schema of this fleet's ledger (created if missing); one"
        " per fleet on a shared database",
    )
    shutdown_grace: Annotated[
        float, _ranged(0, 86400, "must be a number of seconds between 0 and 86400")
    ] = Field(30.0, description="seconds SIGTERM waits for running jobs (0 to 86400)")
    max_workers: Annotated[int, _whole(1, 10_000)] = Field(
        10,
        description="runs one replica executes at once (threads, 1 to 10,000); ticks beyond"
        " that wait, and another replica may take them. For many short jobs on one grid,"
        " raise it to about (jobs due at once) / (replicas)",
    )
    misfire_grace: Annotated[
        float,
        _ranged(
            0, 86400, "must be a number of seconds above 0 and at most 86400 (1 day)", above=True
        ),
    ] = Field(
        30.0,
        description="seconds after its scheduled time a tick may still start (by the"
        " database clock); later, it is recorded `missed` (above 0, at most 86400; a job's"
        " `misfire_grace`: at most `1d`)",
    )
    retries: Annotated[int, _whole(0, 100)] = Field(
        0,
        description="attempts of a failed tick after the first, for every job without its"
        " own `retries` (0 to 100)",
    )
    retry_delay: Annotated[
        float, _ranged(1, 86400, "must be a number of seconds between 1 and 86400")
    ] = Field(
        10.0,
        description="seconds before the first retry; doubles for each next one (1 to 86400)",
    )
    retry_delay_max: Annotated[
        float, _ranged(1, 86400, "must be a number of seconds between 1 and 86400")
    ] = Field(600.0, description="seconds: the longest delay between attempts (1 to 86400)")
    retention_days: Annotated[
        float, _ranged(0, 36500, "must be a number of days above 0 and at most 36500", above=True)
    ] = Field(
        14.0,
        description="ledger rows older than this are deleted (by one replica at a time;"
        " above 0, at most 36500)",
    )
    http_host: str = Field(
        "0.0.0.0", description="address of the page and the health and metrics endpoints"
    )
    http_port: Annotated[int, _whole(0, 65535)] | None = Field(
        None,
        description="port of the page, its API, and the health and metrics endpoints;"
        " 0 or unset: off",
    )
    # The page's actions (pause, resume, run now) need this token; `all`: reading too.
    http_token: SecretStr | None = Field(
        None,
        description="the token the page's pause, resume and run-now need (a secret, never"
        " shown; at least 16 characters, e.g. `openssl rand -hex 32`); unset: those actions"
        " are off",
    )
    http_protect: Annotated[Literal["actions", "all"], BeforeValidator(_lowercase)] = Field(
        "actions",
        description="`actions`: reading the page and `/api/*` is open, acting needs the"
        " token; `all`: reading needs it too (`/healthz`, `/readyz` and `/metrics` stay"
        " open); `all` needs `http_token`",
    )
    log_format: Annotated[Literal["text", "json"], BeforeValidator(_lowercase)] = Field(
        "text", description="`text` or `json` (any case)"
    )
    schedule_drift_grace: Annotated[
        float, _ranged(0, 86400, "must be a number of seconds between 0 and 86400")
    ] = Field(
        600.0,
        description="seconds live replicas may run different schedules for a job before"
        " `job.schedule_drift` is raised (0 to 86400)",
    )
    # signal: config.yaml is reloaded on SIGHUP; watch: also when the file changes.
    reload: Annotated[Literal["signal", "watch"], BeforeValidator(_lowercase)] = Field(
        "signal",
        description="`signal`: `config.yaml` is read again on SIGHUP; `watch`: also when the"
        " file changes",
    )

    # The processes sharing this file elect one active replica (scheduler.fleet.host_lock).
    host_lock: Annotated[str | None, BeforeValidator(_host_lock)] = Field(
        None,
        description="a file path: the processes that share it elect one active replica"
        " through a file lock (the others stand by, with no database session, and one takes"
        " over within a second when it exits or dies); `off`: none",
        json_schema_extra=_shown_default(
            "off for `scheduler run`; for `Replica` (the library API), a file in the system"
            " temporary folder named after the schema and the database"
        ),
    )
    modules: Annotated[list[str], NoDecode, BeforeValidator(_module_names)] = Field(
        default_factory=list,
        description="job modules to import by name (`myapp.jobs`), besides the jobs folder;"
        " in the environment, names separated by commas",
        json_schema_extra=_shown_default("none"),
    )

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        zone(value)
        return value

    @field_validator("schema_name")
    @classmethod
    def _schema(cls, value: str) -> str:
        if not SCHEMA_NAME.fullmatch(value):
            raise ValueError(
                "must be a PostgreSQL schema name: 1 to 63 lowercase letters, digits and '_',"
                " not starting with a digit (and not pg_...)"
            )
        return value

    @field_validator("instance_name")
    @classmethod
    def _instance(cls, value: str) -> str:
        """A file name of the embedded lock folder and an ASCII PostgreSQL application_name."""
        if not INSTANCE_NAME.fullmatch(value):
            raise ValueError(
                f"must be 1 to {MAX_APPLICATION_NAME} characters: letters, digits, '.', '_' "
                "and '-' (it names this replica's lock files and PostgreSQL sessions)"
            )
        return value

    @field_validator("database_url")
    @classmethod
    def _database(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        validate_database_url(value.get_secret_value())
        return value

    @field_validator("alert_webhook_url")
    @classmethod
    def _webhook(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        validate_http_url(value.get_secret_value())
        return value

    @field_validator("http_token")
    @classmethod
    def _token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if len(value.get_secret_value()) < MIN_TOKEN:
            raise ValueError(
                f"must be at least {MIN_TOKEN} characters (a random one: openssl rand -hex 32)"
            )
        return value

    @model_validator(mode="after")
    def _protected(self) -> Settings:
        if self.http_protect == "all" and self.http_token is None:
            raise ValueError("http_protect: all needs http_token (SCHEDULER_HTTP_TOKEN) to be set")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        section = dict(getattr(settings_cls, "yaml_section", {}))
        return (init_settings, env_settings, InitSettingsSource(settings_cls, section))

    @property
    def embedded(self) -> bool:
        return self.database_url is None

    def host_lock_file(self, default: Path | None) -> Path | None:
        """The host lock's file: the setting's, else `default` (None: no host lock)."""
        if self.host_lock == HOST_LOCK_OFF:
            return None
        return Path(self.host_lock).absolute() if self.host_lock else default

    @property
    def namespace(self) -> int:
        """The first integer of every advisory lock of this fleet."""
        if self.lock_namespace is not None:
            return self.lock_namespace
        if self.schema_name == "public":
            return DEFAULT_LOCK_NAMESPACE
        return zlib.crc32(f"scheduler:{self.schema_name}".encode()) & 0x7FFFFFFF

    @property
    def resolved_jobs_path(self) -> Path:
        return self.jobs_path if self.jobs_path is not None else self.config.parent / "jobs"

    def job_timezone(self, job: JobConfig) -> str:
        return job.timezone or self.timezone

    def skip_threshold(self, job: JobConfig | None) -> int:
        return (job.skip_alert_after if job else None) or self.skip_alert_after

    def fail_threshold(self, job: JobConfig | None) -> int:
        return (job.fail_alert_after if job else None) or self.fail_alert_after

    def retry_policy(self, job: JobConfig | None) -> tuple[int, timedelta, timedelta]:
        """Retries, the first delay and the longest (each from the job, else the setting)."""
        retries = job.retries if job and job.retries is not None else self.retries
        first = (job.retry_delay if job else None) or timedelta(seconds=self.retry_delay)
        cap = (job.retry_delay_max if job else None) or timedelta(seconds=self.retry_delay_max)
        return retries, first, max(first, cap)

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
    """Absolute, read once: a job may change the working folder (`os.chdir`), and a
    reload must still find the same file."""
    return Path(flag or os.environ.get(f"{ENV_PREFIX}CONFIG") or "config.yaml").absolute()


def load_config(
    flag_config: str | None = None, given_as: Literal["flag", "keyword"] = "flag", **flags: Any
) -> Config:
    """Read and validate config.yaml and the settings; raise ConfigError on anything wrong.

    `flags` are the command line's (`given_as="flag"`), or the keyword arguments of
    the library API (`scheduler.replica`): an error names the one the user wrote.
    """
    path = config_path(flag_config)
    document = _read_yaml(path)
    section = document.get("scheduler") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: scheduler: must be a mapping of settings")
    for name in section:
        if not isinstance(name, str):
            raise ConfigError(f"{path}: scheduler: {_shown(name)} is not the name of a setting")
    if "config" in section:
        raise ConfigError(
            f"{path}: scheduler.config.settings: the config file cannot name itself; "
            "use --config or SCHEDULER_CONFIG"
        )
    overrides = {k: v for k, v in flags.items() if v is not None}
    overrides["config"] = path
    settings = _settings(section, overrides, given_as)
    if settings.jobs_path is not None and not settings.jobs_path.is_absolute():
        settings = settings.model_copy(update={"jobs_path": settings.jobs_path.absolute()})
    jobs_section = document.get("jobs") or {}
    if not isinstance(jobs_section, dict):
        raise ConfigError(f"{path}: jobs: must be a mapping of job name to schedule")
    jobs: dict[str, JobConfig] = {}
    for name, body in jobs_section.items():
        jobs[str(name)] = _job(path, str(name), body)
    return Config(path, settings, jobs)


class _Refused(yaml.MarkedYAMLError):
    """A construct config.yaml does not allow, at its place in the file."""


class _StrictLoader(yaml.SafeLoader):
    """YAML without anchors and aliases, without deep nesting, without a key given twice.

    An alias lets a 400-byte file stand for gigabytes (the "billion laughs"),
    deep nesting exhausts the composer's recursion, and a key given twice
    silently drops the first value (a job defined twice keeps the last).
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in the yaml stubs
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(
                problem="anchors and aliases (&name, *name) are not allowed: write each value out",
                problem_mark=event.start_mark,
            )
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _Refused(
                    problem=f"nested too deeply (more than {MAX_YAML_DEPTH} levels)",
                    problem_mark=event.start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """A value YAML reads but Python cannot hold (a 5000-digit number, month 13) is refused."""
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:
            raise _Refused(
                problem=f"cannot read this value: {shorten(one_line(exc))}",
                problem_mark=node.start_mark,
            ) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = key in first
            except TypeError:
                continue  # an unhashable key: SafeLoader refuses it below
            line = key_node.start_mark.line + 1
            if seen:
                raise _Refused(
                    problem=f"{_shown(key)} is given twice (line {first[key]} and line {line}); "
                    "the second would replace the first",
                    problem_mark=key_node.start_mark,
                )
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: config file not found (set --config or SCHEDULER_CONFIG)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES // 1024 // 1024} MB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise ConfigError(
            f"{path}: not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line}, "
            f"column {column}; save the file as UTF-8"
        ) from None
    document = _parse_yaml(path, text)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: must be a mapping with `scheduler:` and `jobs:` sections")
    unknown = [k for k in document if k not in _TOP_LEVEL]
    if unknown:
        raise ConfigError(
            f"{path}: unknown top-level field {_shown(unknown[0])} "
            "(expected `scheduler` and `jobs`)"
        )
    return document


def _parse_yaml(path: Path, text: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = shorten(" ".join(str(exc.problem or exc.context or "").split()))
        if isinstance(exc, _Refused):
            raise ConfigError(f"{path}: {where}: {problem}") from None
        raise ConfigError(f"{path}: invalid YAML at {where}: {problem}") from None
    except yaml.reader.ReaderError as exc:
        before = text[: exc.position]
        line, column = before.count("\n") + 1, exc.position - before.rfind("\n")
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(
            f"{path}: invalid YAML at line {line}, column {column}: "
            f"character #x{code:04x} is not allowed ({exc.reason})"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except (yaml.YAMLError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{path}: invalid YAML: {shorten(one_line(exc))}") from None


def _settings(
    section: dict[str, Any], overrides: dict[str, Any], given_as: str = "flag"
) -> Settings:
    """Settings, with the `scheduler:` section as the source below the environment."""
    path = overrides["config"]

    class FromFile(Settings):
        yaml_section = section

    try:
        return FromFile(**overrides)
    except ValidationError as exc:
        raise ConfigError(_settings_message(path, exc, overrides, given_as)) from None
    except Exception as exc:
        raise ConfigError(f"{path}: scheduler: cannot be read ({type(exc).__name__})") from None


def _settings_message(
    path: Path, exc: ValidationError, overrides: dict[str, Any], given_as: str = "flag"
) -> str:
    lines = []
    for error in exc.errors():
        field = shorten(".".join(str(part) for part in error["loc"]), 100)
        env_name = f"{ENV_PREFIX}{field.upper()}"
        flag = field.replace("_", "-")
        if not field:  # a rule between settings (its message names them), wherever they came from
            where = "settings"
        elif field in overrides and field != "config":
            where = f"--{flag}" if given_as == "flag" else f"keyword argument {field}"
        elif env_name in os.environ:
            where = f"environment {env_name}"
        else:
            where = f"{path}: scheduler.{field}"
        if error["type"] == "extra_forbidden":
            # Never the value: a misspelled database_url holds a password.
            lines.append(f"{where}: unknown setting{_suggestion(field, setting_names())}")
            continue
        lines.append(f"{where}: {_sentence(error['msg'])}{_shown_value(field, error.get('input'))}")
    return "\n".join(lines)


def _job(path: Path, name: str, body: Any) -> JobConfig:
    where = f"{path}: jobs.{shorten(name, 100)}"
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: must be a mapping with `cron` or `interval`")
    try:
        job = JobConfig.model_validate(body)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = shorten(".".join(str(part) for part in error["loc"]), 100)
            location = f"{where}.{field}" if field else where
            if error["type"] == "extra_forbidden":
                suggestion = _suggestion(field, JobConfig.model_fields)
                lines.append(f"{location}: unknown field{suggestion}")
                continue
            message = _sentence(error["msg"])
            lines.append(f"{location}: {message}{_shown_value(field, error.get('input'))}")
        raise ConfigError("\n".join(lines)) from None
    except Exception as exc:
        raise ConfigError(f"{where}: cannot be read ({type(exc).__name__})") from None
    return job


def _sentence(message: str) -> str:
    message = message.removeprefix("Value error, ")
    return message[:1].lower() + message[1:]


def setting_names() -> list[str]:
    """The settings as users spell them (a field's alias where it has one)."""
    return ["schema" if name == "schema_name" else name for name in Settings.model_fields]


def _suggestion(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


_SECRET_FIELDS = {"database_url", "alert_webhook_url", "http_token"}
_SECRET_WORDS = ("password", "secret", "token")
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 2 * SHOWN_MAX
_REPR.maxlevel = 3


def _shown(value: Any) -> str:
    """A value as a message repeats it: its repr, cut to SHOWN_MAX characters."""
    return shorten(_REPR.repr(value))


def _shown_value(field: str, value: Any) -> str:
    if value is None or isinstance(value, dict):
        return ""
    name = field.split(".")[-1]
    if name == "ping_url" and isinstance(value, str):
        return f" (got {redact_http_url(value)}, its path hidden)"
    if name in _SECRET_FIELDS or name == "ping_url" or any(w in name for w in _SECRET_WORDS):
        return " (value hidden: it may hold a secret)"
    return f" (got {_shown(value)})"
