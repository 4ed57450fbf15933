"""idem.retry: RocketMQ's resend path on Redis, with a Delta journal and DLQ.

Send-back (:class:`SendBackProcessor`), the delay-level ladder
(:class:`DelayLevels`, re-exported from the core), the schedule service
(:class:`ScheduleService`), the retry topic ``%RETRY%<group>``
(:class:`RetryTopic`), the dead-letter table ``%DLQ%<group>``
(:class:`DeadLetterTable`), the retry journal (:class:`RetryJournal`), and the
facade that ties them together (:class:`RetryEngine`).
"""

from idem.delay_levels import (
    DEFAULT_DELAY_LEVELS,
    DEFAULT_MAX_RECONSUME_TIMES,
    FIRST_RETRY_LEVEL,
    DelayLevels,
)
from idem.retry.audit import StateAudit, audit_group, audit_states
from idem.retry.dlq import DLQ_SCHEMA, DeadLetter, DeadLetterId, DeadLetterStatus, DeadLetterTable
from idem.retry.engine import (
    RetryEngine,
    RetryStats,
    SendBackOutcome,
    SendBackResult,
    SendBackStatus,
)
from idem.retry.errors import DeadLetterError, JournalError
from idem.retry.faults import FaultTolerance
from idem.retry.journal import (
    JOURNAL_SCHEMA,
    JournalEvent,
    JournalEventType,
    JournalPosition,
    RetryJournal,
)
from idem.retry.message import (
    SCHEDULE_TOPIC,
    FailureRecord,
    MessageConst,
    MessageExt,
    busy_msg_id,
    dlq_topic,
    new_msg_id,
    retry_topic,
)
from idem.retry.policy import (
    Backoff,
    ComposedPolicy,
    Delay,
    DeliveryState,
    ExponentialRetryPolicy,
    RetryDecision,
    RetryPolicy,
    RocketMQLadder,
    Stop,
    exponential_backoff,
    fixed_backoff,
    ladder_backoff,
    stop_after_elapsed,
    stop_after_reconsume_times,
    stop_on_dead_letter_request,
)
from idem.retry.schedule import ScheduleService
from idem.retry.sendback import (
    BUSY_DELAY_LEVEL,
    DeadLettered,
    Scheduled,
    SendBackDecision,
    SendBackProcessor,
)
from idem.retry.status import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumeResult,
    MessageModel,
    OrderlyAction,
    OrderlyOutcome,
    orderly_outcome,
    run_listener,
    split_consume_result,
)
from idem.retry.store import RetryKeys, ScheduleStats, ScheduleStore
from idem.retry.topic import RetryTopic, message_timeup, reset_retry_topic

__all__ = [
    "BUSY_DELAY_LEVEL",
    "DEFAULT_DELAY_LEVELS",
    "DEFAULT_MAX_RECONSUME_TIMES",
    "DLQ_SCHEMA",
    "FIRST_RETRY_LEVEL",
    "JOURNAL_SCHEMA",
    "SCHEDULE_TOPIC",
    "Backoff",
    "ComposedPolicy",
    "ConsumeConcurrentlyContext",
    "ConsumeConcurrentlyStatus",
    "ConsumeOrderlyContext",
    "ConsumeOrderlyStatus",
    "ConsumeResult",
    "DeadLetter",
    "DeadLetterError",
    "DeadLetterId",
    "DeadLetterStatus",
    "DeadLetterTable",
    "DeadLettered",
    "Delay",
    "DelayLevels",
    "DeliveryState",
    "ExponentialRetryPolicy",
    "FailureRecord",
    "FaultTolerance",
    "JournalError",
    "JournalEvent",
    "JournalEventType",
    "JournalPosition",
    "MessageConst",
    "MessageExt",
    "MessageModel",
    "OrderlyAction",
    "OrderlyOutcome",
    "RetryDecision",
    "RetryEngine",
    "RetryJournal",
    "RetryKeys",
    "RetryPolicy",
    "RetryStats",
    "RetryTopic",
    "RocketMQLadder",
    "ScheduleService",
    "ScheduleStats",
    "ScheduleStore",
    "Scheduled",
    "SendBackDecision",
    "SendBackOutcome",
    "SendBackProcessor",
    "SendBackResult",
    "SendBackStatus",
    "StateAudit",
    "Stop",
    "audit_group",
    "audit_states",
    "busy_msg_id",
    "dlq_topic",
    "exponential_backoff",
    "fixed_backoff",
    "ladder_backoff",
    "message_timeup",
    "new_msg_id",
    "orderly_outcome",
    "reset_retry_topic",
    "retry_topic",
    "run_listener",
    "split_consume_result",
    "stop_after_elapsed",
    "stop_after_reconsume_times",
    "stop_on_dead_letter_request",
]
