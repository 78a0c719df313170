"""OwnerTable: who owns each named object of a kind directory, and its mode.

A buffer's, model's or dataset's directory behaves like a POSIX directory for chmod and
chown; this table keeps each one's uid, gid and permission bits, in memory and in
MetaDb's `kv` table (key `owner:<kind>/<name>`, value "uid gid mode"), so they survive a
restart. An object with no row (made before this table existed, or by another node)
belongs to the mount's root owner with mode 0755. Plain Python, no FUSE: the fs layer
turns these into attributes and the kernel enforces them (default_permissions).
"""

from __future__ import annotations

from dataclasses import dataclass

from distorefs.tiers.metadb import MetaDb

PREFIX = "owner:"


@dataclass(frozen=True)
class Owner:
    uid: int
    gid: int
    mode: int  # permission bits (07777)


class OwnerTable:
    """Owners of named objects by (kind, name).

    Examples:
        >>> owners = OwnerTable.load(meta)
        >>> owners.set(b"buffers", b"dqn", Owner(1000, 1000, 0o750))
        >>> owners.get(b"buffers", b"dqn")
        Owner(uid=1000, gid=1000, mode=488)
    """

    def __init__(self, meta: MetaDb) -> None:
        self._meta = meta
        self._owners: dict[tuple[bytes, bytes], Owner] = {}

    @classmethod
    def load(cls, meta: MetaDb) -> OwnerTable:
        self = cls(meta)
        for key, value in meta.rows("kv"):
            if isinstance(key, str) and key.startswith(PREFIX):
                kind, _, name = key[len(PREFIX) :].partition("/")
                uid, gid, mode = (int(part) for part in str(value).split())
                self._owners[(kind.encode(), name.encode("utf-8", "surrogateescape"))] = Owner(uid, gid, mode)
        return self

    @staticmethod
    def _key(kind: bytes, name: bytes) -> str:
        return f"{PREFIX}{kind.decode()}/{name.decode('utf-8', 'surrogateescape')}"

    def get(self, kind: bytes, name: bytes) -> Owner | None:
        return self._owners.get((kind, name))

    def set(self, kind: bytes, name: bytes, owner: Owner) -> None:
        self._owners[(kind, name)] = owner
        self._meta.put("kv", (self._key(kind, name),), (f"{owner.uid} {owner.gid} {owner.mode}",))

    def delete(self, kind: bytes, name: bytes) -> None:
        if self._owners.pop((kind, name), None) is not None:
            self._meta.delete("kv", (self._key(kind, name),))

    def rename(self, kind: bytes, name: bytes, new_name: bytes) -> None:
        owner = self._owners.get((kind, name))
        self.delete(kind, new_name)
        if owner is not None:
            self.delete(kind, name)
            self.set(kind, new_name, owner)
