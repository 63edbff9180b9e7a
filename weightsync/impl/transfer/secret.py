"""The per-deployment secret that admits a trainer and its engine workers to one transfer group.

Rules:

1. **Where it comes from.** Each process reads it itself, from its own environment: ``WEIGHTSYNC_TOKEN_FILE``
   (the path of a regular file whose mode grants nothing to group or others, i.e. 0600 or stricter) or
   ``WEIGHTSYNC_TOKEN``. Both set is refused, so a process never uses another secret than its operator
   thinks. The secret is never sent, logged, put in a request dict, a trace or an HTTP body: the trainer
   and the workers only exchange HMAC-SHA256 tags computed with it (:mod:`weightsync.impl.transfer.auth`).
2. **What it is.** Hexadecimal text of at least :data:`MIN_SECRET_BYTES` random bytes (64 hex digits);
   surrounding whitespace is ignored. ``weightsync token new PATH`` writes one from :func:`secrets.token_hex`
   with mode 0600, refusing to overwrite an existing file.
3. **Never printed.** :class:`Secret` keeps the bytes private; its ``repr`` and ``str`` show no byte of them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pathlib
import re
import secrets
import stat
from collections.abc import Mapping
from typing import Any

#: Environment variable naming the secret's file (rule 1).
TOKEN_FILE_ENV = "WEIGHTSYNC_TOKEN_FILE"
#: Environment variable holding the secret itself, hexadecimal (rule 1).
TOKEN_ENV = "WEIGHTSYNC_TOKEN"
#: The fewest random bytes a secret may have (rule 2): 256 bits, HMAC-SHA256's key size.
MIN_SECRET_BYTES = 32
#: The bytes :func:`write_token` draws.
NEW_TOKEN_BYTES = 32


class Secret:
    """A deployment secret (rule 3: never shown). Build it with :func:`load_secret` or :meth:`from_hex`.

    Raises:
        ValueError: (``from_hex``) the text is not hexadecimal or holds fewer than :data:`MIN_SECRET_BYTES`
            bytes; the message names the length and where the text came from, never the text.
    """

    __slots__ = ("_key", "source")

    def __init__(self, key: bytes, source: str) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the secret from {source} has {len(key)} bytes; it needs at least {MIN_SECRET_BYTES} random "
                "bytes (write one with `weightsync token new PATH`)"
            )
        self._key = key
        #: where the secret came from (``WEIGHTSYNC_TOKEN_FILE=<path>`` or ``WEIGHTSYNC_TOKEN``), for messages
        self.source = source

    @classmethod
    def from_hex(cls, text: str, source: str) -> Secret:
        """The secret written as hexadecimal ``text`` (rule 2)."""
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(
                f"the secret from {source} is not hexadecimal text ({len(text.strip())} characters); write one "
                "with `weightsync token new PATH`"
            ) from None
        return cls(key, source)

    def __repr__(self) -> str:
        return f"Secret(<{len(self._key)} bytes from {self.source}>)"

    __str__ = __repr__

    def mac(self, *parts: Any) -> str:
        """HMAC-SHA256 of the canonical JSON of ``parts`` (a list, compact, keys sorted), hexadecimal."""
        return mac_hex(self._key, parts)

    def verify(self, tag: object, *parts: Any) -> bool:
        """Whether ``tag`` is :meth:`mac` of ``parts`` (constant-time comparison)."""
        return isinstance(tag, str) and hmac.compare_digest(tag, self.mac(*parts))

    def derive(self, *parts: Any) -> bytes:
        """A 32-byte key derived from the secret and ``parts`` (HMAC-SHA256 as a PRF)."""
        return bytes.fromhex(self.mac("derive", *parts))


#: The store prefix of an authenticated session: ``ws/`` and :data:`NAMESPACE_HEX` hex digits of a MAC under
#: the session key (:mod:`weightsync.impl.transfer.auth` rule 3). Whoever knows it may read and write the
#: group's keys, so it is kept out of error text (:func:`redact_namespace`).
NAMESPACE_PREFIX = "ws/"
NAMESPACE_HEX = 32
_NAMESPACE_RE = re.compile(re.escape(NAMESPACE_PREFIX) + f"[0-9a-f]{{{NAMESPACE_HEX}}}")


def namespace_of(key: bytes) -> str:
    """The store prefix of the session whose key is ``key`` (``ws/`` + 32 hex digits)."""
    return NAMESPACE_PREFIX + mac_hex(key, ["namespace"])[:NAMESPACE_HEX]


def redact_namespace(text: str) -> str:
    """``text`` with every session namespace replaced by ``ws/<session>``: torch's store errors quote the
    keys they waited for (``wait timeout after 1000ms, keys: /ws/<namespace>/pg//0/1``), and the
    namespace is the authenticated session's capability, which must not reach a log, an HTTP body or a
    trace."""
    return _NAMESPACE_RE.sub(NAMESPACE_PREFIX + "<session>", text)


def error_line(exc: BaseException) -> str:
    """The first line of ``exc``'s text, namespaces redacted (:func:`redact_namespace`): how weightsync
    quotes a torch store or gloo error in its own errors ("" for an empty text)."""
    lines = redact_namespace(str(exc)).splitlines()
    return lines[0] if lines else ""


def mac_hex(key: bytes, parts: Any) -> str:
    """HMAC-SHA256 under ``key`` of the canonical JSON of ``parts``, hexadecimal (64 characters)."""
    msg = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def load_secret(environ: Mapping[str, str] | None = None) -> Secret | None:
    """The secret this process's environment configures (rule 1), or None when it configures none.

    Raises:
        ValueError: both variables are set; the file is missing, not a regular file, or grants group or
            others any access (naming its mode and ``chmod 600``); or the text is no valid secret (rule 2).
    """
    env = os.environ if environ is None else environ
    path, text = env.get(TOKEN_FILE_ENV) or None, env.get(TOKEN_ENV) or None
    if path is not None and text is not None:
        raise ValueError(
            f"both {TOKEN_FILE_ENV} and {TOKEN_ENV} are set; set exactly one, so that every process of the "
            "deployment reads the same secret"
        )
    if text is not None:
        return Secret.from_hex(text, TOKEN_ENV)
    if path is None:
        return None
    source = f"{TOKEN_FILE_ENV}={path}"
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{source}: cannot read the secret's file ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{source} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(
            f"{source} has mode {mode:04o}, which lets group or others read or change the secret; it must be "
            f"0600 or stricter (chmod 600 {path})"
        )
    return Secret.from_hex(pathlib.Path(path).read_text(), source)


def write_token(path: str | os.PathLike[str]) -> pathlib.Path:
    """Write a new secret of :data:`NEW_TOKEN_BYTES` random bytes to ``path`` as hexadecimal, mode 0600,
    created exclusively (rule 2). Returns the path.

    Raises:
        FileExistsError: ``path`` exists (a secret is never overwritten: the engines may hold it).
    """
    p = pathlib.Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(NEW_TOKEN_BYTES) + "\n")
    os.chmod(p, 0o600)  # the umask may have cleared bits, never added: make the mode exact
    return p


__all__ = [
    "MIN_SECRET_BYTES",
    "NEW_TOKEN_BYTES",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "Secret",
    "load_secret",
    "mac_hex",
    "write_token",
]
