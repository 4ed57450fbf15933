"""Errors of the consumer runtime (all under :class:`idem.errors.IdemError`)."""

from __future__ import annotations

from idem.errors import IdemError


class MQClientError(IdemError):
    """A client-side failure of the producer or consumer (RocketMQ's ``MQClientException``)."""


class SendFailed(MQClientError):
    """Every attempt of a send failed; the message may or may not have been stored."""
