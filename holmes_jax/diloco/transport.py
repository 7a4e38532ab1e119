"""HTTP between islands: a server that checks before it reads, and a client that checks
what it gets back.

Server (:class:`Server`), for each request, in this order, each failure answered with a
status and a one-line reason (``text/plain``) and nothing else done:

1. authentication from the headers alone (:class:`~holmes_jax.diloco.auth.Verifier`;
   401), or without a key a well-formed ``X-Island`` (400);
2. the body's declared length: none for ``GET``; for ``POST`` at most what the handler's
   ``limit(path)`` allows (413);
3. the body, read in pieces within the socket's timeout and hashed as it arrives; with a
   key its trailer must be its tag (401; :mod:`~holmes_jax.diloco.auth`);
4. the handler's answer (:class:`Reply`). An exception in the handler is a 500 with its
   one-line message: no request can end a serving thread with a traceback.

Replies go out in :data:`CHUNK`-byte writes, each within the socket's timeout, so a peer
that stalls is dropped after that long; with a key each reply is signed for its request,
its body hashed as it is sent.
Every refusal is counted by reason and reported once per peer address and reason through
``say``.

Client (:func:`request`): one request, signed with a key; the reply's status and body, or
None when the peer is unreachable (refused, timed out, cut short). A reply that fails its
signature counts as unreachable. TLS (``diloco.tls_*``): :func:`server_context` and
:func:`client_context`; with ``tls_ca`` both sides present certificates (mutual TLS).
"""

from __future__ import annotations

import array
import fcntl
import http.client
import json
import socket
import ssl
import termios
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from holmes_jax.diloco.auth import TRAILER, AuthError, Digest, Signer, Verifier

CHUNK = 1 << 16  # bytes per write of a reply: each must pass within the socket timeout
READ = 1 << 20  # bytes per read of a body
DRAIN_POLL_S = 0.02  # how often a reply's unsent bytes are read while it drains


class Unreachable(Exception):
    """A peer did not answer (refused, timed out, its link is cut, or its answer failed
    its checks)."""


class PeerRefused(Exception):
    """A peer refused this island's message; ``str`` is its one-line reason."""


@dataclass(frozen=True)
class Request:
    """An authenticated (or, without a key, self-named) request and its whole body."""

    method: str
    path: str  # without the query
    query: str
    sender: int
    body: bytes
    peer: str  # the address it came from


@dataclass
class Reply:
    """A handler's answer: ``status`` and ``body``; ``track``: the island whose delivery
    of this reply is followed (a result's; ``on_send`` of :class:`Server`), or None."""

    body: bytes
    status: int = 200
    track: int | None = None


def refusal(status: int, reason: str) -> Reply:
    """A refusal's reply: the one-line reason as the body."""
    return Reply(reason.encode(), status)


class Server:
    """Serves ``handle`` at ``address`` (module doc).

    Args:
      address: ``(host, port)`` to listen on.
      handle: ``Request -> Reply``.
      limit: the most body bytes a ``POST`` to a path may carry.
      timeout_s: a socket silent this long ends the request.
      say: reports a refusal (one line, once per peer address and reason).
      verifier: checks requests (with a key), or None.
      tls: a server SSL context, or None.
      on_send: ``(sender, +1)`` when a tracked reply starts, ``(sender, -1, done)`` when it
        ends (``done``: the peer received all of it).
    """

    def __init__(
        self,
        address: tuple[str, int],
        handle: Callable[[Request], Reply],
        limit: Callable[[str], int],
        timeout_s: float,
        say: Callable[[str], None],
        verifier: Verifier | None = None,
        tls: ssl.SSLContext | None = None,
        on_send: Callable | None = None,
        traffic: Traffic | None = None,
    ):
        self.traffic = traffic or Traffic()
        self.handle, self.limit, self.say = handle, limit, say
        self.verifier, self.on_send, self.timeout_s = verifier, on_send, timeout_s
        self.refused: Counter[str] = Counter()  # reason's first words -> count
        self.reported: set[tuple[str, str]] = set()
        self.lock = threading.Condition()
        self.active = 0  # requests being served
        self.digests: list[tuple[bytes, str]] = []  # replies' bodies and their digests
        self.signer = verifier.signer if verifier is not None else None
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = timeout_s  # a socket silent this long ends the request

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                server._serve(self, "GET")

            def do_POST(self):
                server._serve(self, "POST")

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # e.g. a failed TLS handshake
                server.refuse(client_address[0], 0, "connection failed before a request")

        self.http = Quiet(address, Handler)
        if tls is not None:  # the handshake happens in the request's thread, not accept()
            self.http.socket = tls.wrap_socket(
                self.http.socket, server_side=True, do_handshake_on_connect=False
            )
        serve = lambda: self.http.serve_forever(poll_interval=0.05)  # noqa: E731
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self, grace_s: float = 0.0) -> None:
        """Stop serving, after up to ``grace_s`` seconds for the requests being served to
        finish."""
        end = time.monotonic() + grace_s
        with self.lock:
            while self.active and time.monotonic() < end:
                self.lock.wait(min(0.1, end - time.monotonic()))
        self.http.shutdown()
        self.http.server_close()

    def refuse(self, peer: str, status: int, reason: str) -> Reply:
        """Count ``reason`` and report it once per ``peer`` address and kind."""
        kind = reason.split(":")[0][:60]
        with self.lock:
            self.refused[kind] += 1
            first = (peer, kind) not in self.reported
            self.reported.add((peer, kind))
        if first:
            self.say(
                f"diloco: refused a request from {peer} ({status}): {reason}; further "
                "ones like it from there are counted, not printed"
            )
        return refusal(status, reason)

    def _serve(self, req: BaseHTTPRequestHandler, method: str) -> None:
        peer = req.client_address[0]
        nonce = req.headers.get("X-Nonce", "")
        with self.lock:
            self.active += 1
        try:
            try:
                reply = self._answer(req, method, peer)
            except Exception as err:  # noqa: BLE001 (no request may end the serving thread)
                reason = f"internal error: {type(err).__name__}: {err}"[:200]
                reply = self.refuse(peer, 500, reason)
            self._reply(req, reply, nonce)
        finally:
            with self.lock:
                self.active -= 1
                self.lock.notify_all()

    def _answer(self, req: BaseHTTPRequestHandler, method: str, peer: str) -> Reply:
        path, _, query = req.path.partition("?")
        length = req.headers.get("Content-Length", "0")
        if not length.isdigit() or len(length) > 15:
            return self.refuse(peer, 400, f"Content-Length={length[:20]!r}: must be a byte count")
        size = int(length)
        if self.verifier is not None:
            try:
                sender = self.verifier.check(method, req.path, req.headers, size)
            except AuthError as err:
                return self.refuse(peer, 401, f"authentication: {err}")
            size -= TRAILER
        else:
            island = req.headers.get("X-Island", "")
            if not island.isdigit() or len(island) > 9:
                return self.refuse(peer, 400, f"X-Island={island[:20]!r}: must be an island index")
            sender = int(island)
        most = self.limit(path) if method == "POST" else 0
        if size > most:
            return self.refuse(
                peer, 413, f"body too large: {size} bytes declared, {path} takes {most} at most"
            )
        keyed = self.verifier is not None
        try:
            got = read_signed(req.rfile.readinto, size, keyed)
        except OSError:
            got = None
        if got is None:
            return self.refuse(peer, 400, f"truncated body: fewer than the {length} bytes declared")
        body, dig, trailer = got
        self.traffic.add(received=len(body) + len(trailer or b""))
        if keyed:
            try:
                self.signer.check_trailer("req", req.headers["X-Nonce"], dig, trailer)
            except AuthError as err:
                return self.refuse(peer, 401, f"authentication: {err} ({size} bytes, {path})")
        return self.handle(Request(method, path, query, sender, body, peer))

    def _reply(self, req: BaseHTTPRequestHandler, reply: Reply, nonce: str) -> None:
        """Send ``reply`` (signed for ``nonce`` with a key) in chunks, each within the
        socket's timeout; a tracked one is followed until the peer has it (or not). A
        refusal ends the connection: its body may be unread in the socket."""
        if reply.status != 200:
            req.close_connection = True
        try:
            req.send_response(reply.status)
            if self.signer is not None:
                for k, v in self.signer.reply(nonce, reply.status, len(reply.body)).items():
                    req.send_header(k, v)
            else:
                req.send_header("Content-Length", str(len(reply.body)))
            if reply.status != 200:
                req.send_header("Content-Type", "text/plain; charset=utf-8")
            req.end_headers()
        except OSError:
            req.close_connection = True
            return
        if reply.track is None or self.on_send is None:
            self._send(req, reply.body, nonce)
            return
        self.on_send(reply.track, +1)
        done = False
        try:
            done = self._send(req, reply.body, nonce) and drain(req.connection, self.timeout_s)
        finally:
            self.on_send(reply.track, -1, done)

    def _send(self, req: BaseHTTPRequestHandler, body: bytes, nonce: str) -> bool:
        """Write ``body`` and, with a key, its trailer; False if the peer stalled past the
        socket's timeout or closed (then the connection ends). Every member fetches the
        same step: a body's digest is taken once, while it is first sent."""
        with self.lock:
            known = next((dig for cached, dig in self.digests if cached is body), None)
        try:
            dig = send_body(req.wfile.write, body, self.signer is not None and known is None)
            self.traffic.add(sent=len(body))
            if self.signer is None:
                return True
            if dig is not None:
                with self.lock:
                    self.digests = [(body, dig), *self.digests[:1]]  # the last two bodies
            trailer = self.signer.trailer("rep", nonce, known or dig)
            req.wfile.write(trailer)
            self.traffic.add(sent=len(trailer))
        except OSError:
            req.close_connection = True
            return False
        return True


class Traffic:
    """The bytes of bodies (and their trailers) an island sent and received over its
    outer sync, as requests and as replies, counted where they cross the socket."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent = self.received = 0

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self.lock:
            self.sent += sent
            self.received += received

    def totals(self) -> tuple[int, int]:
        """``(sent, received)`` so far."""
        with self.lock:
            return self.sent, self.received


def drain(sock, timeout: float) -> bool:
    """Wait until the peer has received what was written to ``sock`` (Linux: the socket's
    send queue is empty; elsewhere at once): the kernel's buffer holds megabytes, seconds
    of a slow link. False if the queue made no progress for ``timeout`` seconds."""
    if not hasattr(termios, "TIOCOUTQ"):
        return True
    left, last, since = array.array("i", [0]), -1, time.monotonic()
    while True:
        try:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, left)
        except OSError:
            return False
        now = time.monotonic()
        if left[0] == 0:
            return True
        if left[0] != last:
            last, since = left[0], now
        elif now - since >= timeout:
            return False
        time.sleep(DRAIN_POLL_S)


def send_body(write, body, hashed: bool) -> str | None:
    """Write ``body`` in :data:`CHUNK`-byte pieces (each must pass within the socket's
    timeout) and, if ``hashed``, return its digest, hashed while it is sent."""
    view = memoryview(body).cast("B")
    dig = Digest(view) if hashed else None
    for at in range(0, len(view), CHUNK):
        write(view[at : at + CHUNK])
        if dig is not None:
            dig.upto(min(at + CHUNK, len(view)))
    return dig.hexdigest() if dig is not None else None


def read_body(readinto, size: int, hashed: bool) -> tuple[bytearray, str | None] | None:
    """``size`` bytes from ``readinto`` and, if ``hashed``, their digest, hashed while
    the rest arrives (:class:`~holmes_jax.diloco.auth.Digest`); None if the peer sent
    fewer (closed, or silent past the socket's timeout)."""
    buf, got = bytearray(size), 0
    view = memoryview(buf)
    dig = Digest(view) if hashed else None
    while got < size:
        n = readinto(view[got : got + READ])
        if not n:
            return None
        got += n
        if dig is not None:
            dig.upto(got)
    return buf, (dig.hexdigest() if dig is not None else None)


def read_signed(readinto, size: int, signed: bool) -> tuple[bytearray, str | None, bytes] | None:
    """:func:`read_body` and, if ``signed``, the :data:`~holmes_jax.diloco.auth.TRAILER`
    bytes after the body: ``(body, digest, trailer)`` (unsigned: ``(body, None, b"")``),
    or None if the peer sent fewer."""
    got = read_body(readinto, size, signed)
    if got is None or not signed:
        return None if got is None else (*got, b"")
    trailer = read_body(readinto, TRAILER, False)
    return None if trailer is None else (*got, bytes(trailer[0]))


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes

    @property
    def reason(self) -> str:
        """A refusal's one-line reason."""
        return self.body[:300].decode("utf-8", "replace").strip()


def request(
    address: tuple[str, int],
    method: str,
    path: str,
    body: bytes = b"",
    timeout: float = 1.0,
    island: int = -1,
    signer: Signer | None = None,
    tls: ssl.SSLContext | None = None,
    limit: int | None = None,
) -> Response | None:
    """One request to a peer's server; its status and body, or None when the peer refused
    the connection, timed out, cut the reply short, declared a reply longer than ``limit``
    bytes, or answered unsigned (with a key)."""
    if tls is not None:
        conn = http.client.HTTPSConnection(*address, timeout=timeout, context=tls)
    else:
        conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        if signer is not None:
            headers = signer.request(method, path, len(body))
        else:
            headers = {"X-Island": str(island), "Content-Length": str(len(body))}
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        dig = send_body(conn.send, body, signer is not None)
        if signer is not None:
            conn.send(signer.trailer("req", headers["X-Nonce"], dig))
        resp = conn.getresponse()
        length = resp.length
        if signer is not None:
            length = signer.check_reply(headers["X-Nonce"], resp.status, resp.headers)
        if length is None or (limit is not None and length > limit):
            return None
        got = read_signed(resp.readinto, length, signer is not None)
        if got is None:
            return None
        data, dig, trailer = got
        if signer is not None:
            signer.check_trailer("rep", headers["X-Nonce"], dig, trailer)
    except (OSError, http.client.HTTPException, AuthError):
        return None
    finally:
        conn.close()
    return Response(resp.status, data)


def refuses(address: tuple[str, int], timeout: float) -> bool:
    """Whether ``address``'s host answers that nothing listens on its port (connection
    refused): the peer's process is down. False when it accepts, or when nothing answers
    within ``timeout`` seconds (a cut link, a host down: unknown, not down). The connection,
    if made, closes before a byte is sent; the server takes no notice of it."""
    try:
        socket.create_connection(address, timeout).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def server_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """TLS for a server: its certificate and key; with ``ca``, clients must present a
    certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if ca:
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """TLS for a client: peers' certificates checked against ``ca`` (else the system's
    CAs), this island's certificate presented."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


@dataclass(frozen=True)
class Security:
    """How this island talks to its peers: the shared ``key`` (None: unauthenticated)
    and TLS contexts (None: plain HTTP)."""

    key: bytes | None = None
    tls_server: object | None = None
    tls_client: object | None = None


def live_round(
    peers: dict[int, tuple[str, int]], me: int, timeout: float, security: Security | None = None
) -> int:
    """The highest round a live, ready peer other than island ``me`` reports (0: none)."""
    security = security or Security()
    signer = Signer(security.key, me) if security.key else None
    best = 0
    for j, address in peers.items():
        if j == me:
            continue
        resp = request(address, "GET", "/status", b"", timeout, me, signer, security.tls_client)
        if resp is None or resp.status != 200:
            continue
        try:
            status = json.loads(resp.body)
            ready, rnd = status.get("ready"), status.get("round")
        except (ValueError, AttributeError):
            continue
        if ready is True and type(rnd) is int and rnd >= 0:
            best = max(best, rnd)
    return best
