"""%RETRY%<group> on read: schedule form undone, original topic restored (fakeredis)."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.retry import (
    SCHEDULE_TOPIC,
    MessageConst,
    MessageExt,
    RetryEngine,
    message_timeup,
    reset_retry_topic,
)

pytestmark = pytest.mark.unit


def test_timeup_lands_in_the_real_topic_and_reset_restores_the_original() -> None:
    scheduled = MessageExt(
        topic=SCHEDULE_TOPIC,
        msg_id="N",
        queue_id=2,
        reconsume_times=1,
        properties={
            MessageConst.PROPERTY_REAL_TOPIC: "%RETRY%g",
            MessageConst.PROPERTY_REAL_QUEUE_ID: "0",
            MessageConst.PROPERTY_DELAY_TIME_LEVEL: "3",
            MessageConst.PROPERTY_RETRY_TOPIC: "TopicTest",
        },
    )
    landed = message_timeup(scheduled, queue_offset=51, store_timestamp=7)
    assert (landed.topic, landed.queue_id, landed.queue_offset, landed.store_timestamp) == (
        "%RETRY%g",
        0,
        51,
        7,
    )
    for name in ("REAL_TOPIC", "REAL_QID", "DELAY"):
        assert name not in landed.properties
    assert reset_retry_topic(landed, "g").topic == "TopicTest"
    assert reset_retry_topic(landed, "other-group").topic == "%RETRY%g"
    plain = MessageExt(topic="TopicTest", msg_id="M")
    assert reset_retry_topic(plain, "g") is plain


def test_range_reads_what_a_stream_source_plans(tmp_path: Path, clock: ManualClock) -> None:
    config = IdemConfig(group="CID_topic", data_dir=str(tmp_path))
    engine = RetryEngine(config, client=fakeredis.FakeRedis(), clock=clock)
    engine.send_back(
        [MessageExt(topic="TopicTest", msg_id=f"M{i}", keys=f"K{i}") for i in range(5)],
        delay_level=1,
    )
    clock.advance(1)
    assert engine.tick() == 5
    ids = [entry[0].decode() for entry in engine.client.xrange(engine.store.keys.stream)]
    everything = engine.topic.range("0-0")
    assert [m.origin_msg_id for m in everything] == [f"M{i}" for i in range(5)]
    assert [m.queue_offset for m in everything] == [0, 1, 2, 3, 4]
    middle = engine.topic.range(ids[1], ids[3])
    assert [m.origin_msg_id for m in middle] == ["M2", "M3"]
    assert all(m.topic == "TopicTest" and m.reconsume_times == 1 for m in everything)
    engine.ack(middle)
    assert [m.origin_msg_id for m in engine.topic.range("0-0")] == ["M0", "M1", "M4"]
