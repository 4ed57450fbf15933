"""The console's HTML: server-rendered pages, no script, no asset fetched from anywhere.

Every value from the stores is escaped (:func:`html.escape`); a dead letter's body
is user data and is shown as text only.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import urlencode

from idem.console.data import RetryView, Sample, Whereabouts
from idem.index_status import IndexStatus
from idem.retry.dlq import DeadLetter

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f5f6f8}
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:24px;align-items:center}
header a{color:#cfe0ff;text-decoration:none}header strong{font-size:16px}
main{padding:16px 20px;max-width:1200px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:12px 16px;
margin:0 0 16px}
h2{font-size:15px;margin:0 0 8px}table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceef2;vertical-align:top}
th{color:#5a6372;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
code,pre{font:12px ui-monospace,monospace}pre{background:#f5f6f8;padding:8px;overflow:auto}
.muted{color:#6b7380}.err{color:#a4000f}.ok{color:#0a6b2d}
.badge{display:inline-block;padding:0 6px;border-radius:3px;font-size:12px;background:#eceef2}
.DEAD{background:#ffe1e1}.REPLAYED{background:#def5e5}.DISCARDED{background:#eceef2}
form.inline{display:inline}input,button{font:inherit;padding:3px 8px}
button.danger{background:#a4000f;color:#fff;border:0;border-radius:3px}
button.go{background:#1d5bd6;color:#fff;border:0;border-radius:3px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:16px}
"""


def utc(ms: int | None) -> str:
    """``ms`` since the epoch as ``YYYY-MM-DD HH:MM:SS`` UTC (``—`` for none)."""
    if ms is None:
        return "—"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def relative(ms: int | None, now_ms: int) -> str:
    """``in 4s`` / ``12s ago`` / ``due now``."""
    if ms is None:
        return ""
    delta = (ms - now_ms) / 1000
    if abs(delta) < 1:
        return "due now"
    span = _span(abs(delta))
    return f"in {span}" if delta > 0 else f"{span} ago"


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def layout(group: str, title: str, body: str) -> str:
    """A whole page around ``body`` (already HTML)."""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{escape(title)} · idem console · {escape(group)}</title>"
        f"<style>{_STYLE}</style></head><body><header><strong>idem console</strong>"
        f"<span>group <code>{escape(group)}</code></span>"
        '<a href="/">overview</a><a href="/dlq">dead letters</a>'
        '<form class=inline action="/search" method=get>'
        '<input name=q placeholder="key or message id" aria-label="search" size=28> '
        "<button>find</button></form></header>"
        f"<main>{body}</main></body></html>"
    )


def section(title: str, content: str) -> str:
    """A titled box."""
    return f"<section><h2>{escape(title)}</h2>{content}</section>"


def failed(what: str, error: BaseException) -> str:
    """A read that failed, said in the box where its data would be."""
    kind = escape(type(error).__name__)
    return f"<p class=err>could not read {escape(what)}: {kind}: {escape(str(error))}</p>"


def _table(
    head: Sequence[str], rows: Iterable[Sequence[str]], *, numeric: set[int] | None = None
) -> str:
    numeric = numeric or set()
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class=n>{c}</td>" if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def retries(view: RetryView, now_ms: int) -> str:
    """Messages waiting per retry level, and the retry topic."""
    if view.levels:
        levels = _table(
            ("level", "waiting", "next due (UTC)", ""),
            (
                (
                    escape(r.level),
                    str(r.waiting),
                    utc(r.next_due_ms),
                    relative(r.next_due_ms, now_ms),
                )
                for r in view.levels
            ),
            numeric={1},
        )
    else:
        levels = "<p class=muted>nothing scheduled</p>"
    return levels + (
        f"<p>retry topic: <b>{view.retry_topic_length}</b> entries, {view.undelivered} not yet "
        f"delivered, {view.delivered_unacked} delivered and not acknowledged · "
        f"{view.live} live message(s) · next due {utc(view.next_due_ms)} "
        f"{relative(view.next_due_ms, now_ms)} · journal version "
        f"{'—' if view.journal_version is None else view.journal_version}</p>"
    )


def letter_link(d: DeadLetter) -> str:
    """A link to one dead letter's page."""
    return f'<a href="/letter?{urlencode({"id": d.msg_id})}">{escape(d.key or "∅")}</a>'


def letters(rows: Sequence[DeadLetter], *, exists: bool) -> str:
    """A table of dead letters with their reason."""
    if not exists:
        return "<p class=muted>no %DLQ% table yet: nothing dead-lettered in this group</p>"
    if not rows:
        return "<p class=muted>no dead letters with this status</p>"
    return _table(
        ("dead at (UTC)", "key", "status", "times", "reason", "last error", "msg id"),
        (
            (
                utc(d.dead_at_ms),
                letter_link(d),
                f'<span class="badge {escape(d.status.value)}">{escape(d.status.value)}</span>',
                str(d.reconsume_times),
                escape(d.reason or ""),
                escape((d.last_error or "")[:160]),
                f"<code>{escape(d.msg_id)}</code>",
            )
            for d in rows
        ),
        numeric={3},
    )


def letter(described: dict[str, Any], d: DeadLetter) -> str:
    """One dead letter in full, with its actions when it is still ``DEAD``."""
    rows = [
        ("status", f'<span class="badge {escape(d.status.value)}">{escape(d.status.value)}</span>'),
        ("key", escape(d.key or "∅")),
        ("msg id", f"<code>{escape(d.msg_id)}</code>"),
        ("origin msg id", f"<code>{escape(d.origin_msg_id)}</code>"),
        ("topic", escape(d.topic)),
        ("reason", escape(d.reason or "")),
        ("reconsume times", str(d.reconsume_times)),
        ("first failed (UTC)", utc(d.first_failed_at_ms)),
        ("dead at (UTC)", utc(d.dead_at_ms)),
        ("replayed / discarded at (UTC)", utc(d.replayed_at_ms)),
        ("by", escape(d.replayed_by or "—")),
        ("last error", escape(d.last_error or "")),
    ]
    info = _table(("", ""), rows)
    errors = _table(
        ("at (UTC)", "type", "message"),
        ((utc(e.at_ms), escape(e.type), escape(e.message)) for e in d.errors),
    )
    shown = described["row"] if described["row"] is not None else described["body"]
    body = escape(json.dumps(shown, indent=2, ensure_ascii=False, default=str))
    actions = ""
    if d.status.value == "DEAD":
        actions = "<p>" + _action_button("replay", d) + " " + _action_button("discard", d) + "</p>"
    return (
        section("dead letter", info + actions)
        + section("row", f"<pre>{body}</pre>")
        + section("errors", errors)
    )


def _action_button(action: str, d: DeadLetter) -> str:
    """A button to the confirmation page of ``action`` (a GET: nothing happens yet)."""
    cls = "go" if action == "replay" else "danger"
    return (
        '<form class=inline method=get action="/confirm">'
        f'<input type=hidden name=action value="{action}">'
        f'<input type=hidden name=id value="{escape(d.msg_id)}">'
        f"<button class={cls}>{action}…</button></form>"
    )


_ACTION_TEXT = {
    "replay": (
        "Replay",
        "sends it back through the group's retry path at delay level 1; it reaches the sink "
        "through the dedup layer like any delivery, so a key completed within the dedup window "
        "is not applied again. The row is marked REPLAYED with who and when.",
    ),
    "discard": (
        "Discard",
        "marks it DISCARDED with who and when. Nothing is sent; the row stays in the table.",
    ),
}


def confirm(action: str, d: DeadLetter, *, default_by: str) -> str:
    """The confirmation form of an action: it takes the console's token and who acts."""
    verb, text = _ACTION_TEXT[action]
    return section(
        f"{verb} dead letter {d.key or d.msg_id}?",
        f"<p>{escape(verb)} {escape(text)}</p>"
        f'<form method=post action="/{escape(action)}">'
        f'<input type=hidden name=id value="{escape(d.msg_id)}">'
        "<p><label>console token <input type=password name=token autocomplete=current-password "
        "required></label></p>"
        f'<p><label>by <input name=by value="{escape(default_by)}" size=30></label> '
        "<span class=muted>(recorded in replayed_by)</span></p>"
        f'<p><button class="{"go" if action == "replay" else "danger"}" name=confirm value=yes>'
        f"{escape(verb)}</button> "
        f'<a href="/letter?{urlencode({"id": d.msg_id})}">cancel</a></p></form>',
    )


def duplicates(samples: Sequence[Sample], *, limit: int = 12) -> str:
    """Duplicates by cause: the totals at each sample and the change since the one before."""
    if not samples:
        return "<p class=muted>no sample yet</p>"
    causes = sorted({c for s in samples for c in s.duplicates})
    if not causes:
        return f"<p class=muted>no duplicate suppressed so far (as of {utc(samples[-1].at_ms)})</p>"
    shown = list(samples)[-limit:]
    start = len(samples) - len(shown)
    rows = []
    for i, s in enumerate(shown, start=start):
        before = samples[i - 1].duplicates if i > 0 else None
        cells = [utc(s.at_ms)]
        for c in causes:
            n = s.duplicates.get(c, 0)
            grew = "" if before is None else f" <span class=muted>(+{n - before.get(c, 0)})</span>"
            cells.append(f"{n}{grew}")
        rows.append(cells)
    rows.reverse()  # newest first
    return _table(("sampled at (UTC)", *causes), rows, numeric=set(range(1, len(causes) + 1)))


def index(status: IndexStatus | None) -> str:
    """The Redis index against the ledger."""
    if status is None:
        return "<p class=muted>no ledger table yet</p>"
    lag = status.lag
    lag_text = "no bucket indexed yet" if lag is None else f"{lag} version(s)"
    summary = (
        f"<p>ledger <code>{escape(status.ledger_path)}</code> at version "
        f"<b>{status.ledger_version}</b>; index lag <b>{lag_text}</b>; "
        f"{status.held} completed key(s) held in Redis; {status.to_catch_up} of "
        f"{len(status.buckets)} bucket(s) to catch up"
        + (
            f" ({status.missing} never indexed: rebuilt from the ledger on first use)"
            if status.missing
            else ""
        )
        + "</p>"
    )
    if status.ahead:
        summary += (
            f"<p class=err>{status.ahead} bucket(s) indexed versions past this ledger's: Redis "
            "indexes another table (a Delta sink's table is its own ledger: start the console "
            "with --ledger-path TABLE)</p>"
        )
    table = _table(
        ("bucket", "indexed version", "keys", "state"),
        (
            (
                str(b.bucket),
                "—" if b.indexed_version is None else str(b.indexed_version),
                str(b.keys),
                escape(b.state),
            )
            for b in status.buckets
        ),
        numeric={0, 1, 2},
    )
    return summary + f"<details><summary>per bucket</summary>{table}</details>"


def whereabouts(found: Whereabouts) -> str:
    """Where a key or message id is now."""
    lines = []
    if found.done is True:
        lines.append("<li class=ok><b>done</b>: the ledger holds this key</li>")
    elif found.done is False:
        lines.append("<li>not in the ledger (not done, or not a key)</li>")
    else:
        lines.append("<li class=muted>no ledger to ask</li>")
    for line in found.retrying:
        lines.append(f"<li><b>retrying</b>: {escape(line)}</li>")
    for d in found.dead:
        lines.append(
            f"<li><b>{escape(d.status.value.lower())}</b> dead letter {letter_link(d)} "
            f"<code>{escape(d.msg_id)}</code>, dead at {utc(d.dead_at_ms)}: "
            f"{escape(d.reason or '')} {escape(d.last_error or '')}</li>"
        )
    if not found.retrying and not found.dead and found.done is not True:
        lines.append("<li class=muted>not retrying and not dead-lettered</li>")
    return section(f"where is {found.term}", "<ul>" + "".join(lines) + "</ul>")


def message(title: str, text: str, *, ok: bool, back: str = "/") -> str:
    """The outcome of an action."""
    cls = "ok" if ok else "err"
    return section(
        title, f'<p class={cls}>{escape(text)}</p><p><a href="{escape(back)}">back</a></p>'
    )


def guarded(what: str, read: Callable[[], str]) -> str:
    """``read()``'s HTML, or the error that stopped it in its place."""
    try:
        return read()
    except Exception as exc:  # a store being down must not take the whole page with it
        return failed(what, exc)
