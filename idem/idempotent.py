"""``@idempotent``: exactly-once for plain Python callables, keyed on a business key.

::

    @idempotent(key="order.order_id", config=IdemConfig(group="billing"))
    def charge(order: Order) -> dict[str, str]: ...

The first call with a key runs the function and records the key in the
ledger; later calls with the same key do not run it again and return the
recorded result (``replay_result=True``, JSON only) or ``None``.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar, cast

from idem.config import IdemConfig, MismatchPolicy
from idem.dedup import Dedup
from idem.errors import ConfigError, InvalidKey, KeyBusy, PayloadMismatch, SerializationError
from idem.keys import fingerprint
from idem.lease_keeper import LeaseKeeper

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger(__name__)

KeySource = str | Callable[..., object]
"""A dotted path into the call's arguments (``"order.order_id"``) or a callable."""


def _resolve_path(arguments: Mapping[str, object], path: str) -> object:
    head, *rest = path.split(".")
    if head not in arguments:
        raise ConfigError(f"key: {path!r} names the argument {head!r}, which this call lacks")
    value = arguments[head]
    for part in rest:
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
        if value is None:
            return None
    return value


def _to_json(value: object, *, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_json_default)
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"{what} is not JSON-serialisable: {exc}") from exc


def _json_default(value: object) -> object:
    if hasattr(value, "__dataclass_fields__"):
        return {name: getattr(value, name) for name in value.__dataclass_fields__}
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    if hasattr(value, "isoformat"):
        return cast(Any, value).isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def idempotent(
    *,
    key: KeySource,
    config: IdemConfig | None = None,
    dedup: Dedup | None = None,
    replay_result: bool = False,
    fingerprint_of: Callable[..., object] | None = None,
    on_mismatch: MismatchPolicy | str | None = None,
    on_dead_letter: Callable[[str, PayloadMismatch], None] | None = None,
    pass_key_as: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Make a callable run once per business key (and group) within the dedup window.

    The first call with a key runs the function; when it returns, the key is
    recorded as done in the Delta ledger (then in Redis). A later call with a key
    that is done does not run it and returns ``None`` (or the stored result, with
    ``replay_result``). If the function raises, the key is given back and the
    exception propagates: the next call runs it again. A call holds its key with a
    lease of ``lease_ms``, renewed every third of it while the function runs; a
    process that dies inside the body stops renewing, and a call after the lease
    expired runs the function again (the key was never completed). A call while
    another one holds the key raises
    :class:`KeyBusy`; a key that is null, empty, too long or not text raises
    :class:`InvalidKey`. The function must be synchronous (an awaitable result is
    refused with :class:`ConfigError`).

    Args:
        key: A dotted path into the call's bound arguments (``"order.order_id"``:
            attributes or mapping items), or a callable taking the same arguments
            and returning the key.
        config: The group's settings; a :class:`Dedup` is built from it on the
            first call. Pass exactly one of ``config`` and ``dedup``.
        dedup: A :class:`Dedup` to share with other decorated functions or
            consumers of the same group.
        replay_result: Store the result (it must be JSON-serialisable) with the
            key and return it on repeats; otherwise a repeat returns ``None``.
        fingerprint_of: Called with the call's arguments before the key is
            claimed; returns what identifies the payload (default: all arguments
            as JSON). It must be cheap and have no side effects. A repeat with a
            different fingerprint follows ``on_mismatch``.
        on_mismatch: What a repeat with another payload does (default: the
            config's ``mismatch_policy``): ``accept`` or ``warn`` (return as any
            repeat), ``raise`` (:class:`PayloadMismatch`) or ``dead_letter``.
        on_dead_letter: With ``dead_letter``, called as ``on_dead_letter(key,
            error)`` in the caller's thread instead of the function; the call then
            returns ``None``. It must not call the decorated function for that key
            (the key is done; the call would be a repeat again).
        pass_key_as: Name of a keyword parameter of the function through which it
            receives its normalised idempotency key (left out of the
            fingerprint).

    Returns:
        A decorator; the decorated function returns the function's result, or on
        a repeat ``None`` / the stored result.
    """
    if (config is None) == (dedup is None):
        raise ConfigError("idempotent: pass exactly one of config= or dedup=")
    if not (callable(key) or (isinstance(key, str) and key.strip(". "))):
        raise ConfigError(
            f"key: expected a dotted path into the arguments (e.g. 'order.order_id') or a "
            f"callable, got {key!r}"
        )
    if on_mismatch is not None:
        try:
            on_mismatch = MismatchPolicy(on_mismatch)
        except ValueError:
            allowed = ", ".join(m.value for m in MismatchPolicy)
            raise ConfigError(f"on_mismatch: {on_mismatch!r} is not one of {allowed}") from None
        if on_mismatch is MismatchPolicy.DEAD_LETTER and on_dead_letter is None:
            raise ConfigError("on_mismatch='dead_letter' needs on_dead_letter= to receive calls")
    settings = _Settings(
        key=key,
        config=config,
        dedup=dedup,
        replay_result=replay_result,
        fingerprint_of=fingerprint_of,
        on_mismatch=on_mismatch,
        on_dead_letter=on_dead_letter,
        pass_key_as=pass_key_as,
    )

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        call = _IdempotentCall(func, settings)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return call(args, kwargs)

        return wrapper

    return decorate


class _AppTransactions:
    """The Delta app transactions of one decorated function's calls: one app id per
    process and thread, its version counting that thread's calls.

    Delta keeps the last version of every app id in the table's state for ever, so an
    app id per call grew every snapshot and checkpoint of the ledger by one entry per
    call. The calls of one thread commit one after another, so their versions reach the
    ledger in order (a version below one already committed would read as a replay).
    """

    def __init__(self) -> None:
        self._token = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}

    def take(self, group: str) -> tuple[str, int]:
        """The app id and txn version of the calling thread's next commit."""
        app_id = f"idem:{group}:calls:{self._token}:{os.getpid()}:{threading.get_ident()}"
        with self._lock:  # a thread's ident may be reused later: its count goes on
            version = self._next.get(app_id, 0)
            self._next[app_id] = version + 1
        return app_id, version


@dataclass
class _Settings:
    key: KeySource
    config: IdemConfig | None
    dedup: Dedup | None
    replay_result: bool
    fingerprint_of: Callable[..., object] | None
    on_mismatch: MismatchPolicy | None
    on_dead_letter: Callable[[str, PayloadMismatch], None] | None
    pass_key_as: str | None


class _IdempotentCall(Generic[R]):
    """One decorated function: resolves key and fingerprint, runs it once per key."""

    def __init__(self, func: Callable[..., R], settings: _Settings) -> None:
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise ConfigError(
                f"idempotent: {func.__qualname__} is async; its body runs only when awaited, "
                "after the key would be completed. Decorate a synchronous function"
            )
        self.func = func
        self.s = settings
        self.txns = _AppTransactions()
        self.signature = inspect.signature(func)
        name = settings.pass_key_as
        if name is not None and name not in self.signature.parameters:
            raise ConfigError(f"pass_key_as: {func.__qualname__} has no parameter {name!r}")
        params = self.signature.parameters
        self.defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
        if isinstance(settings.key, str):
            head = settings.key.split(".")[0]
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            if head not in params and not takes_any:
                raise ConfigError(
                    f"key: {settings.key!r} names the argument {head!r}, which "
                    f"{func.__qualname__} does not take"
                )

    def dedup(self) -> Dedup:
        if self.s.dedup is None:
            assert self.s.config is not None
            self.s.dedup = Dedup(self.s.config)
        return self.s.dedup

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R | None:
        bound = self.signature.bind_partial(*args, **kwargs)
        arguments = {k: v for k, v in bound.arguments.items() if k != self.s.pass_key_as}
        key = self.s.key
        raw = (
            key(*args, **kwargs)
            if callable(key)
            else _resolve_path({**self.defaults, **arguments}, key)
        )
        payload = self.s.fingerprint_of(*args, **kwargs) if self.s.fingerprint_of else arguments
        printed = fingerprint(_to_json(payload, what="payload"))
        dd = self.dedup()
        owner = f"call:{uuid.uuid4().hex}"
        claim = dd.begin([raw], owner=owner, fingerprints=[printed], field=_field(key))
        if claim.invalid:
            bad = claim.invalid[0]
            raise InvalidKey(bad.message, field=bad.field, reason=bad.reason)
        if claim.busy:
            raise KeyBusy(str(claim.keys[0]))
        the_key = str(claim.keys[0])
        if claim.duplicates:
            stored = claim.stored_fingerprints.get(0) if claim.mismatched else None
            return self._on_repeat(dd, the_key, printed, mismatched_with=stored)
        if self.s.pass_key_as is not None:
            kwargs = {**kwargs, self.s.pass_key_as: the_key}
        try:
            with LeaseKeeper(dd, [the_key], owner):  # a call slower than the lease keeps it
                value = self.func(*args, **kwargs)
            if inspect.isawaitable(value):
                _close(value)
                raise ConfigError(
                    f"idempotent: {self.func.__qualname__} returned an awaitable; its work "
                    "would run after the key is completed. Decorate a synchronous function"
                )
        except BaseException:
            dd.release(claim)
            raise
        app_id, txn_version = self.txns.take(dd.config.group)
        try:
            stored = _to_json(value, what="result") if self.s.replay_result else None
        except SerializationError as exc:
            # The body ran: its key is completed all the same (running it again is what
            # this decorator exists to prevent), without a result to replay.
            dd.complete(claim, batch_id=txn_version, app_id=app_id)
            raise SerializationError(
                f"{exc}; the call ran and key {the_key!r} is completed, but a repeat cannot "
                "return this result (replay_result needs JSON values)"
            ) from exc
        dd.complete(
            claim,
            batch_id=txn_version,
            app_id=app_id,
            results={0: stored} if stored is not None else None,
        )
        return value

    def _on_repeat(
        self, dd: Dedup, the_key: str, printed: str, *, mismatched_with: str | None
    ) -> R | None:
        if mismatched_with is not None:
            policy = self.s.on_mismatch or dd.config.mismatch_policy
            error = PayloadMismatch(the_key, stored=mismatched_with, seen=printed)
            if policy is MismatchPolicy.RAISE:
                raise error
            if policy is MismatchPolicy.DEAD_LETTER:
                if self.s.on_dead_letter is None:
                    raise ConfigError(
                        "mismatch_policy 'dead_letter' needs on_dead_letter= to receive calls"
                    )
                self.s.on_dead_letter(the_key, error)
                return None
            if policy is MismatchPolicy.WARN:
                log.warning("%s", error)
        if not self.s.replay_result:
            return None
        stored = dd.ledger.lookup_results([the_key]).get(the_key)
        return cast(R, json.loads(stored)) if stored else None


def _close(awaitable: object) -> None:
    """Close a coroutine that will never be awaited (no "never awaited" warning)."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()


def _field(key: KeySource) -> str:
    return key if isinstance(key, str) else getattr(key, "__name__", "key")
