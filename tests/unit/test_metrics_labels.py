"""idem.metrics: bounded labels, and the Prometheus text a scrape gets.

The dead-letter reasons are the ones idem's own code writes (the policy, the key
check, the size limit), so a reworded reason that would fall into ``other`` fails here.
"""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import CollectorRegistry
from scrape import scrape, value

from idem import metrics
from idem.errors import InvalidKey
from idem.keys import validate_key
from idem.retry.message import MessageExt
from idem.retry.policy import DeliveryState, stop_after_reconsume_times, stop_on_dead_letter_request
from idem.retry.sendback import oversize_reason

pytestmark = pytest.mark.unit


def _key_reason(value: object) -> str:
    with pytest.raises(InvalidKey) as refused:
        validate_key(value, field="order_id", max_bytes=8)
    return str(refused.value)


def _state(**changes: object) -> DeliveryState:
    settings: dict[str, object] = {
        "key": "K", "reconsume_times": 16, "first_seen_ms": 0, "now_ms": 1,
        "last_error": "boom", "requested_level": -1, "topic": "orders",
    }  # fmt: skip
    return DeliveryState(**{**settings, **changes})  # type: ignore[arg-type]


def test_dead_letter_reasons_idem_writes_fall_into_their_kinds() -> None:
    message = MessageExt(topic="orders", msg_id="m", body=b"x" * 100, keys="K")
    reasons = {
        stop_after_reconsume_times(16).explain(_state()): "max_reconsume_times",
        stop_on_dead_letter_request().explain(_state()): "dead_letter_requested",
        oversize_reason(message, message.to_wire(), 10) or "": "too_large",
        _key_reason(None): "invalid_key",
        _key_reason(""): "invalid_key",
        _key_reason("a-very-long-key"): "invalid_key",
        _key_reason(12): "invalid_key",
        # the Spark glue writes "<kind>: <message>"
        f"null: {_key_reason(None)}": "invalid_key",
        "malformed: amount: not a number": "malformed",
        "schema_mismatch: amount: DECIMAL(10,2) cannot hold 1e40": "schema_mismatch",
        "payload_mismatch: completed before with a different payload": "payload_mismatch",
        "a reason of the user's own policy": "other",
    }
    assert {reason: metrics.reason_label(reason) for reason in reasons} == reasons


def test_a_scrape_shows_counts_and_cumulative_histograms_by_group() -> None:
    group = f"u-{uuid.uuid4().hex[:8]}"
    metrics.count_batch(
        group,
        {"messages": 10, "applied": 6, "failed": 1, "busy": 1, "duplicates.in_batch": 2},
        timings={"claim": 0.003, "commit": 0.2},
    )
    metrics.count_batch(group, {"messages": 10}, replay=True)
    metrics.observe("schedule_lateness_seconds", group, 0.004, 0.7, 120.0)
    with metrics.serve(0, target=CollectorRegistry()) as http:
        samples = scrape(http.url)

    def v(name: str, **labels: object) -> float | None:
        return value(samples, name, group=group, **labels)

    assert (v("idem_messages_total"), v("idem_applied_total")) == (10, 6)
    assert (v("idem_failed_total"), v("idem_busy_total")) == (1, 1)
    assert v("idem_duplicates_total", cause="in_batch") == 2
    assert v("idem_replays_total", kind="batch") == 1
    assert v("idem_claim_duration_seconds_bucket", le="0.0025") == 0
    assert v("idem_claim_duration_seconds_bucket", le="0.005") == 1
    assert v("idem_commit_duration_seconds_count") == 1
    assert v("idem_schedule_lateness_seconds_bucket", le="0.005") == 1
    assert v("idem_schedule_lateness_seconds_bucket", le="1.0") == 2
    assert v("idem_schedule_lateness_seconds_bucket", le="60.0") == 2
    assert v("idem_schedule_lateness_seconds_bucket", le="+Inf") == 3
    assert v("idem_schedule_lateness_seconds_sum") == pytest.approx(120.704)


def test_a_label_outside_a_metrics_set_is_refused() -> None:
    with pytest.raises(ValueError, match=r"idem_duplicates: labels must be \('group', 'cause'\)"):
        metrics.count("duplicates", "g", 1, key="ORDER-1")


def test_a_state_read_that_fails_is_a_gauge_not_a_failed_scrape() -> None:
    def broken() -> metrics.GroupState:
        raise ConnectionError("Redis is away")

    registry = CollectorRegistry()
    registry.register(metrics.StateCollector("g", broken, min_interval_s=0))
    with metrics.serve(0, target=registry) as http:
        samples = scrape(http.url)
    assert value(samples, "idem_group_state_up", group="g") == 0
