"""EtcdClient: the few etcd v3 calls distorefs needs, over etcd's own JSON gateway.

Owns the HTTP connection to one etcd endpoint and the mapping of its JSON answers
(base64 keys and values, revisions as strings) to Python. It knows nothing of what the
keys mean: `membership.py` and the daemon's cluster glue do.

Why the gateway and httpx rather than a Python etcd package: the gateway (`/v3/kv/range`,
`/v3/lease/grant`, `/v3/watch` ...) is etcd's documented, versioned API, and httpx runs
natively on trio, so a watch is an ordinary cancellable stream. The Python packages are
asyncio-only (aetcd), sync with a thread per watch (etcd3gw) or unmaintained with pinned
protobuf (python-etcd3). docs/design.md has the comparison.

Every call is bounded by `timeout_s`; a failure raises PeerUnavailable (EIO) naming
the endpoint and the call.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from distorefs.errors import PeerUnavailable

if TYPE_CHECKING:  # httpx is imported by a client: a node outside a cluster never needs
    import httpx  # it, and it was 70-90 ms of every daemon's start

log = logging.getLogger(__name__)
# httpx logs every request at INFO: a lease renewal a second would drown the daemon log.
logging.getLogger("httpx").setLevel(logging.WARNING)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: bytes
    value: bytes
    mod_revision: int


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        _unb64(raw.get("key")), _unb64(raw.get("value")), int(raw.get("mod_revision", 0)), int(raw.get("lease", 0))
    )


class EtcdClient:
    """Examples:
    >>> etcd = EtcdClient("http://127.0.0.1:2379")
    >>> lease = await etcd.grant(5)
    >>> await etcd.put(b"/distore/nodes/a", b"{}", lease=lease)
    >>> async for event in etcd.watch_prefix(b"/distore/nodes/", start_revision=rev + 1): ...
    """

    def __init__(self, url: str, timeout_s: float = 3.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        import httpx

        self._http: httpx.AsyncClient = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)
        self._http_error: type[Exception] = httpx.HTTPError
        self._watch_timeout = httpx.Timeout(timeout_s, read=None)  # a watch waits for events unbounded

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            with trio.fail_after(self.timeout_s):
                response = await self._http.post(path, json=body)
        except (self._http_error, trio.TooSlowError, OSError) as exc:
            raise PeerUnavailable(f"etcd {self.url}{path}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise PeerUnavailable(f"etcd {self.url}{path}: HTTP {response.status_code}: {response.text[:200]}")
        answer: dict[str, Any] = response.json()
        return answer

    # --- keys ---------------------------------------------------------------------------

    async def get(self, key: bytes) -> KeyValue | None:
        found = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = found.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the revision they were read at (to watch from)."""
        found = await self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(raw) for raw in found.get("kvs") or []], int(found["header"]["revision"])

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self._call("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def put_if(self, key: bytes, value: bytes, mod_revision: int, lease: int = 0) -> bool:
        """Put only if the key's mod revision is still `mod_revision` (0: the key is absent)."""
        request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            request["lease"] = str(lease)
        compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
        answer = await self._call("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": request}]})
        return bool(answer.get("succeeded"))

    async def delete(self, key: bytes, prefix: bool = False) -> int:
        """Delete the key (or every key under it); returns the store's revision after."""
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        answer = await self._call("/v3/kv/deleterange", body)
        return int(answer["header"]["revision"])

    # --- leases -------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        answer = await self._call("/v3/lease/grant", {"TTL": ttl_s})
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew `lease`; return its TTL left, 0 if it had already expired."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    # --- watches ------------------------------------------------------------------------

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Yield batches of changes under `prefix` from `start_revision` on, until the
        stream breaks (PeerUnavailable): the caller re-reads and watches again."""
        request = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        try:
            async with self._http.stream("POST", "/v3/watch", json=request, timeout=self._watch_timeout) as stream:
                async for line in stream.aiter_lines():
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    if result.get("canceled") or result.get("compact_revision"):
                        raise PeerUnavailable(f"etcd {self.url}: watch of {prefix!r} cancelled: {result}")
                    events = [
                        WatchEvent(
                            "delete" if raw.get("type") == "DELETE" else "put",
                            _unb64(raw["kv"].get("key")),
                            _unb64(raw["kv"].get("value")),
                            int(raw["kv"].get("mod_revision", 0)),
                        )
                        for raw in result.get("events") or []
                    ]
                    if events:
                        yield events
        except (self._http_error, OSError) as exc:
            raise PeerUnavailable(f"etcd {self.url}: watch of {prefix!r} broke: {exc}") from None
        raise PeerUnavailable(f"etcd {self.url}: watch of {prefix!r} ended")
