"""The authenticated rendezvous: who may join a transfer group (rule 3 of
:mod:`weightsync.impl.transfer.rendezvous`, which also binds the store to one interface and applies the
policy).

torch.distributed's ``TCPStore`` accepts connections from anywhere (pytorch SECURITY.md), and vLLM's own
rendezvous is unauthenticated and unpickles what it reads from the store (vllm-project/vllm#17591).
weightsync admits a rank only when it proves it holds the deployment's secret
(:mod:`weightsync.impl.transfer.secret`).

Rule 3, the **handshake** (all through the store, strict JSON of at most :data:`AUTH_LIMIT_BYTES`, nothing
   unpickled; tags are HMAC-SHA256 under the secret over canonical JSON):

   - the host posts ``auth/hello``: ``{"auth": "none"}`` without a secret, else a *challenge* with a fresh
     random round id and nonce and the group's ``world_size``, tagged;
   - each worker checks the challenge's tag (a wrong secret fails here, at once), takes a slot
     ``auth/<round>/claims`` and posts its *claim* there: its rank, ``world_size`` and a fresh nonce, tagged
     together with the round and the challenge's nonce;
   - the host judges every claim once, in slot order. It rejects a claim that is no valid JSON claim, is of
     a stale round (a replay of an earlier round), names a rank outside ``1..world_size-1``, has a bad tag,
     repeats an admitted nonce (a replay of this round's claim) or a rank already admitted; it logs each
     rejection with its reason and posts the signed reason at ``auth/<round>/reject/<slot>`` for the
     claimant. A duplicate rank with a valid tag comes from a holder of the secret: a rank mapping that is
     not a bijection (vLLM PR #36940), which fails the round at once, as a ``world_size`` that differs from
     the host's does;
   - once every rank is admitted the host posts the signed *accept* listing each admitted rank's nonce; a
     worker takes only an accept of its round that names its own nonce (an old accept is refused);
   - both sides derive a session key from the secret, the round and every nonce, and from it a random
     namespace. The control plane, the process group and every bucket run under the store prefix
     ``ws/<namespace>``, which a client without the secret cannot compute.

   The host waits until the deadline, then fails closed (:class:`~weightsync.spec.errors.TransferTimeoutError`
   naming the missing ranks and how many claims it rejected, and why); it posts a signed failure so the
   admitted workers stop waiting too.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from torch._C._distributed_c10d import PrefixStore, Store

from weightsync.impl.transfer.base import AuthenticationError
from weightsync.impl.transfer.control import ControlPlane, raise_if_abandoned, strict_json
from weightsync.impl.transfer.secret import Secret, namespace_of
from weightsync.spec.errors import TransferTimeoutError, WireMismatchError

log = logging.getLogger("weightsync.auth")

#: Protocol version of the handshake messages.
AUTH_VERSION = 1
#: Largest handshake message read from the store, bytes (rule 3).
AUTH_LIMIT_BYTES = 64 * 1024
#: The tag scheme named in a challenge.
SCHEME = "hmac-sha256"
_POLL_S = 0.002
#: Seconds a worker waits for the host's verdict beyond its own ``timeout_s``: the host's deadline, which
#: started first, decides the round, and an admitted worker then hears its signed ``fail`` (with the reason)
#: instead of timing out at nearly the same instant.
VERDICT_GRACE_S = 2.0


# --------------------------------------------------------------------------------------------- rule 3
@dataclass(frozen=True)
class Session:
    """An admitted group's session (rule 3).

    Attributes:
        round: the handshake's round id (hex).
        key: the session key, 32 bytes (per-bucket tags of ``verify="hmac"``).
        namespace: the store prefix of everything after the handshake (``ws/<hex>``: torch's
            ``PrefixStore`` then names a key ``ws/<hex>/<key>``).
        seconds: how long the handshake took on this rank, seconds.
    """

    round: str
    key: bytes
    namespace: str
    seconds: float

    def __repr__(self) -> str:  # rule 3 of secret: the key is never shown
        return f"Session(round={self.round!r}, seconds={self.seconds:.4f})"

    def scoped(self, store: Store) -> Store:
        """``store`` under this session's namespace."""
        return PrefixStore(self.namespace, store)

    def tag(self, data: bytes | memoryview) -> str:
        """HMAC-SHA256 of ``data`` under the session key, hexadecimal."""
        return hmac.new(self.key, data, hashlib.sha256).hexdigest()


def _session(secret: Secret, round_id: str, nonce: str, nonces: dict[str, str], t0: float) -> Session:
    key = secret.derive("session", round_id, nonce, nonces)
    return Session(round_id, key, namespace_of(key), time.monotonic() - t0)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def _challenge_parts(c: dict[str, Any]) -> list[Any]:
    return ["challenge", c.get("round"), c.get("nonce"), c.get("world_size")]


def _claim_parts(round_id: str, nonce: str, c: dict[str, Any]) -> list[Any]:
    return ["claim", round_id, nonce, c.get("rank"), c.get("world_size"), c.get("nonce")]


class _Fatal(Exception):
    """A claim that proves a misconfiguration of the secret's holders: the round fails at once."""


def host_handshake(
    cp: ControlPlane, secret: Secret | None, world_size: int, timeout_s: float, what: str
) -> Session | None:
    """Rank 0's side of rule 3 on ``cp``'s (unprefixed) store: admit ``world_size - 1`` workers, or only
    post ``{"auth": "none"}`` without a secret (then returns None).

    Raises:
        TransferTimeoutError: phase ``"<what>/auth"``, naming the ranks not admitted by ``timeout_s`` and the
            rejected claims.
        ValueError: a validly tagged claim repeats an admitted rank (the rank mapping is no bijection).
        WireMismatchError: a validly tagged claim names another ``world_size``.
    """
    store = cp.store
    if secret is None:
        store.set("auth/hello", _dumps({"v": AUTH_VERSION, "auth": "none"}))
        return None
    t0 = time.monotonic()
    round_id, nonce = secrets.token_hex(16), secrets.token_hex(16)
    ch: dict[str, Any] = {"v": AUTH_VERSION, "auth": SCHEME, "round": round_id, "nonce": nonce}
    ch["world_size"] = world_size
    ch["mac"] = secret.mac(*_challenge_parts(ch))
    store.set("auth/hello", _dumps(ch))
    base = f"auth/{round_id}"
    admitted: dict[str, str] = {}
    rejected: list[str] = []
    read = 0
    try:
        while len(admitted) < world_size - 1:
            posted = int(store.add(f"{base}/claims", 0))
            # the deadline holds inside the drain too: a flood of claims cannot keep the host judging past it
            while (
                read < posted
                and time.monotonic() - t0 < timeout_s
                and store.check([f"{base}/claim/{read + 1}"])
            ):
                read += 1
                raw = store.get(f"{base}/claim/{read}")
                why = _judge(secret, round_id, nonce, world_size, admitted, raw)
                if why is not None:
                    rejected.append(why)
                    log.warning("weightsync %s: rejected claim in slot %d: %s", what, read, why)
                    verdict = {"v": AUTH_VERSION, "round": round_id, "slot": read, "reason": why}
                    verdict["mac"] = secret.mac("reject", round_id, read, why)
                    store.set(f"{base}/reject/{read}", _dumps(verdict))
            if len(admitted) >= world_size - 1:
                break
            waited = time.monotonic() - t0
            if waited >= timeout_s:
                missing = [r for r in range(1, world_size) if str(r) not in admitted]
                shown = "; ".join(rejected[-5:])
                detail = f"{len(rejected)} claim(s) rejected" + (f" ({shown})" if rejected else "")
                raise TransferTimeoutError(
                    f"{what}/auth", missing, waited, f"{detail}; failing closed after timeout {timeout_s:g} s"
                )
            raise_if_abandoned(f"{what}/auth", [r for r in range(1, world_size) if str(r) not in admitted])
            time.sleep(_POLL_S)
    except (_Fatal, TransferTimeoutError, ValueError, WireMismatchError) as exc:
        fail = {"v": AUTH_VERSION, "round": round_id, "reason": str(exc)}
        fail["mac"] = secret.mac("fail", round_id, str(exc))
        with contextlib.suppress(Exception):
            store.set(f"{base}/fail", _dumps(fail))
        if isinstance(exc, _Fatal):
            raise exc.args[0] from None
        raise
    accept = {"v": AUTH_VERSION, "round": round_id, "nonces": admitted}
    accept["mac"] = secret.mac("accept", round_id, nonce, admitted)
    store.set(f"{base}/accept", _dumps(accept))
    return _session(secret, round_id, nonce, admitted, t0)


def _judge(
    secret: Secret, round_id: str, nonce: str, world_size: int, admitted: dict[str, str], raw: bytes
) -> str | None:
    """Why the host rejects claim ``raw`` (rule 3), or None after admitting it into ``admitted``.

    Raises:
        _Fatal: a validly tagged claim naming another ``world_size`` or an admitted rank.
    """
    try:
        c = strict_json(raw, AUTH_LIMIT_BYTES, "a claim")
    except ValueError as exc:
        return str(exc)
    if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in ("round", "nonce", "mac")):
        return "not a claim (a JSON object with round, rank, world_size, nonce and mac)"
    rank, claimed_ws = c.get("rank"), c.get("world_size")
    if type(rank) is not int or type(claimed_ws) is not int:
        return "not a claim: rank and world_size must be ints"
    if c["round"] != round_id:
        return f"stale round {c['round'][:16]!r} (this round is {round_id[:16]!r}): a replayed claim"
    if not 1 <= rank < world_size:
        return f"rank {rank} out of range 1..{world_size - 1}"
    if not secret.verify(c["mac"], *_claim_parts(round_id, nonce, c)):
        return f"bad MAC for rank {rank}: the claimant does not hold this deployment's secret"
    if c["nonce"] in admitted.values():
        return f"duplicate nonce: a replay of rank {rank}'s admitted claim"
    if claimed_ws != world_size:
        raise _Fatal(
            WireMismatchError(
                f"init_weight_transfer_engine: the ranks disagree on world_size: rank 0 (trainer) says "
                f"{world_size}, rank {rank} says {claimed_ws}; every rank must pass the same world_size, 1 + the "
                "number of engine workers; no group was formed"
            )
        )
    if str(rank) in admitted:
        raise _Fatal(
            ValueError(
                "init_weight_transfer_engine: the rank mapping is not a bijection onto 0.."
                f"{world_size - 1}: rank {rank} claimed by more than one worker holding the secret; each "
                "worker's rank is rank_offset + dp_index * tp*pp + local_rank with the DP *index* "
                "(vLLM PR #36940)"
            )
        )
    admitted[str(rank)] = c["nonce"]
    return None


def worker_handshake(
    cp: ControlPlane, secret: Secret | None, rank: int, world_size: int, timeout_s: float, what: str
) -> Session | None:
    """A worker's side of rule 3: None when the host runs without a secret and so does this worker.

    Raises:
        AuthenticationError: at once, when exactly one side holds a secret, when the challenge does not
            verify (the two sides hold different secrets: this worker still posts its claim, so the host
            logs it), when the host rejects this worker's claim or fails the round (its reason), or when an
            accept that is not for this worker arrives.
        WireMismatchError: the host's ``world_size`` differs from this worker's.
        TransferTimeoutError: phase ``"<what>/auth"``, naming rank 0: no hello came within ``timeout_s``, or
            no accept, reject or fail within ``timeout_s`` + :data:`VERDICT_GRACE_S`.
    """
    t0 = time.monotonic()
    hello = _wait_json(cp, "auth/hello", t0, timeout_s, what, "the host's hello")
    if not isinstance(hello, dict) or hello.get("auth") not in ("none", SCHEME):
        raise AuthenticationError(f"{what}: the store's auth/hello is no weightsync hello")
    if hello["auth"] == "none":
        if secret is not None:
            raise AuthenticationError(
                f"{what}: this worker holds a secret ({secret.source}) but the trainer runs without one; "
                "configure the same secret on the trainer (a worker with a secret admits only an "
                "authenticated trainer)"
            )
        return None
    if secret is None:
        raise AuthenticationError(
            f"{what}: the trainer requires the deployment's secret and this worker has none; set "
            "WEIGHTSYNC_TOKEN_FILE (or WEIGHTSYNC_TOKEN) in the engine's environment"
        )
    round_id, nonce = hello.get("round"), hello.get("nonce")
    if not isinstance(round_id, str) or not isinstance(nonce, str):
        raise AuthenticationError(f"{what}: the trainer's challenge has no round or nonce")
    claim: dict[str, Any] = {"v": AUTH_VERSION, "round": round_id, "rank": rank, "world_size": world_size}
    claim["nonce"] = secrets.token_hex(16)
    claim["mac"] = secret.mac(*_claim_parts(round_id, nonce, claim))
    base = f"auth/{round_id}"
    s = cp.store
    slot = int(cp.call(f"{what}/auth", timeout_s, s.add, f"{base}/claims", 1))
    cp.call(f"{what}/auth", timeout_s, s.set, f"{base}/claim/{slot}", _dumps(claim))
    if not secret.verify(hello.get("mac"), *_challenge_parts(hello)):
        raise AuthenticationError(
            f"{what}: the trainer's challenge does not verify under this worker's secret ({secret.source}): "
            "the trainer and this engine hold different secrets (or the store is not the trainer's)"
        )
    if hello.get("world_size") != world_size:
        raise WireMismatchError(
            f"init_weight_transfer_engine: the ranks disagree on world_size: rank 0 (trainer) says "
            f"{hello.get('world_size')}, rank {rank} says {world_size}; every rank must pass the same "
            "world_size, 1 + the number of engine workers; no group was formed"
        )
    keys = {"accept": f"{base}/accept", "reject": f"{base}/reject/{slot}", "fail": f"{base}/fail"}
    while True:
        for kind, key in keys.items():
            if not cp.call(f"{what}/auth", timeout_s, s.check, [key]):
                continue
            msg = strict_json(cp.call(f"{what}/auth", timeout_s, s.get, key), AUTH_LIMIT_BYTES, kind)
            if not isinstance(msg, dict):
                raise AuthenticationError(f"{what}: the trainer's {kind} is not a JSON object")
            if kind == "accept":
                nonces = msg.get("nonces")
                if msg.get("round") != round_id or not isinstance(nonces, dict):
                    raise AuthenticationError(f"{what}: refused an accept of another round (a stale accept)")
                if not secret.verify(msg.get("mac"), "accept", round_id, nonce, nonces):
                    raise AuthenticationError(f"{what}: refused an accept with a bad MAC")
                if nonces.get(str(rank)) != claim["nonce"]:
                    raise AuthenticationError(
                        f"{what}: refused an accept that does not admit this worker's claim for rank {rank} "
                        "(an accept of an earlier admission)"
                    )
                return _session(secret, round_id, nonce, nonces, t0)
            reason = msg.get("reason")
            parts = ("reject", round_id, slot, reason) if kind == "reject" else ("fail", round_id, reason)
            if secret.verify(msg.get("mac"), *parts):
                raise AuthenticationError(f"{what}: the trainer refused rank {rank}: {reason}")
        if time.monotonic() - t0 >= timeout_s + VERDICT_GRACE_S:
            raise TransferTimeoutError(
                f"{what}/auth", [0], time.monotonic() - t0, f"the trainer admitted rank {rank} in no time"
            )
        time.sleep(_POLL_S)


def _wait_json(cp: ControlPlane, key: str, t0: float, timeout_s: float, what: str, name: str) -> Any:
    """Wait for ``key`` (each store call bounded, ``control`` rule 5) and parse it strictly.

    Raises:
        TransferTimeoutError: naming rank 0, ``key`` did not appear by ``timeout_s`` after ``t0``.
    """
    s = cp.store
    while not cp.call(f"{what}/auth", timeout_s, s.check, [key]):
        if time.monotonic() - t0 >= timeout_s:
            raise TransferTimeoutError(
                f"{what}/auth", [0], time.monotonic() - t0, f"{name} never appeared in the store"
            )
        time.sleep(_POLL_S)
    return strict_json(cp.call(f"{what}/auth", timeout_s, s.get, key), AUTH_LIMIT_BYTES, name)


__all__ = [
    "AUTH_LIMIT_BYTES",
    "AUTH_VERSION",
    "VERDICT_GRACE_S",
    "Session",
    "host_handshake",
    "worker_handshake",
]
