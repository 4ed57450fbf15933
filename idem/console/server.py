"""The console's HTTP server: the standard library's ``ThreadingHTTPServer``.

Reads are GETs and change nothing. Replay and discard are POSTs, each refused
(403) unless it carries the console's token — the form field ``token`` or the
header ``X-Idem-Token`` — compared in constant time. The token is never put into
a page: the confirmation form asks for it, so a page someone else opened cannot
act, and neither can another site posting into the console. Bound to a loopback
address, the server also refuses requests naming another host (``Host``), which
keeps pages of other sites from reading it through a name that resolves to
127.0.0.1.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from idem.console import pages
from idem.console.data import GroupView
from idem.retry.dlq import DeadLetterStatus

log = logging.getLogger(__name__)

TOKEN_HEADER = "X-Idem-Token"  # noqa: S105 -- a header name, not a secret
"""The header an action may carry the token in (instead of the ``token`` form field)."""

MAX_FORM_BYTES = 64 * 1024
"""The largest POST body taken; larger ones are refused (413)."""

_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def new_token() -> str:
    """A fresh random token (URL-safe, 32 bytes of entropy)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) only reaches this machine."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Console:
    """What the handler needs: the group, the token, who acts when the form names no one."""

    view: GroupView
    token: str
    default_by: str
    loopback_only: bool = True
    recent_letters: int = 20

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("token: must not be empty")
        self.action_lock = threading.Lock()

    def token_ok(self, given: str | None) -> bool:
        """Whether ``given`` is the token (constant time)."""
        if not given:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())


class ConsoleServer(ThreadingHTTPServer):
    """The HTTP server of one console; :meth:`start_sampling` keeps the duplicates history."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], console: Console) -> None:
        self.console = console
        self._stop_sampling = threading.Event()
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        """``http://host:port/`` of the bound socket."""
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{name}]" if ":" in name else name
        return f"http://{shown}:{port}/"

    def start_sampling(self, every_s: float) -> threading.Thread:
        """Sample the duplicate counters every ``every_s`` seconds until :meth:`server_close`."""

        def loop() -> None:
            while not self._stop_sampling.is_set():
                try:
                    self.console.view.sample_duplicates()
                except Exception:  # Redis down: the page says so; keep sampling
                    log.warning("sampling the duplicate counters failed", exc_info=True)
                self._stop_sampling.wait(every_s)

        thread = threading.Thread(target=loop, name="idem-console-sampler", daemon=True)
        thread.start()
        return thread

    def server_close(self) -> None:
        """Stop sampling and close the socket."""
        self._stop_sampling.set()
        super().server_close()


class _Handler(BaseHTTPRequestHandler):
    server: ConsoleServer
    server_version = "idem-console"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # -- plumbing --------------------------------------------------------------------------

    @property
    def console(self) -> Console:
        return self.server.console

    def _send(self, status: HTTPStatus, html: str) -> None:
        data = html.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
            "frame-ancestors 'none'",
        )
        self.send_header("Referrer-Policy", "no-referrer")
        self.end_headers()
        self.wfile.write(data)

    def _page(self, status: HTTPStatus, title: str, body: str) -> None:
        self._send(status, pages.layout(self.console.view.group, title, body))

    def _host_ok(self) -> bool:
        if not self.console.loopback_only:
            return True
        host = self.headers.get("Host", "")
        name = urlsplit(f"//{host}").hostname or ""
        return is_loopback(name)

    def _refuse_host(self) -> None:
        self._page(
            HTTPStatus.FORBIDDEN,
            "refused",
            pages.message("refused", "this console answers on its loopback address only", ok=False),
        )

    # -- GET -------------------------------------------------------------------------------

    def do_GET(self) -> None:
        if not self._host_ok():
            self._refuse_host()
            return
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        routes = {
            "/": self._overview,
            "/dlq": self._dlq,
            "/letter": self._letter,
            "/confirm": self._confirm,
            "/search": self._search,
        }
        route = routes.get(url.path)
        if route is None:
            self._page(
                HTTPStatus.NOT_FOUND, "not found", pages.message("not found", url.path, ok=False)
            )
            return
        route(query)

    def _overview(self, query: dict[str, str]) -> None:
        view = self.console.view
        now = int(time.time() * 1000)

        def dead() -> str:
            rows = view.dead_letters(
                status=DeadLetterStatus.DEAD, limit=self.console.recent_letters
            )
            return pages.letters(rows, exists=view.dlq_exists())

        def duplicates() -> str:
            view.sample_duplicates()
            return pages.duplicates(view.history.snapshot())

        body = (
            pages.section(
                "retries waiting, by level",
                pages.guarded("the retry queues", lambda: pages.retries(view.retries(), now)),
            )
            + pages.section(
                f"recent dead letters (DEAD, newest {self.console.recent_letters})",
                pages.guarded("the %DLQ% table", dead),
            )
            + "<div class=grid>"
            + pages.section(
                "duplicates suppressed, by cause", pages.guarded("the counters", duplicates)
            )
            + pages.section(
                "index lag", pages.guarded("the index", lambda: pages.index(view.index()))
            )
            + "</div>"
        )
        self._page(HTTPStatus.OK, "overview", body)

    def _dlq(self, query: dict[str, str]) -> None:
        view = self.console.view
        wanted = query.get("status", "dead").lower()
        status = None if wanted == "all" else _status(wanted)
        try:
            limit = max(1, min(int(query.get("limit", "100")), 10_000))
        except ValueError:
            limit = 100
        filters = " · ".join(
            f'<a href="/dlq?status={s}">{s}</a>' for s in ("dead", "replayed", "discarded", "all")
        )

        def table() -> str:
            return pages.letters(
                view.dead_letters(status=status, limit=limit), exists=view.dlq_exists()
            )

        self._page(
            HTTPStatus.OK,
            "dead letters",
            pages.section(
                f"dead letters ({wanted}, newest {limit})",
                f"<p>{filters}</p>" + pages.guarded("the %DLQ% table", table),
            ),
        )

    def _letter(self, query: dict[str, str]) -> None:
        found = self.console.view.dead_letter(query.get("id", ""))
        if found is None:
            self._page(
                HTTPStatus.NOT_FOUND,
                "not found",
                pages.message("not found", f"no dead letter {query.get('id', '')!r}", ok=False),
            )
            return
        from idem.spark.dlq import describe  # noqa: PLC0415 -- needs PySpark (like the console)

        self._page(HTTPStatus.OK, f"dead letter {found.key}", pages.letter(describe(found), found))

    def _confirm(self, query: dict[str, str]) -> None:
        action = query.get("action", "")
        found = self.console.view.dead_letter(query.get("id", ""))
        if action not in ("replay", "discard") or found is None:
            self._page(
                HTTPStatus.NOT_FOUND,
                "not found",
                pages.message("not found", "no such dead letter or action", ok=False),
            )
            return
        self._page(
            HTTPStatus.OK,
            f"{action} {found.key}",
            pages.confirm(action, found, default_by=self.console.default_by),
        )

    def _search(self, query: dict[str, str]) -> None:
        term = query.get("q", "").strip()
        if not term:
            self._page(
                HTTPStatus.OK,
                "search",
                pages.message("search", "name a key or a message id", ok=False),
            )
            return
        view = self.console.view
        self._page(
            HTTPStatus.OK,
            f"where is {term}",
            pages.guarded("where it is", lambda: pages.whereabouts(view.whereabouts(term))),
        )

    # -- POST ------------------------------------------------------------------------------

    def do_POST(self) -> None:
        if not self._host_ok():
            self._refuse_host()
            return
        action = urlsplit(self.path).path.strip("/")
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_FORM_BYTES:
            self._page(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "refused",
                pages.message("refused", f"form over {MAX_FORM_BYTES} bytes", ok=False),
            )
            return
        raw = self.rfile.read(length).decode("utf-8", "replace") if length else ""
        form = {k: v[-1] for k, v in parse_qs(raw, keep_blank_values=True).items()}
        token = self.headers.get(TOKEN_HEADER) or form.get("token")
        if not self.console.token_ok(token):
            log.warning("console: %s refused: no valid token", action or "POST")
            self._page(
                HTTPStatus.FORBIDDEN,
                "refused",
                pages.message(
                    "refused",
                    "refused: the console token is missing or wrong (it was printed when "
                    "the console started, or set with --token / IDEM_CONSOLE_TOKEN)",
                    ok=False,
                ),
            )
            return
        if action not in ("replay", "discard"):
            self._page(
                HTTPStatus.NOT_FOUND, "not found", pages.message("not found", action, ok=False)
            )
            return
        if form.get("confirm") != "yes":
            self._page(
                HTTPStatus.BAD_REQUEST,
                "not confirmed",
                pages.message("not confirmed", "confirm=yes is required", ok=False),
            )
            return
        msg_id = form.get("id", "")
        by = (form.get("by") or "").strip() or self.console.default_by
        self._act(action, msg_id, by)

    def _act(self, action: str, msg_id: str, by: str) -> None:
        view = self.console.view
        back = f"/letter?id={msg_id}"
        try:
            with self.console.action_lock:
                if action == "replay":
                    replayed = view.replay(msg_id, by=by)
                    done = replayed.marked
                    text = (
                        f"replayed {replayed.sent} dead letter(s) through the retry path "
                        f"(dedup applies); marked {replayed.marked} REPLAYED by {by}"
                    )
                    if replayed.dead_again:
                        text += f"; {replayed.dead_again} dead-lettered again at once"
                    unknown = replayed.unknown
                else:
                    discarded = view.discard(msg_id, by=by)
                    done = discarded.marked
                    text = f"marked {discarded.marked} dead letter(s) DISCARDED by {by}"
                    unknown = discarded.unknown
        except Exception as exc:  # the page must say what failed, not drop the connection
            log.warning("console: %s of %s failed", action, msg_id, exc_info=True)
            self._page(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                f"{action} failed",
                pages.message(
                    f"{action} failed", f"{type(exc).__name__}: {exc}", ok=False, back=back
                ),
            )
            return
        log.info("console: %s of %s by %s: %s", action, msg_id, by, text)
        if unknown:
            self._page(
                HTTPStatus.NOT_FOUND,
                f"{action}: not found",
                pages.message(f"{action}", f"no dead letter {msg_id!r}", ok=False),
            )
            return
        if not done:
            text += " (it was not DEAD any more: nothing to do)"
        self._page(
            HTTPStatus.OK,
            f"{action} done",
            pages.message(f"{action} done", text, ok=bool(done), back=back),
        )


def _status(text: str) -> DeadLetterStatus | None:
    try:
        return DeadLetterStatus(text.upper())
    except ValueError:
        return DeadLetterStatus.DEAD


def serve(console: Console, host: str, port: int) -> ConsoleServer:
    """Bind the console's server (``port`` 0 picks a free one); call ``serve_forever``."""
    return ConsoleServer((host, port), console)
