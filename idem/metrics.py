"""idem's Prometheus metrics: what every part counts, and a small HTTP server to scrape it.

Counting needs nothing beyond the core: the parts of idem add to process-wide
tallies (:func:`count`, :func:`observe`) once per batch or per move, never per
row, and a tally is a dictionary update under a lock. Exposing them needs
``prometheus-client`` (the ``metrics`` extra): :func:`collector` turns the
tallies into Prometheus metric families, and :func:`serve` answers ``/metrics``,
``/healthz`` and ``/readyz``.

Every series is labelled by ``group``, and where it applies by ``cause``,
``level``, ``reason``, ``status``, ``topic``, ``kind`` or ``component``, each from
a small fixed set (a dead letter's free-text reason is reduced to its kind by
:func:`reason_label`): never by key or message id, so the number of series stays
bounded however many messages pass.

Counters are this process's since it started (sum them over instances); the
state gauges (:class:`StateCollector`) are the group's, read from Redis and Delta
when scraped.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Final, TypeVar

from idem.extras import install_hint

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

PREFIX: Final = "idem_"

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family: its name without ``idem_`` and ``_total``, help, and labels."""

    name: str
    help: str
    labels: tuple[str, ...] = ("group",)


COUNTERS: Final = {
    spec.name: spec
    for spec in (
        MetricSpec("messages", "Messages (rows) taken in by a consumer or a Spark batch."),
        MetricSpec("applied", "Messages the sink accepted and idem committed as done."),
        MetricSpec(
            "duplicates",
            "Messages kept from the sink as duplicates, by cause (in_batch, completed, slipped).",
            ("group", "cause"),
        ),
        MetricSpec("busy", "Messages whose key another owner held; sent back after a short delay."),
        MetricSpec("failed", "Messages the sink or listener rejected."),
        MetricSpec(
            "retries_scheduled",
            "Messages sent back onto a delay level (0: the custom-delay timer queue).",
            ("group", "level"),
        ),
        MetricSpec(
            "dead_letters", "Messages written to %DLQ%<group>, by reason.", ("group", "reason")
        ),
        MetricSpec(
            "replays",
            "Replays: a Spark batch run again after a failure (kind=batch), a dead letter "
            "sent back by idem dlq replay (kind=dlq).",
            ("group", "kind"),
        ),
        MetricSpec("schedule_moved", "Scheduled messages moved to %RETRY%<group> when due."),
        MetricSpec(
            "redis_errors",
            "Redis calls that failed (an outage or an error reply), by component.",
            ("group", "component"),
        ),
    )
}
"""Counters, exposed as ``idem_<name>_total``."""

LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LATENESS_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

HISTOGRAMS: Final = {
    spec.name: (spec, buckets)
    for spec, buckets in (
        (MetricSpec("claim_duration_seconds", "Time to claim a batch's keys."), LATENCY_BUCKETS),
        (
            MetricSpec("commit_duration_seconds", "Time to commit a batch (ledger, then Redis)."),
            LATENCY_BUCKETS,
        ),
        (
            MetricSpec(
                "schedule_lateness_seconds",
                "How long past its due time the head of a schedule queue was moved.",
            ),
            LATENESS_BUCKETS,
        ),
    )
}
"""Histograms, exposed as ``idem_<name>`` (``_bucket``, ``_sum``, ``_count``)."""

GAUGES: Final = {
    spec.name: spec
    for spec in (
        MetricSpec(
            "dlq_messages",
            "Rows of %DLQ%<group> by original topic and status (DEAD, REPLAYED, DISCARDED).",
            ("group", "topic", "status"),
        ),
        MetricSpec(
            "retry_scheduled_messages",
            "Messages waiting in a schedule queue, by delay level (0: the timer queue).",
            ("group", "level"),
        ),
        MetricSpec(
            "retry_topic_messages",
            "Messages in %RETRY%<group>: undelivered, or delivered and not acknowledged.",
            ("group", "state"),
        ),
        MetricSpec("ledger_version", "The ledger's latest Delta version."),
        MetricSpec(
            "index_lag_versions",
            "Ledger versions the Redis index is behind, in its most lagging indexed bucket.",
        ),
        MetricSpec(
            "index_buckets_behind", "Indexed buckets whose Redis index is behind the ledger."
        ),
        MetricSpec(
            "index_buckets_missing",
            "Buckets with no Redis index of a ledger that has versions (rebuilt on next use).",
        ),
        MetricSpec(
            "group_state_up",
            "1 when the last read of the group's state succeeded, 0 when it failed (its other "
            "gauges are then absent).",
        ),
    )
}
"""Gauges of a group's state, exposed as ``idem_<name>`` by a :class:`StateCollector`."""


# -- the process's tallies ------------------------------------------------------------------


_Series = dict[str, dict[tuple[str, ...], _T]]
"""Values by metric name, then by label values."""


class _Tally:
    """Process-wide counts and histograms, by metric name and label values."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, dict[tuple[str, ...], float]] = {n: {} for n in COUNTERS}
        self.histograms: dict[str, dict[tuple[str, ...], list[float]]] = {n: {} for n in HISTOGRAMS}

    def count(self, name: str, values: tuple[str, ...], n: float) -> None:
        series = self.counters[name]
        with self._lock:
            series[values] = series.get(values, 0) + n

    def observe(self, name: str, values: tuple[str, ...], seconds: Iterable[float]) -> None:
        bounds = HISTOGRAMS[name][1]
        series = self.histograms[name]
        with self._lock:
            # per bound, then the +Inf bucket, then the sum
            row = series.setdefault(values, [0.0] * (len(bounds) + 2))
            for s in seconds:
                for i, bound in enumerate(bounds):
                    if s <= bound:
                        row[i] += 1
                row[-2] += 1
                row[-1] += s

    def snapshot(self) -> tuple[_Series[float], _Series[list[float]]]:
        with self._lock:
            return (
                {n: dict(s) for n, s in self.counters.items()},
                {n: {k: list(v) for k, v in s.items()} for n, s in self.histograms.items()},
            )


_TALLY = _Tally()


def _values(spec: MetricSpec, group: str, labels: Mapping[str, object]) -> tuple[str, ...]:
    given = {"group": group, **{k: str(v) for k, v in labels.items()}}
    if set(given) != set(spec.labels):
        raise ValueError(f"{PREFIX}{spec.name}: labels must be {spec.labels}, got {tuple(given)}")
    return tuple(str(given[label]) for label in spec.labels)


def count(name: str, group: str, n: float = 1, **labels: object) -> None:
    """Add ``n`` to counter ``name`` of ``group`` (with its other ``labels``).

    Called by idem's parts once per batch, move or failure; cheap and never raises for
    a known name. ``n`` of 0 adds nothing (and creates no series).
    """
    if n:
        _TALLY.count(name, _values(COUNTERS[name], group, labels), n)


def observe(name: str, group: str, *seconds: float) -> None:
    """Record durations (seconds) in histogram ``name`` of ``group``."""
    if seconds:
        _TALLY.observe(name, _values(HISTOGRAMS[name][0], group, {}), seconds)


def count_batch(
    group: str,
    counters: Mapping[str, int],
    *,
    timings: Mapping[str, float] | None = None,
    replay: bool = False,
) -> None:
    """Count one batch from its counter fields, as the group's totals name them.

    ``counters`` holds ``messages``, ``applied``, ``failed``, ``busy`` and
    ``duplicates.<cause>`` (missing ones count 0; others are ignored: retries and dead
    letters are counted where they are written). ``timings`` holds the seconds of the
    ``claim`` and ``commit`` steps. A ``replay`` (a batch counted before) adds only to
    ``idem_replays_total{kind="batch"}``, so a batch's rows are counted once.
    """
    if replay:
        count("replays", group, kind="batch")
        return
    for name in ("messages", "applied", "failed", "busy"):
        count(name, group, counters.get(name, 0))
    for field, n in counters.items():
        if field.startswith("duplicates."):
            count("duplicates", group, n, cause=field.removeprefix("duplicates."))
    for step in ("claim", "commit"):
        seconds = (timings or {}).get(step)
        if seconds is not None:
            observe(f"{step}_duration_seconds", group, seconds)


_KNOWN_REASONS: Final = (
    ("reconsume times reached max", "max_reconsume_times"),
    ("delay level < 0", "dead_letter_requested"),
    ("retrying for ", "max_elapsed"),
    ("reconsume_times: ", "reconsume_limit"),
    ("malformed: ", "malformed"),
    ("schema_mismatch: ", "schema_mismatch"),
    ("payload_mismatch: ", "payload_mismatch"),
    ("body: ", "too_large"),
    ("message: ", "too_large"),
    ("null: ", "invalid_key"),
    ("empty: ", "invalid_key"),
    ("too_long: ", "invalid_key"),
    ("not_text: ", "invalid_key"),
    ("undecodable: ", "undecodable"),
)
_INVALID_KEY = re.compile(r"^[^:]*: (key is |key must be text|cannot read the key)")


def reason_label(reason: str) -> str:
    """The kind of a dead letter's reason: one of a fixed set, ``other`` for the rest.

    A reason is free text (it names fields, sizes, errors); a label must not be.
    """
    for prefix, label in _KNOWN_REASONS:
        if reason.startswith(prefix):
            return label
    if _INVALID_KEY.match(reason):
        return "invalid_key"
    return "other"


def reset() -> None:
    """Forget every tally (tests; a process's counters otherwise only grow)."""
    global _TALLY  # noqa: PLW0603 -- one tally per process, replaced whole
    _TALLY = _Tally()


# -- exposing them ---------------------------------------------------------------------------


def _prometheus() -> Any:
    try:
        import prometheus_client  # noqa: PLC0415 -- optional: the metrics extra
        import prometheus_client.core  # noqa: PLC0415
    except ModuleNotFoundError as missing:
        if missing.name != "prometheus_client":
            raise
        raise ModuleNotFoundError(
            f"exposing metrics needs prometheus-client: {install_hint('metrics')}",
            name="prometheus_client",
        ) from missing
    return prometheus_client


class TallyCollector:
    """A Prometheus collector of this process's tallies (register it once per registry)."""

    def describe(self) -> list[Any]:
        """The families this collector yields (so a registry can refuse a name twice)."""
        return list(self.collect(empty=True))

    def collect(self, *, empty: bool = False) -> Iterator[Any]:
        """The counters and histograms, as Prometheus metric families."""
        core = _prometheus().core
        counters, histograms = ({}, {}) if empty else _TALLY.snapshot()
        for name, spec in COUNTERS.items():
            family = core.CounterMetricFamily(PREFIX + name, spec.help, labels=spec.labels)
            for values, n in sorted(counters.get(name, {}).items()):
                family.add_metric(list(values), n)
            yield family
        for name, (spec, bounds) in HISTOGRAMS.items():
            hist = core.HistogramMetricFamily(PREFIX + name, spec.help, labels=spec.labels)
            for values, row in sorted(histograms.get(name, {}).items()):
                buckets = [(_bound(b), row[i]) for i, b in enumerate(bounds)]
                buckets.append(("+Inf", row[-2]))
                hist.add_metric(list(values), buckets, row[-1])
            yield hist


def _bound(value: float) -> str:
    return repr(float(value))


STATE_READ_INTERVAL_S: Final = 5.0
"""Shortest time between two reads of a group's state: scrapes in between (several
Prometheus servers, a dashboard's refresh) answer the last values."""

GroupState = Mapping[str, Sequence[tuple[Mapping[str, str], float]]]
"""A group's state gauges: for each gauge name, its samples as (extra labels, value)."""


class StateCollector:
    """A group's state gauges, read by ``read`` when scraped, at most every ``min_interval_s``.

    ``read`` returns :data:`GroupState` (the gauges of :data:`GAUGES`); it may be slow (a
    DLQ count reads a Delta table), so a scrape within ``min_interval_s`` of the last
    read answers the last values. ``idem_group_state_up`` is 0 after a failed read, else 1.
    """

    def __init__(
        self,
        group: str,
        read: Callable[[], GroupState],
        *,
        min_interval_s: float = STATE_READ_INTERVAL_S,
    ) -> None:
        self.group = group
        self.read = read
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last: tuple[float, GroupState | None] | None = None

    def _state(self) -> GroupState | None:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self.min_interval_s:
                return self._last[1]
            try:
                state: GroupState | None = self.read()
            except Exception:  # a scrape must answer; the error gauge tells
                state = None
            self._last = (now, state)
            return state

    def describe(self) -> list[Any]:
        """The families this collector yields."""
        return list(self._families({}))

    def collect(self) -> Iterator[Any]:
        """The gauges, read now or at most ``min_interval_s`` ago."""
        state = self._state()
        up: GroupState = {"group_state_up": [({}, 1.0 if state is not None else 0.0)]}
        yield from self._families({**(state or {}), **up})

    def _families(self, state: GroupState) -> Iterator[Any]:
        core = _prometheus().core
        for name, spec in GAUGES.items():
            family = core.GaugeMetricFamily(PREFIX + name, spec.help, labels=spec.labels)
            for labels, value in state.get(name, ()):
                values = _values(spec, self.group, labels)
                family.add_metric(list(values), value)
            yield family


_REGISTERED: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()
"""Registries the tallies are registered in (weak: an id could be reused by a new one)."""
_REGISTER_LOCK = threading.Lock()


def registry(target: CollectorRegistry | None = None) -> CollectorRegistry:
    """``target`` (default: prometheus-client's global registry) with the tallies registered."""
    prometheus = _prometheus()
    reg: CollectorRegistry = prometheus.REGISTRY if target is None else target
    with _REGISTER_LOCK:
        if reg not in _REGISTERED:
            reg.register(TallyCollector())
            _REGISTERED.add(reg)
    return reg


Check = Callable[[], "str | None"]
"""A health or readiness check: ``None`` when fine, else what is wrong (answered with 503)."""


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` over HTTP, in a daemon thread."""

    def __init__(
        self,
        reg: CollectorRegistry,
        *,
        host: str,
        port: int,
        healthy: Check | None = None,
        ready: Check | None = None,
    ) -> None:
        prometheus = _prometheus()
        checks = {"/healthz": healthy, "/readyz": ready}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    text = prometheus.generate_latest(reg)
                    self._answer(200, text, prometheus.CONTENT_TYPE_LATEST)
                elif path in checks:
                    check = checks[path]
                    try:
                        problem = check() if check is not None else None
                    except Exception as exc:  # a check that fails is an answer: not ok
                        problem = f"{type(exc).__name__}: {exc}"
                    code = 200 if problem is None else 503
                    self._answer(code, f"{problem or 'ok'}\n".encode(), "text/plain; charset=utf-8")
                else:
                    self._answer(404, b"not found: try /metrics, /healthz, /readyz\n", "text/plain")

            def _answer(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                """Scrapes and probes every few seconds are not worth a log line each."""

        self.registry = reg
        self.collectors: list[Any] = []
        """Collectors :func:`serve` registered for this server (unregistered on close)."""
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"idem-metrics-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The server's base URL (``http://host:port``)."""
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop answering, free the port, and take the collectors it added off the registry."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        for extra in self.collectors:
            self.registry.unregister(extra)
        self.collectors = []

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    port: int,
    *,
    host: str = "127.0.0.1",
    collectors: Iterable[object] = (),
    healthy: Check | None = None,
    ready: Check | None = None,
    target: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve the process's metrics (and ``collectors``) on ``host:port`` (0: a free port).

    ``/metrics`` is the Prometheus text format of ``target`` (default: prometheus-client's
    global registry, so the process's own metrics appear too); ``/healthz`` and
    ``/readyz`` answer 200 ``ok`` or 503 with what ``healthy`` / ``ready`` say is wrong
    (no check: always ok). The checks run on the server's thread at every probe: they
    must be quick and must not block on a slow dependency without a timeout.
    """
    reg = registry(target)
    added: list[Any] = []
    try:
        for extra in collectors:
            reg.register(extra)  # type: ignore[arg-type]
            added.append(extra)
        server = MetricsServer(reg, host=host, port=port, healthy=healthy, ready=ready)
    except BaseException:
        for extra in added:
            reg.unregister(extra)
        raise
    server.collectors = added
    return server
