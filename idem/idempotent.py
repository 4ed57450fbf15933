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
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar, cast

from idem.config import IdemConfig, MismatchPolicy
from idem.dedup import Dedup
from idem.errors import ConfigError, InvalidKey, KeyBusy, PayloadMismatch, SerializationError
from idem.keys import fingerprint

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger(__name__)

KeySource = str | Callable[..., object]
"""A dotted path into the call's arguments (``"order.order_id"``) or a callable."""


def _resolve_path(arguments: Mapping[str, object], path: str) -> object:
    head, *rest = path.split(".")
    if head not in arguments:
        raise ConfigError(
            f"key: {path!r} names the argument {head!r}, which the function does not take"
        )
    value = arguments[head]
    for part in rest:
        if isinstance(value, Mapping):
            value = value.get(part)
        else:
            value = getattr(value, part, None)
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
    """Make a callable run at most once per business key (and group).

    - ``key``: dotted path into the bound arguments, or a callable taking the
      same arguments and returning the key.
    - ``replay_result``: store the JSON result and return it on repeats.
    - ``fingerprint_of``: what identifies the payload (default: all arguments as
      JSON); a repeat with a different fingerprint follows ``on_mismatch``
      (default: the config's ``mismatch_policy``): ``accept``, ``warn``,
      ``raise`` (:class:`PayloadMismatch`) or ``dead_letter`` (``on_dead_letter``
      is called and ``None`` returned).
    - ``pass_key_as``: name of a keyword argument through which the function
      receives its idempotency key.
    """
    if (config is None) == (dedup is None):
        raise ConfigError("idempotent: pass exactly one of config= or dedup=")
    shared: list[Dedup] = [dedup] if dedup is not None else []

    def engine() -> Dedup:
        if not shared:
            assert config is not None
            shared.append(Dedup(config))
        return shared[0]

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        signature = inspect.signature(func)
        if pass_key_as is not None and pass_key_as not in signature.parameters:
            raise ConfigError(f"pass_key_as: {func.__qualname__} has no parameter {pass_key_as!r}")

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            bound = signature.bind_partial(*args, **kwargs)
            arguments = {k: v for k, v in bound.arguments.items() if k != pass_key_as}
            raw = key(*args, **kwargs) if callable(key) else _resolve_path(arguments, key)
            payload = fingerprint_of(*args, **kwargs) if fingerprint_of else arguments
            printed = fingerprint(_to_json(payload, what="payload"))
            dd = engine()
            owner = f"call:{uuid.uuid4().hex}"
            claim = dd.begin([raw], owner=owner, fingerprints=[printed], field=_field(key))
            if claim.invalid:
                bad = claim.invalid[0]
                raise InvalidKey(bad.message, field=bad.field, reason=bad.reason)
            if claim.busy:
                raise KeyBusy(str(claim.keys[0]))
            the_key = str(claim.keys[0])
            if claim.duplicates:
                return _on_repeat(dd, claim.mismatched != (), the_key, printed)
            call_kwargs = dict(kwargs)
            if pass_key_as is not None:
                call_kwargs[pass_key_as] = the_key
            try:
                value = func(*args, **call_kwargs)  # type: ignore[arg-type]
            except BaseException:
                dd.release(claim)
                raise
            stored = _to_json(value, what="result") if replay_result else None
            dd.complete(claim, batch_id=0, results={0: stored} if stored else None)
            return value

        def _on_repeat(dd: Dedup, mismatched: bool, the_key: str, printed: str) -> R | None:
            if mismatched:
                policy = MismatchPolicy(on_mismatch or dd.config.mismatch_policy)
                error = PayloadMismatch(the_key, stored="(completed)", seen=printed)
                if policy is MismatchPolicy.RAISE:
                    raise error
                if policy is MismatchPolicy.DEAD_LETTER:
                    if on_dead_letter is None:
                        raise ConfigError(
                            "on_mismatch='dead_letter' needs on_dead_letter= to receive the call"
                        )
                    on_dead_letter(the_key, error)
                    return None
                if policy is MismatchPolicy.WARN:
                    log.warning("%s", error)
            if not replay_result:
                return None
            stored = dd.ledger.lookup_results([the_key]).get(the_key)
            return cast(R, json.loads(stored)) if stored else None

        return wrapper

    return decorate


def _field(key: KeySource) -> str:
    return key if isinstance(key, str) else getattr(key, "__name__", "key")
