"""Authentication of peers: CURVE keys derived from the job's secret, and the ZAP handler.

Owns: key derivation, the socket options that make the agent's ROUTER socket a CURVE server
(for the connections it accepts) or a CURVE client of one peer (for each connect), the ZAP
handler that admits only the job's keys, and the words for a failed handshake.

NOTE [Authentication]:
Rule 1: every worker derives every worker's keypair from (secret, rank): the secret key is
    HMAC-SHA256(secret, b"rrefrt-curve-v1:<rank>") (32 raw bytes, z85-encoded), the public
    key is curve_public(secret key). So no key ever travels through the rendezvous store,
    which is not authenticated; whoever lacks the secret can compute no key of the job.
Rule 2: libzmq copies a socket's options at each bind() and connect() (checked on libzmq
    4.3.5: one ROUTER socket can be a CURVE server on its binds and a CURVE client of a
    different server key on each connect). So the agent calls ``configure_server`` right
    before every bind and ``configure_client`` (server key = that peer's public key) right
    before every connect.
Rule 3: a CURVE server asks the ZAP handler - a socket bound to ``inproc://zeromq.zap.01``
    in the agent's own context, served by the agent's I/O thread without ever blocking -
    about every client. It admits a client iff the mechanism is CURVE and its public key is
    one of the job's ``world_size`` keys. The handler is bound before the ROUTER socket binds
    and closed after it; ZAP_ENFORCE_DOMAIN makes libzmq refuse a client when no handler
    answers (without it libzmq 4.3 admits any CURVE key when the handler is missing).
Rule 4: libzmq delivers no message of a connection before its handshake succeeded, so no
    header, let alone a payload, of an unauthenticated peer reaches the agent: nothing of it
    is decoded, nothing is unpickled. After the handshake every frame is encrypted and
    authenticated (CurveZMQ: Curve25519, XSalsa20-Poly1305).

Without a secret the agent uses no mechanism at all (ZeroMQ's NULL), as before.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

KEY_CONTEXT = b"rrefrt-curve-v1:%d"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"rrefrt"

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: monitor events the agent watches for authentication (besides its liveness events)
HANDSHAKE_EVENTS = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED

_CRYPTOGRAPHIC = int(getattr(zmq, "PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC", 0x11000001))
_MECHANISM_MISMATCH = int(getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002))


def derive_secret_key(secret: bytes | str, rank: int) -> bytes:
    """The z85-encoded CURVE secret key of ``rank`` in the job keyed by ``secret``."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the job secret must not be empty")
    return z85.encode(hmac.new(raw, KEY_CONTEXT % rank, hashlib.sha256).digest())


def derive_keypair(secret: bytes | str, rank: int) -> tuple[bytes, bytes]:
    """``(public, secret)`` z85-encoded CURVE keys of ``rank`` (NOTE [Authentication], Rule 1)."""
    sk = derive_secret_key(secret, rank)
    return zmq.curve_public(sk), sk


@dataclass(frozen=True)
class CurveAuth:
    """The keys of one worker of a job: its own keypair and every member's public key."""

    rank: int
    world_size: int
    public_key: bytes  #: z85, this worker's
    secret_key: bytes = field(repr=False)  #: z85, this worker's; never logged
    peer_keys: tuple[bytes, ...] = field(repr=False)  #: z85 public key of each rank
    #: raw 32-byte public key -> rank: who the ZAP handler admits
    members: dict[bytes, int] = field(repr=False, compare=False, hash=False)

    @classmethod
    def for_job(cls, secret: bytes | str, rank: int, world_size: int) -> CurveAuth:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
        keys = tuple(zmq.curve_public(derive_secret_key(secret, r)) for r in range(world_size))
        return cls(
            rank=rank,
            world_size=world_size,
            public_key=keys[rank],
            secret_key=derive_secret_key(secret, rank),
            peer_keys=keys,
            members={z85.decode(k): r for r, k in enumerate(keys)},
        )

    def peer_key(self, rank: int) -> bytes:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"no CURVE key for rank {rank}: the job has {self.world_size} workers")
        return self.peer_keys[rank]

    def member_of(self, raw_key: bytes) -> int | None:
        """The rank whose public key is ``raw_key`` (32 raw bytes), or None."""
        return self.members.get(bytes(raw_key))


def configure_keys(sock: zmq.Socket, auth: CurveAuth) -> None:
    """The socket's own keypair, used in both roles."""
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.secret_key)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def configure_server(sock: zmq.Socket, auth: CurveAuth) -> None:
    """Call right before ``bind``: accepted connections must pass CURVE and the ZAP handler."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def bind(sock: zmq.Socket, auth: CurveAuth | None, endpoint: str, bound: list[str]) -> str:
    """Bind ``sock`` as a CURVE server when the job has keys (options are copied at bind,
    NOTE [Authentication], Rule 2); record and return the concrete endpoint (port 0 -> the
    port chosen). The data, heartbeat and echo sockets all bind this way."""
    if auth is not None:
        configure_server(sock, auth)
    sock.bind(endpoint)
    actual = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    bound.append(actual)
    return actual


def configure_client(sock: zmq.Socket, auth: CurveAuth, peer_rank: int) -> None:
    """Call right before ``connect`` to ``peer_rank``: we authenticate to it, and it to us
    (the handshake fails unless the server holds the secret key of ``peer_rank``)."""
    sock.setsockopt(zmq.CURVE_SERVER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, auth.peer_key(peer_rank))


class ZapHandler:
    """Answers libzmq's ZAP requests (RFC 27) for one context (NOTE [Authentication], Rule 3).

    A ROUTER socket, so a request never leaves it in a state where it must reply before it
    can read again; ``serve`` never blocks and is called by the owner's I/O thread.
    """

    def __init__(self, ctx: zmq.Context, auth: CurveAuth, stats: collections.Counter) -> None:
        self._auth = auth
        self._stats = stats
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def serve(self) -> None:
        sock = self.socket
        for _ in range(1000):
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self.answer(request)
            if reply is None:
                self._stats["zap_malformed"] += 1
                continue
            try:
                sock.send_multipart(reply, zmq.NOBLOCK)
            except zmq.ZMQError:  # the session that asked is gone
                pass

    def answer(self, request: list[bytes]) -> list[bytes] | None:
        """The reply to one request, None for a request too malformed to answer.

        request: [routing id, b"", version, request id, domain, address, identity,
                  mechanism, credentials...]; reply: [routing id, b"", b"1.0", request id,
                  status code, status text, user id, metadata].
        """
        if len(request) < 8 or request[1] != b"":
            return None
        rid, _, version, request_id, _domain, _address, _identity, mechanism = request[:8]
        credentials = request[8:]
        rank = None
        if version == b"1.0" and mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            rank = self._auth.member_of(credentials[0])
        if rank is None:
            self._stats["zap_denied"] += 1
            return [rid, b"", b"1.0", request_id, b"400", b"not a member of this job", b"", b""]
        self._stats["zap_admitted"] += 1
        return [rid, b"", b"1.0", request_id, b"200", b"OK", b"w%d" % rank, b""]

    def close(self) -> None:
        self.socket.close(0)


def describe_failure(event: int, value: int) -> str:
    """Words for a failed handshake reported by the socket monitor."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the key was refused (ZAP status {value}): it is not one of this job's keys (another secret)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == _MECHANISM_MISMATCH:
            return "one side requires CURVE authentication and the other does not: a secret is set on one side only"
        if value == _CRYPTOGRAPHIC:
            return "a CURVE message could not be decrypted: the two sides derived their keys from different secrets"
        return f"ZMTP protocol error 0x{value:x} during the handshake"
    return "the connection was closed during the CURVE handshake, most likely because the two sides use different secrets"


def is_terminal(event: int) -> bool:
    """libzmq does not retry a connect whose handshake failed for a protocol or
    authentication reason (it does retry one that was closed during the handshake)."""
    return event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
