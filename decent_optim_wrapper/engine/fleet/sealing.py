r"""The job secret: entries in the store, and replicas handed to joiners, that only the job's members
can have written.

torch's ``TCPStore`` (and gloo's traffic) is neither authenticated nor encrypted: any process that
reaches the store's port can read and write any key. The fleet's protocol keeps pickled values there
(the job's description, applications to join, verdicts, the survivors' reports and decisions), so
without a secret whoever reaches the store could join the job, or forge a decision, or make a member
unpickle whatever it wrote. With a secret (``init_elastic(..., secret=...)`` or the environment
variable :data:`SECRET_ENV` on every worker) each such value is *sealed*:

.. math::
    \text{entry} = \text{tag} \,\|\, \text{payload}, \qquad
    \text{tag} = \mathrm{HMAC\text{-}SHA256}(K, \text{key} \,\|\, 0 \,\|\, \text{payload}),

with ``K`` derived from the secret and ``key`` the store key the entry is written under (so an entry
cannot be replayed under another key), and :meth:`Seal.open` checks the tag, in constant time, before
anything is unpickled. A replica handed to a joiner carries ``HMAC-SHA256(K, replica)`` in place of its
SHA-256 digest. The secret itself never enters the store or the network.

Keys whose first value decides something for someone (a verdict, an application's fate) are named
with a part only the secret gives (:meth:`Seal.private`), so that an outsider cannot write them ahead
of time; an entry that does not verify anywhere else is ignored, logged and counted
(:mod:`~decent_optim_wrapper.engine.fleet.refusals`).

What the seal does not do: hide anything (entries and gloo traffic stay readable by whoever reaches
them), or keep a process that reaches the store from deleting or overwriting entries, which can delay
or stop the job (denial of service) but never admit it or make a member act on a forged decision.
Run the store and gloo inside a private network or a VPN.

Without a secret entries are plain pickles, as before: the store must then be reachable by the job's
processes alone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

from decent_optim_wrapper.engine.errors import DecentError

__all__ = ["SECRET_ENV", "ForgedEntryError", "Seal", "resolve_secret"]

#: The environment variable a job secret may come from (``init_elastic(secret=...)`` takes precedence).
SECRET_ENV = "DECENT_JOB_SECRET"
#: The shortest secret accepted (16 bytes leave no brute-force search in reach).
MIN_SECRET_BYTES = 16

_SEALED, _PLAIN = "s", "p"
_TAG_HEX = 64  # SHA-256


class ForgedEntryError(DecentError):
    """A store entry (or a replica) whose seal does not verify with this process's job secret: written by a
    process without the secret, or by a job with another one."""


def resolve_secret(secret: object = None) -> bytes | None:
    """The job secret as bytes: ``secret`` (a str or bytes), else ``$DECENT_JOB_SECRET``, else None.

    Raises ``TypeError``/``ValueError`` naming the fix for a secret of another type or shorter than 16
    bytes.
    """
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return None
        origin = f"${SECRET_ENV}"
    else:
        origin = "secret"
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(
            f"secret must be a str or bytes shared by every worker of the job, got {type(secret).__name__}; "
            f"e.g. the output of: python -c 'import secrets; print(secrets.token_hex(16))'."
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{origin} is {len(secret)} bytes; a job secret must have at least {MIN_SECRET_BYTES}, e.g. the "
            "output of: python -c 'import secrets; print(secrets.token_hex(16))'."
        )
    return secret


@dataclass(frozen=True)
class Seal:
    """Seals and opens this job's store entries and replica digests with the key of its secret (or,
    without a secret, writes plain entries and opens only plain ones)."""

    secret: bytes | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    @property
    def _key(self) -> bytes:
        assert self.secret is not None
        return hashlib.sha256(b"decent-optim-wrapper job secret\0" + self.secret).digest()

    def seal(self, value: object, where: str) -> str:
        """``value`` pickled, as text (the store's Python API takes strings), sealed for key ``where``."""
        return self.seal_bytes(pickle.dumps(value), where)

    def open(self, raw: bytes, where: str) -> Any:
        """The value of entry ``raw`` read at key ``where``, once its seal is checked.

        Raises :class:`ForgedEntryError` if the seal does not verify: a sealed entry in a job without a
        secret, a plain one in a job with one, or a tag that does not match.
        """
        return pickle.loads(self.open_bytes(raw, where))

    def seal_bytes(self, payload: bytes, where: str) -> str:
        """``payload`` as text, sealed for key ``where`` (:meth:`seal` without the pickle: status
        records are JSON, which a reader may open without trusting the writer further)."""
        if self.secret is None:
            return f"{_PLAIN}:{payload.hex()}"
        return f"{_SEALED}:{self._tag(payload, where)}:{payload.hex()}"

    def open_bytes(self, raw: bytes, where: str) -> bytes:
        """The payload of entry ``raw`` read at key ``where``, once its seal is checked (as :meth:`open`)."""
        text = raw.decode(errors="replace")
        kind, _, rest = text.partition(":")
        if self.secret is None:
            if kind != _PLAIN:
                raise ForgedEntryError(
                    f"store entry {where!r} is sealed with a job secret, and this process has none: start it "
                    f"with the job's secret (init_elastic(secret=...) or ${SECRET_ENV})."
                )
            return bytes.fromhex(rest)
        tag, _, data = rest.partition(":")
        try:
            payload = bytes.fromhex(data)
        except ValueError:
            payload = b""
        if kind != _SEALED or len(tag) != _TAG_HEX or not hmac.compare_digest(tag, self._tag(payload, where)):
            raise ForgedEntryError(
                f"store entry {where!r} does not carry this job's secret: it was written by a process "
                "without it, or by a job with another one (give every worker the same "
                f"init_elastic(secret=...) or ${SECRET_ENV})."
            )
        return payload

    def private(self, name: str) -> str:
        """Store key ``name``, made unpredictable to a process without the secret (``name`` itself in a
        job without one): a key whose first value refuses or admits someone (a verdict, an application's
        fate) cannot be claimed ahead of time by an outsider, who cannot compute it (the store has no
        way to list its keys)."""
        if self.secret is None:
            return name
        tag = hmac.new(self._key, b"key name\0" + name.encode(), hashlib.sha256).hexdigest()
        return f"{name}/{tag[:32]}"

    def digest(self, data: bytes) -> bytes:
        """A replica's 32-byte digest: ``HMAC-SHA256(K, data)`` with a secret, else SHA-256."""
        if self.secret is None:
            return hashlib.sha256(data).digest()
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def _tag(self, payload: bytes, where: str) -> str:
        return hmac.new(self._key, where.encode() + b"\0" + payload, hashlib.sha256).hexdigest()
