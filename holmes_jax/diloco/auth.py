"""A shared key authenticates every request and every reply between islands (HMAC-SHA256).

A request carries these headers:

    X-Island  the sender's island index
    X-Time    the sender's clock, Unix seconds
    X-Nonce   32 hex digits, random per request
    X-Tag     HMAC-SHA256(key, "req\\n" method "\\n" path "\\n" island "\\n" time "\\n" nonce
              "\\n" length), hex; ``path`` includes the query, ``length`` is Content-Length

and its body is followed by a trailer of :data:`TRAILER` bytes, the body's tag:
HMAC-SHA256(key, "req-body\\n" nonce "\\n" digest) in hex, where ``digest`` is the body's
BLAKE3 (:func:`digest`). Content-Length counts the trailer. The server checks the tag, the
time (within :data:`WINDOW_S` of its own clock) and that it has not seen the nonce in that
window, all from the headers, before it reads a byte of the body; it hashes the body as it
arrives (:class:`Digest`) and checks the trailer before anything reads the body. The
sender hashes as it sends, so on a link slower than the hash neither side waits for it.

A reply is signed the same way for the request's nonce: ``X-Tag = HMAC(key, "rep\\n"
nonce "\\n" status "\\n" length)`` and the trailer ``HMAC(key, "rep-body\\n" nonce "\\n"
digest)``, so a client takes only a reply made for its own request by a holder of the key.

:class:`Verifier` keeps the nonces of the last :data:`WINDOW_S` seconds (at most
:data:`NONCES_MAX`; past that it refuses until old ones expire, rather than forget one).
Without a key (``diloco.sync_key_file`` unset, loopback or ``diloco.insecure``) requests
carry ``X-Island`` alone, bodies no trailer, and nothing is checked.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import blake3

WINDOW_S = 300.0  # a request's clock may differ this much from the server's
NONCES_MAX = 1 << 20
TRAILER = 64  # bytes after a signed body: its tag, hex
PIECE = 32 << 20  # bytes of a body hashed at a time while the rest arrives (:class:`Digest`)


class AuthError(Exception):
    """A request or reply that fails authentication; ``str`` is the one-line reason."""


def digest(body) -> str:
    """The body's digest: BLAKE3 (hex), on every core (it releases the GIL)."""
    return blake3.blake3(memoryview(body).cast("B"), max_threads=blake3.blake3.AUTO).hexdigest()


class Digest:
    """:func:`digest` of a body taken while it arrives: :meth:`upto` hands each new
    :data:`PIECE` to one background thread (first in, first out: the pieces are hashed
    in order), so hashing overlaps reading and the digest is ready soon after the last
    byte."""

    def __init__(self, view: memoryview):
        self.view, self.done = view, 0
        self.hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.pending: Future | None = None

    def upto(self, got: int, last: bool = False) -> None:
        """The first ``got`` bytes of the view have arrived (``last``: all of them)."""
        if got - self.done >= PIECE or (last and got > self.done):
            piece, self.done = self.view[self.done : got], got
            self.pending = _pool().submit(self.hasher.update, piece)

    def hexdigest(self) -> str:
        self.upto(len(self.view), last=True)
        if self.pending is not None:
            self.pending.result()
        return self.hasher.hexdigest()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, "holmes_jax-digest")


def tag(key: bytes, *fields: str) -> str:
    """HMAC-SHA256 with ``key`` over ``fields`` joined by newlines (hex)."""
    return hmac.new(key, "\n".join(fields).encode(), hashlib.sha256).hexdigest()


def _same(got: str, want: str) -> bool:
    """Whether a tag or digest from a header equals ``want``, in constant time (a header
    with other than ASCII in it equals nothing we make)."""
    return got.isascii() and hmac.compare_digest(got, want)


class Signer:
    """Signs requests and checks replies with ``key`` (module doc)."""

    def __init__(self, key: bytes, island: int):
        self.key, self.island = key, str(island)

    def _tag(self, *fields: str) -> str:
        return tag(self.key, *fields)

    def request(self, method: str, path: str, length: int) -> dict[str, str]:
        """The headers of a request (``path`` with its query) whose body has ``length``
        bytes, Content-Length (with the trailer) among them."""
        stamp, nonce, size = f"{time.time():.3f}", secrets.token_hex(16), str(length + TRAILER)
        return {
            "X-Island": self.island,
            "X-Time": stamp,
            "X-Nonce": nonce,
            "X-Tag": self._tag("req", method, path, self.island, stamp, nonce, size),
            "Content-Length": size,
        }

    def reply(self, nonce: str, status: int, length: int) -> dict[str, str]:
        """The headers of a reply with status ``status`` and a body of ``length`` bytes to
        the request that carried ``nonce``."""
        size = str(length + TRAILER)
        return {"X-Tag": self._tag("rep", nonce, str(status), size), "Content-Length": size}

    def trailer(self, kind: str, nonce: str, body_digest: str) -> bytes:
        """The trailer after the body of a request (``kind`` "req") or reply ("rep")."""
        return self._tag(f"{kind}-body", nonce, body_digest).encode()

    def check_reply(self, nonce: str, status: int, headers) -> int:
        """The length of the reply's body (its trailer not counted).

        Raises:
          AuthError: the reply was not made for ``nonce`` with this key.
        """
        size = headers.get("Content-Length", "")
        if not _same(headers.get("X-Tag", ""), self._tag("rep", nonce, str(status), size)):
            raise AuthError("reply without a valid tag")
        if not size.isdigit() or int(size) < TRAILER:
            raise AuthError(f"reply Content-Length={size[:20]!r}: no room for its trailer")
        return int(size) - TRAILER

    def check_trailer(self, kind: str, nonce: str, body_digest: str, trailer) -> None:
        """Raises AuthError unless ``trailer`` is the tag of a body with ``body_digest``."""
        got = bytes(trailer).decode("ascii", "replace")
        if not _same(got, self._tag(f"{kind}-body", nonce, body_digest)):
            what = {"req": "request", "rep": "reply"}[kind]
            raise AuthError(f"{what} body does not match its tag")


class Verifier:
    """Checks requests' headers (before the body is read) and then their bodies'
    trailers (:meth:`Signer.check_trailer`)."""

    def __init__(self, key: bytes, window_s: float = WINDOW_S):
        self.key = key
        self.signer = Signer(key, -1)  # signs the server's replies
        self.window_s = window_s
        self.nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> its X-Time
        self.lock = threading.Lock()

    def check(self, method: str, path: str, headers, size: int) -> int:
        """The authenticated sender's island index; ``size`` is the request's
        Content-Length (body and trailer).

        Raises:
          AuthError: a header missing or malformed, a wrong tag, a time outside the
            window, a nonce seen before, or no room for the trailer.
        """
        fields = [headers.get(h) for h in ("X-Island", "X-Time", "X-Nonce", "X-Tag")]
        if any(f is None for f in fields):
            raise AuthError("no authentication headers (is diloco.sync_key_file set on both?)")
        island, stamp, nonce, sent_tag = fields
        want = tag(self.key, "req", method, path, island, stamp, nonce, str(size))
        if not _same(sent_tag, want):
            raise AuthError("wrong tag (another key, or the request was altered)")
        if size < TRAILER:
            raise AuthError(f"Content-Length={size}: no room for the body's {TRAILER}-byte tag")
        try:
            sent, sender = float(stamp), int(island)
        except ValueError:
            raise AuthError("malformed X-Time or X-Island") from None
        now = time.time()
        if not abs(now - sent) <= self.window_s:
            raise AuthError(
                f"stale: sent {now - sent:+.0f} s from now (window {self.window_s:g} s)"
            )
        with self.lock:
            while self.nonces and next(iter(self.nonces.values())) < now - self.window_s:
                self.nonces.popitem(last=False)
            if nonce in self.nonces:
                raise AuthError("replayed (its nonce was seen before)")
            if len(self.nonces) >= NONCES_MAX:
                raise AuthError("too many requests in the replay window")
            self.nonces[nonce] = sent
        return sender
