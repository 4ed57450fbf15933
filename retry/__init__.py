"""idem.retry: RocketMQ's resend path on Redis, with a Delta journal and DLQ."""
