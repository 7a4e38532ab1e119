"""A shared key authenticates every request and every reply between islands (HMAC-SHA256).

A request carries these headers:

    X-Island  the sender's island index
    X-Time    the sender's clock, Unix seconds
    X-Nonce   32 hex digits, random per request
    X-Digest  the body's digest (:func:`digest`, SHA-256 of its pieces' SHA-256)
    X-Tag     HMAC-SHA256(key, "req\\n" method "\\n" path "\\n" island "\\n" time "\\n" nonce
              "\\n" digest), hex; ``path`` includes the query

The server checks the tag, the time (within :data:`WINDOW_S` of its own clock) and that it
has not seen the nonce in that window, all from the headers, before it reads a byte of the
body; then that the body it read has the digest. A reply carries ``X-Digest`` and
``X-Tag = HMAC(key, "rep\\n" nonce "\\n" status "\\n" digest)`` over the request's nonce,
so a client takes only a reply made for its own request by a holder of the key.

:class:`Verifier` keeps the nonces of the last :data:`WINDOW_S` seconds (at most
:data:`NONCES_MAX`; past that it refuses until old ones expire, rather than forget one).
Without a key (``diloco.sync_key_file`` unset, loopback or ``diloco.insecure``) requests
carry ``X-Island`` alone and nothing is checked.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

WINDOW_S = 300.0  # a request's clock may differ this much from the server's
NONCES_MAX = 1 << 20
DIGEST_CHUNK = 8 << 20  # bytes of body per hashed piece (:func:`digest`)


class AuthError(Exception):
    """A request or reply that fails authentication; ``str`` is the one-line reason."""


def digest(body) -> str:
    """The body's digest (hex): SHA-256 over the SHA-256 of each :data:`DIGEST_CHUNK`-byte
    piece, the pieces hashed on every core (hashlib releases the GIL), so a model-sized
    body hashes at the machine's speed rather than one core's."""
    view = memoryview(body).cast("B")
    pieces = range(0, len(view), DIGEST_CHUNK)
    one = lambda at: hashlib.sha256(view[at : at + DIGEST_CHUNK]).digest()  # noqa: E731
    if len(pieces) <= 1:
        parts = [one(at) for at in pieces]
    else:
        parts = list(_pool().map(one, pieces))
    return hashlib.sha256(b"".join(parts)).hexdigest()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0))), "holmes_jax-digest")


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

    def request(self, method: str, path: str, body: bytes) -> dict[str, str]:
        """The headers of a request (``path`` with its query)."""
        stamp, nonce, dig = f"{time.time():.3f}", secrets.token_hex(16), digest(body)
        tag = self._tag("req", method, path, self.island, stamp, nonce, dig)
        return {
            "X-Island": self.island,
            "X-Time": stamp,
            "X-Nonce": nonce,
            "X-Digest": dig,
            "X-Tag": tag,
        }

    def reply(self, nonce: str, status: int, dig: str) -> dict[str, str]:
        """The headers of a reply with status ``status`` and body digest ``dig`` to the
        request that carried ``nonce``."""
        return {"X-Digest": dig, "X-Tag": self._tag("rep", nonce, str(status), dig)}

    def check_reply(self, nonce: str, status: int, headers, body: bytes) -> None:
        """Raises AuthError unless the reply was made for ``nonce`` with this key."""
        dig = headers.get("X-Digest", "")
        want = self._tag("rep", nonce, str(status), dig)
        if not _same(headers.get("X-Tag", ""), want):
            raise AuthError("reply without a valid tag")
        if not _same(dig, digest(body)):
            raise AuthError("reply body does not match its digest")


class Verifier:
    """Checks requests' headers (before the body is read) and then their body's digest."""

    def __init__(self, key: bytes, window_s: float = WINDOW_S):
        self.key = key
        self.signer = Signer(key, -1)  # signs the server's replies
        self.window_s = window_s
        self.nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> its X-Time
        self.lock = threading.Lock()

    def check(self, method: str, path: str, headers) -> int:
        """The authenticated sender's island index.

        Raises:
          AuthError: a header missing or malformed, a wrong tag, a time outside the
            window, or a nonce seen before.
        """
        fields = [headers.get(h) for h in ("X-Island", "X-Time", "X-Nonce", "X-Digest", "X-Tag")]
        if any(f is None for f in fields):
            raise AuthError("no authentication headers (is diloco.sync_key_file set on both?)")
        island, stamp, nonce, dig, sent_tag = fields
        want = tag(self.key, "req", method, path, island, stamp, nonce, dig)
        if not _same(sent_tag, want):
            raise AuthError("wrong tag (another key, or the request was altered)")
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
