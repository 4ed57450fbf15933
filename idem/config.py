"""One frozen, validated configuration object, also readable from ``IDEM_*`` variables.

Settings resolve in one place: explicit keyword arguments win over the
environment, which wins over the defaults below. Every refusal names the
setting and the limit it broke.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from idem.delay_levels import DEFAULT_MAX_RECONSUME_TIMES, DelayLevels
from idem.errors import ConfigError
from idem.redis_client import redacted, redis_url_problem

_GROUP = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)?$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

MINUTE_MS = 60_000
DAY_MS = 86_400_000

MAX_DURATION_MS = 36_500 * DAY_MS
"""The longest duration :func:`parse_duration_ms` takes (100 years): far past any window,
lease or retention idem has, and short enough that *now* minus it is still a date."""

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""RocketMQ's ``maxMessageSize`` (4 MiB): the largest message the resend path schedules."""

MESSAGE_BYTES_RANGE = (1024, 256 * 1024 * 1024)
"""Allowed ``max_message_bytes``: from 1 KiB (a smaller limit is a unit mistake) to 256 MiB,
whose wire form (the body in base64, 4/3 of it) still fits Redis's default
``proto-max-bulk-len`` of 512 MB."""


class DedupMode(StrEnum):
    """How much a claim trusts Redis."""

    INDEX = "index"
    """Redis is a complete index of the ledger (checked by watermark); O(recent) per batch."""
    STRICT = "strict"
    """Every claimed key is also checked against the ledger's whole dedup window."""


class LedgerEngine(StrEnum):
    """Which Delta engine writes and reads the ledger (one table has one writer engine)."""

    AUTO = "auto"
    """In a Spark job (the decorator, ``idem run``), delta-spark when its session was
    checked to run it, else delta-rs; delta-rs for ``Dedup``, ``@idempotent`` and the
    consumer."""
    DELTA_RS = "delta-rs"
    """delta-rs in the Python process: no JVM jars; the embedded and single-machine engine."""
    DELTA_SPARK = "delta-spark"
    """delta-spark through the active Spark session: the cluster engine (needs Delta's jars)."""


class MismatchPolicy(StrEnum):
    """What to do when a completed key arrives again with a different payload."""

    ACCEPT = "accept"
    WARN = "warn"
    RAISE = "raise"
    DEAD_LETTER = "dead_letter"


def parse_duration_ms(value: str | int | float, *, setting: str) -> int:
    """Parse ``"300"`` (ms), ``"10s"``, ``"5m"``, ``"2h"``, ``"7d"`` into milliseconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{setting}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        return int(value)
    match = _DURATION.match(value.strip().lower())
    if match is None:
        raise ConfigError(
            f"{setting}: {value!r} is not a duration; use a whole number with an "
            "optional unit ms, s, m, h or d (e.g. '5m', '7d'); no unit means ms"
        )
    ms = int(match.group(1)) * _UNIT_MS[match.group(2) or "ms"]
    if ms > MAX_DURATION_MS:
        raise ConfigError(
            f"{setting}: {value!r} is longer than the longest duration idem takes, "
            f"{MAX_DURATION_MS // DAY_MS}d"
        )
    return ms


def _format_ms(ms: int) -> str:
    seconds, _ = divmod(ms, 1000)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours} h {minutes} min {secs} s"


def _join(base: str, name: str) -> str:
    """Join a local path or an object-store URI (``s3://b/x``) with one more segment."""
    if "://" in base:
        return f"{base.rstrip('/')}/{name}"
    return str(Path(base) / name)


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected a whole number, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{name}: {value} is outside the allowed range {low}..{high}")


@dataclass(frozen=True, kw_only=True)
class IdemConfig:
    """Everything idem needs to know about one consumer group.

    Paths default to ``<data_dir>/<group>/{ledger,dlq,retry-journal}``.
    """

    group: str
    redis_url: str = "redis://127.0.0.1:6379/0"
    data_dir: str = "./idem-data"
    ledger_path: str | None = None
    dlq_path: str | None = None
    journal_path: str | None = None
    buckets: int = 16
    max_key_bytes: int = 512
    lease_ms: int = 5 * MINUTE_MS
    dedup_window_ms: int = 7 * DAY_MS
    mode: DedupMode = DedupMode.INDEX
    engine: LedgerEngine = LedgerEngine.AUTO
    """The ledger's Delta engine; ``auto`` picks delta-spark only in a Spark job whose session
    was checked to run it."""
    delay_levels: DelayLevels = field(default_factory=DelayLevels.parse)
    max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES
    consume_timeout_ms: int = 15 * MINUTE_MS
    mismatch_policy: MismatchPolicy = MismatchPolicy.WARN
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """A failed message larger than this (its body, or body and properties together) is
    dead-lettered at send-back instead of scheduled, as RocketMQ refuses a message over
    ``maxMessageSize``; Redis could not take its wire form past ``proto-max-bulk-len``."""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.group, str)
            or not _GROUP.fullmatch(self.group)
            or not self.group.strip(".")
        ):
            raise ConfigError(
                f"group: {self.group!r} must be 1..200 characters of letters, digits, "
                "'_', '.', '-', not only dots (it becomes part of Redis hash tags and "
                "Delta paths)"
            )
        self._check_paths()
        url_problem = redis_url_problem(self.redis_url)
        if url_problem is not None:
            raise ConfigError(f"redis_url: {url_problem}")
        _check_range("buckets", self.buckets, 1, 1024)
        _check_range("max_key_bytes", self.max_key_bytes, 1, 65_536)
        _check_range("lease_ms", self.lease_ms, 1_000, 7 * DAY_MS)
        _check_range("max_reconsume_times", self.max_reconsume_times, 0, 1_000)
        _check_range("consume_timeout_ms", self.consume_timeout_ms, 1_000, DAY_MS)
        _check_range("dedup_window_ms", self.dedup_window_ms, 1_000, 3650 * DAY_MS)
        _check_range("max_message_bytes", self.max_message_bytes, *MESSAGE_BYTES_RANGE)
        if isinstance(self.delay_levels, str):
            object.__setattr__(self, "delay_levels", DelayLevels.parse(self.delay_levels))
        elif not isinstance(self.delay_levels, DelayLevels):
            raise ConfigError(
                f"delay_levels: expected levels like '1s 5s 10s', got {self.delay_levels!r}"
            )
        for name, enum in (
            ("mode", DedupMode),
            ("engine", LedgerEngine),
            ("mismatch_policy", MismatchPolicy),
        ):
            raw = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(raw))
            except ValueError:
                allowed = ", ".join(m.value for m in enum)
                raise ConfigError(f"{name}: {raw!r} is not one of {allowed}") from None
        horizon = self.retry_horizon_ms
        if self.dedup_window_ms < horizon:
            raise ConfigError(
                f"dedup_window_ms: {_format_ms(self.dedup_window_ms)} is shorter than the "
                f"retry horizon {_format_ms(horizon)} (the delay ladder over "
                f"{self.max_reconsume_times} reconsumes); a retried message would no "
                "longer be recognised as a duplicate"
            )

    def __repr__(self) -> str:
        """The settings, with the Redis URL's secrets hidden (a repr lands in logs)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["redis_url"] = redacted(self.redis_url)
        shown = ", ".join(f"{name}={value!r}" for name, value in values.items())
        return f"{type(self).__name__}({shown})"

    def _check_paths(self) -> None:
        """Paths are text (a :class:`~pathlib.Path` is taken as its text); ``data_dir`` is
        required, the table paths default under it."""
        for name in ("data_dir", "ledger_path", "dlq_path", "journal_path"):
            value = getattr(self, name)
            if value is None and name != "data_dir":
                continue
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                object.__setattr__(self, name, value)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{name}: expected a directory path or URI, got {value!r}")

    @property
    def retry_horizon_ms(self) -> int:
        """The longest a message can spend in retries before it is dead-lettered."""
        return self.delay_levels.retry_horizon_ms(self.max_reconsume_times)

    @property
    def group_dir(self) -> str:
        """``<data_dir>/<group>``: where this group's tables live by default."""
        return _join(self.data_dir, self.group)

    @property
    def resolved_ledger_path(self) -> str:
        """The ledger table's location."""
        return self.ledger_path or _join(self.group_dir, "ledger")

    @property
    def resolved_dlq_path(self) -> str:
        """The ``%DLQ%<group>`` table's location."""
        return self.dlq_path or _join(self.group_dir, "dlq")

    @property
    def resolved_journal_path(self) -> str:
        """The Delta retry journal's location."""
        return self.journal_path or _join(self.group_dir, "retry-journal")

    def with_changes(self, **changes: Any) -> IdemConfig:
        """A copy with some settings changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> IdemConfig:
        """Build from ``IDEM_<SETTING>`` variables (e.g. ``IDEM_GROUP``, ``IDEM_LEASE_MS``).

        Durations accept units (``IDEM_DEDUP_WINDOW_MS=7d``). Keyword overrides win.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            variable = f"IDEM_{f.name.upper()}"
            if f.name in overrides or variable not in env:
                continue
            raw = env[variable]
            if f.name.endswith("_ms"):
                values[f.name] = parse_duration_ms(raw, setting=variable)
            elif f.name in {"buckets", "max_key_bytes", "max_reconsume_times", "max_message_bytes"}:
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ConfigError(f"{variable}: {raw!r} is not a whole number") from None
            else:
                values[f.name] = raw
        from_env = set(values) - set(overrides)
        values.update(overrides)
        if "group" not in values:
            raise ConfigError(
                "group: not set (--group G on the command line, group=... in Python, or the "
                "IDEM_GROUP environment variable)"
            )
        try:
            return cls(**values)
        except ConfigError as exc:  # name the variable a bad value came from
            setting, sep, rest = str(exc).partition(": ")
            if sep and setting in from_env:
                raise ConfigError(f"IDEM_{setting.upper()}: {rest}") from None
            raise
