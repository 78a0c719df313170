"""distorefs.client: helpers for replay buffers, weights and checkpoints.

Everything here talks to the daemon through the mount (open/read/write, an xattr for
staged files), except `Sampler(transport="shm")`, which after opening `sample.shm`
through the mount draws over the daemon's Unix socket; a user of another language can
do the same by following docs/formats.md.

Examples:
    >>> from distorefs import client
    >>> client.append("/mnt/distore/buffers/dqn", [pickle.dumps(t) for t in transitions])
    >>> batch = client.sample("/mnt/distore/buffers/dqn")          # blob buffer
    >>> [(index, weight, item), ...] = batch
    >>> client.update_priorities("/mnt/distore/buffers/dqn", indices, td_errors)
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import io
import json
import mmap
import os
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from distorefs import hugepages
from distorefs.stores.replay.config import parse_schema
from distorefs.stores.replay.formats import (
    NPY_MAGIC,
    batch_dtype,
    batch_length,
    decode_blob_batch,
    frame_items,
    npy_header,
)


def append(buffer_dir: str | os.PathLike[str], items: Sequence[bytes] | np.ndarray) -> None:
    """Append items in one open: a structured numpy array to a schema buffer (as .npy),
    or byte strings to a blob buffer (as a DSITEMS1 stream). Returns once acknowledged.
    Many small appends go faster through an `Appender` (one request each)."""
    # os.open, not open(): "wb" adds O_CREAT | O_TRUNC and FileIO an fstat, each more
    # work or another round trip to the daemon for a file that always exists
    fd = os.open(os.path.join(buffer_dir, "append"), os.O_WRONLY | os.O_CLOEXEC)
    try:
        _write_all(fd, _append_bytes(items))
    finally:
        os.close(fd)


class Appender:
    """Appends through one kept descriptor of the buffer's `append`: each `append` is
    one `write()`, acknowledged when it returns (the items are in the log and survive a
    killed daemon, as after a close), so an item costs one request to the daemon instead
    of an open, a write and a close (docs/namespace.md, "append"). Reverb's
    `client.insert` keeps its connection the same way.

    The descriptor holds the mount busy (an unmount waits for `close()`); use it as a
    context manager. A process forked while it is open opens its own at its first
    append. After a failed append the descriptor is dropped (its close discards a
    partial record, if any) and the next append opens a new one.

    Examples:
        >>> with client.Appender("/mnt/distore/buffers/dqn") as out:
        ...     for transition in episode:
        ...         out.append([pickle.dumps(transition)])   # or a structured array
    """

    def __init__(self, buffer_dir: str | os.PathLike[str]) -> None:
        self.path = os.path.join(buffer_dir, "append")
        self._fd: int | None = None
        self._pid = 0
        self._closed = False
        self._descriptor()

    def _descriptor(self) -> int:
        if self._closed:
            raise ValueError(f"{self.path}: append on a closed Appender")
        if self._fd is None or self._pid != os.getpid():  # (a forked child leaves its parent's alone)
            self._fd, self._pid = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC), os.getpid()
        return self._fd

    def append(self, items: Sequence[bytes] | np.ndarray) -> None:
        """Append `items` (byte strings, or a structured array of the buffer's schema) with
        one write; returns once acknowledged. OSError as `append` raises it."""
        fd = self._descriptor()
        try:
            _write_all(fd, _append_bytes(items))
        except BaseException:
            self._fd = None
            with contextlib.suppress(OSError):  # EINVAL for a partial record it discards
                os.close(fd)
            raise

    def close(self) -> None:
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            os.close(fd)

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _append_bytes(items: Sequence[bytes] | np.ndarray) -> bytes:
    """What one append writes: a whole .npy, or a whole DSITEMS1 stream; either may
    follow another on the same open."""
    if isinstance(items, np.ndarray):
        out = io.BytesIO()
        np.save(out, items, allow_pickle=False)
        return out.getvalue()
    return frame_items(items)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_all(path: str | os.PathLike[str]) -> bytearray:
    """Read a control file to EOF (they have size 0, so read until an empty read).

    Raises OSError with EAGAIN when the daemon could not serve it in time (os.read, not
    a file object: FileIO.read returns None on EAGAIN, which looks like EOF).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        return _read_fd(fd, bytearray(64 * 1024), 0)
    finally:
        os.close(fd)


def _read_fd(fd: int, buf: bytearray, size: int) -> bytearray:
    while True:
        if len(buf) - size < 64 * 1024:
            buf.extend(bytes(len(buf)))
        got = os.readv(fd, [memoryview(buf)[size:]])
        if not got:
            del buf[size:]
            return buf
        size += got


def read_batch(path: str | os.PathLike[str], into: bytearray | None = None) -> memoryview:
    """Read one batch, allocating once: the first bytes say how long it is. With `into`,
    that buffer is reused when it is large enough (see Sampler)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = bytearray(64 * 1024)
        got = os.readv(fd, [head])
        total = batch_length(memoryview(head)[:got]) if got else 0
        if total is None:  # a huge .npy header: fall back to reading until EOF
            return memoryview(_read_fd(fd, head, got))
        buf = into if into is not None and len(into) >= total else bytearray(total)
        buf[:got] = memoryview(head)[:got]
        view = memoryview(buf)
        size = got
        while size < total:
            n = os.readv(fd, [view[size:total]])
            if not n:
                raise OSError(f"{path}: batch ended at {size} of {total} bytes")
            size += n
        return view[:total]
    finally:
        os.close(fd)


def _decode(data: memoryview, copy: bool) -> Any:
    if bytes(data[: len(NPY_MAGIC)]) == NPY_MAGIC:
        if copy:
            return np.load(io.BytesIO(data), allow_pickle=False)
        parsed = npy_header(data)
        assert parsed is not None  # read_batch read it whole
        return np.frombuffer(data, dtype=parsed.dtype, offset=parsed.data_offset, count=parsed.count)
    return decode_blob_batch(data, copy=copy)


def sample(buffer_dir: str | os.PathLike[str], batch_size: int | None = None, copy: bool = True) -> Any:
    """Draw one batch: a numpy structured array (schema buffers, with `_index` and
    `_weight`), or a list of (index, weight, item) (blob buffers). With copy=False the
    items are memoryviews into one batch buffer instead of bytes (faster for big items)."""
    name = "sample" if batch_size is None else f"sample.{batch_size}"
    return _decode(read_batch(os.path.join(buffer_dir, name)), copy)


class Sampler:
    """Draws batches into one reused buffer: no allocation per batch, so big batches
    (R2D2's 40 MB) move at the mount's speed. What `sample` returns is a view into that
    buffer: valid until the next call.

    With `transport="shm"` the batches come through shared memory instead: the items
    sit in an arena the daemon keeps for the buffer, mapped read-only here, and each
    draw only says where ("Shared-memory sampling, version 2" in docs/formats.md; a blob
    batch's items are views into the arena, a schema batch is gathered from it). Same
    format, indices, weights and accounting as through the files. `prefetch=N` keeps N
    more draws in flight while the caller works (as Reverb's samplers do): faster, but
    a priority update then reaches the draws after those N. While it waits for a reply
    it polls the socket for `spin_us` microseconds before it sleeps (default 300 where
    the machine has more than one CPU, else 0): a reply usually comes within that, and
    a sleeping process's wake-up costs more than the draw on a VM whose idle CPUs halt.
    Where version 2 is not there (an older daemon, a compressed buffer, a batch over
    4096 items) it uses version 1 (the daemon copies each batch into a region of its
    own), and where shared memory is not there at all (no /dev/shm, another node, the
    arena does not fit the DRAM budget) it goes back to the files by itself;
    `transport` then says "fuse". Call `close()` (or use it as a context manager) to
    hand everything back at once; the daemon also reclaims it when this process exits
    or is killed.

    Examples:
        >>> sampler = client.Sampler("/mnt/distore/buffers/r2d2")
        >>> for step in range(steps):
        ...     batch = sampler.sample()      # [(index, weight, memoryview)] or a numpy view
    """

    def __init__(
        self,
        buffer_dir: str | os.PathLike[str],
        batch_size: int | None = None,
        transport: str = "fuse",
        prefetch: int = 0,
        spin_us: int | None = None,
    ) -> None:
        if transport not in ("fuse", "shm"):
            raise ValueError(f"transport must be 'fuse' or 'shm', got {transport!r}")
        if not 0 <= prefetch <= MAX_PREFETCH:
            raise ValueError(f"prefetch must be 0..{MAX_PREFETCH}, got {prefetch}")
        spin_us = default_spin_us() if spin_us is None else spin_us
        if not 0 <= spin_us <= MAX_SPIN_US:
            raise ValueError(f"spin_us must be 0..{MAX_SPIN_US}, got {spin_us}")
        self._spin_s = spin_us / 1e6
        name = "sample" if batch_size is None else f"sample.{batch_size}"
        self.path = os.path.join(buffer_dir, name)
        self._buf = bytearray()
        self.transport = transport
        self._buffer_dir = os.fspath(buffer_dir)
        self._prefetch = prefetch
        self.shm_version: int | None = None
        self._shm: _ShmChannel | None = None
        self._session: _ShmSession | None = None
        if transport == "shm":
            self._connect(version2=True)

    def _connect(self, version2: bool) -> None:
        """Take the best shared-memory path left: a version 2 session (unless told not
        to), else version 1, else the files (`transport` then says "fuse")."""
        control = self.path + ".shm"
        if version2:
            try:
                self._session = _ShmSession(control, self._buffer_dir, self._prefetch, self._spin_s)
                self.shm_version = 2
                return
            except OSError:
                self._session = None
        try:
            self._shm = _ShmChannel(control)
            self.shm_version = 1
        except OSError:
            self.close()  # no shared-memory path here: the files it is

    def sample(self) -> Any:
        if self._session is not None and self._session.closed:
            self._connect(version2=True)  # a wait cut short (a signal) closed it: a reply may have been due
        if self._session is not None:
            try:
                return self._session.next()
            except OSError as exc:
                if exc.errno not in SESSION_GIVES_UP:
                    raise
                self._session.close()  # version 2 cannot serve this buffer now: version 1 or the files
                self._session = None
                self._connect(version2=False)
        if self._shm is not None:
            try:
                return _decode(self._shm.next(), copy=False)
            except OSError as exc:
                if exc.errno not in (errno.ENOMEM, errno.EACCES, errno.ENOENT):
                    raise
                self.close()  # the region could not be made (or opened): the files from now on
        data = read_batch(self.path, self._buf)
        if data.obj is not self._buf:
            self._buf = data.obj  # type: ignore[assignment]  # grew: keep the larger buffer
        return _decode(data, copy=False)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self.transport = "fuse"
        self.shm_version = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MAX_PREFETCH = 8  # the daemon lets a session hold 16 batches
MAX_SPIN_US = 10_000


def default_spin_us() -> int:
    """How long a session polls for a reply before it sleeps: 300 µs, or none on one CPU
    (where polling would only delay the daemon it waits for)."""
    return 300 if (os.cpu_count() or 1) > 1 else 0


SESSION_REQUEST = struct.Struct("<IIQ")  # docs/formats.md, "Shared-memory sampling, version 2"
SESSION_REPLY = struct.Struct("<iIQQQQ")
SESSION_ITEM_BYTES = 28  # index, weight, arena slot, length
SESSION_MAX_BATCH = 4096
# a session's errors after which version 1 (or the files) may still serve the buffer
SESSION_GIVES_UP = frozenset(
    {
        errno.ENOMEM, errno.EOPNOTSUPP, errno.EMSGSIZE, errno.EACCES, errno.EPROTO, errno.ECONNRESET,
        errno.ECONNREFUSED, errno.EPIPE, errno.ENOENT,
    }
)  # fmt: skip


class _ShmSession:
    """The client side of a version 2 session: the control file held open (the daemon's
    proof that this process may sample), the socket, and the arena mapped read-only."""

    def __init__(self, control: str, buffer_dir: str, prefetch: int, spin_s: float = 0.0) -> None:
        with open(os.path.join(buffer_dir, "config"), "rb") as f:
            schema_json = json.loads(f.read()).get("schema")
        self._schema = parse_schema("config", schema_json) if schema_json else None
        self._prefetch = prefetch
        self._spin_s = spin_s
        self.spun_replies = 0  # replies taken while polling, before the process would have slept
        self._sock: socket.socket | None = None
        self._arena_fd: int | None = None
        self._fd = os.open(control, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.write(self._fd, b"session 2\n")
            words = os.read(self._fd, 4096).split()
            if len(words) != 3 or words[0] != b"DSSHM2":
                raise OSError(errno.EPROTO, f"sample.shm: not a version 2 ticket: {b' '.join(words)[:40]!r}")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._sock.connect(os.fsdecode(words[1]))
            self._sock.send(words[2])
        except BaseException:
            self.close()
            raise
        self._in_flight = 0
        self._last_id = 0  # the batch handed out last (released by the next request)
        self._arena_number = 0
        self._map: mmap.mmap | None = None
        self._mapped_slots = 0
        self._stride = 0
        self._reply = bytearray(SESSION_REPLY.size + SESSION_ITEM_BYTES * SESSION_MAX_BATCH + 4096)
        self._out: np.ndarray | None = None

    @property
    def closed(self) -> bool:
        return self._sock is None

    def next(self) -> Any:
        sock = self._sock
        if sock is None:
            raise OSError(errno.ECONNRESET, "sample.shm: the session was closed")
        try:
            while self._in_flight <= self._prefetch:
                sock.send(SESSION_REQUEST.pack(1, 0, self._last_id + 1))
                self._in_flight += 1
            size, ancdata = self._receive(sock)
        except BaseException:
            self.close()  # a reply may still be on its way: this session is done
            raise
        self._in_flight -= 1
        for fd in _received_fds(ancdata):
            self._new_arena(fd)
        if size < SESSION_REPLY.size:
            raise OSError(errno.ECONNRESET, "sample.shm: the daemon ended the session")
        status, count, batch_id, stride, slots, number = SESSION_REPLY.unpack_from(self._reply)
        if status:
            message = bytes(self._reply[SESSION_REPLY.size : size]).decode(errors="replace")
            raise OSError(status, f"sample.shm: {message}")
        if number != self._arena_number or stride != self._stride or slots > self._mapped_slots:
            self._map_arena(stride, slots, number)
        self._last_id = batch_id
        at = SESSION_REPLY.size
        reply = self._reply
        indices = np.frombuffer(reply, "<i8", count, at)
        weights = np.frombuffer(reply, "<f4", count, at + 8 * count)
        arena_slots = np.frombuffer(reply, "<i8", count, at + 12 * count)
        lengths = np.frombuffer(reply, "<i8", count, at + 20 * count)
        if self._schema is None:
            assert self._map is not None
            starts = arena_slots * stride
            pieces = map(slice, starts.tolist(), (starts + lengths).tolist())
            # (index, weight, view) tuples built by zip and map in C: no Python step per item
            views = map(memoryview(self._map).__getitem__, pieces)
            return list(zip(indices.tolist(), weights.tolist(), views, strict=True))
        return self._gather(indices, weights, arena_slots)

    def _receive(self, sock: socket.socket) -> tuple[int, list[tuple[int, int, bytes]]]:
        """The next reply (and any descriptor with it): polled without blocking for the
        session's spin time, then waited for."""
        if self._spin_s:
            until = time.perf_counter() + self._spin_s
            while True:
                try:
                    size, ancdata, _flags, _addr = sock.recvmsg_into(
                        [self._reply], socket.CMSG_SPACE(4), socket.MSG_DONTWAIT
                    )
                except BlockingIOError:
                    if time.perf_counter() >= until:
                        break
                else:
                    self.spun_replies += 1
                    return size, ancdata
        size, ancdata, _flags, _addr = sock.recvmsg_into([self._reply], socket.CMSG_SPACE(4))
        return size, ancdata

    def _gather(self, indices: np.ndarray, weights: np.ndarray, arena_slots: np.ndarray) -> np.ndarray:
        """A schema batch: the records gathered out of the arena, then `_index`/`_weight`."""
        assert self._schema is not None
        assert self._map is not None
        dtype = batch_dtype(self._schema)
        count, record = len(indices), self._schema.itemsize
        if self._out is None or len(self._out) != count:
            self._out = np.empty(count, dtype=dtype)
        out = self._out
        rows = np.frombuffer(self._map, np.uint8, self._mapped_slots * self._stride).reshape(-1, self._stride)
        raw = out.view(np.uint8).reshape(count, dtype.itemsize)
        if record >= 4096:  # big records: one copy each, straight into the batch
            for k, slot in enumerate(arena_slots.tolist()):
                raw[k, :record] = rows[slot, :record]
        else:
            raw[:, :record] = rows[arena_slots, :record]
        out["_index"] = indices
        out["_weight"] = weights
        return out

    def _new_arena(self, fd: int) -> None:
        if self._arena_fd is not None:
            os.close(self._arena_fd)
        self._arena_fd = fd
        self._mapped_slots = 0  # map it on the reply's numbers

    def _map_arena(self, stride: int, slots: int, number: int) -> None:
        if self._arena_fd is None:
            raise OSError(errno.EPROTO, "sample.shm: a batch in an arena the daemon did not send")
        self._map = mmap.mmap(self._arena_fd, stride * slots, prot=mmap.PROT_READ)  # the old map goes with its views
        hugepages.advise(self._map)
        self._stride, self._mapped_slots, self._arena_number = stride, slots, number

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._arena_fd is not None:
            os.close(self._arena_fd)
            self._arena_fd = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _ShmChannel:
    """The client side of `sample.shm`: one open, one mapping per region, the previous
    batch's slot released before the next is drawn (so a view handed out stays valid
    until the next call)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR)
        self._maps: dict[bytes, mmap.mmap] = {}
        self._held: int | None = None

    def next(self) -> memoryview:
        if self._held is not None:
            os.write(self._fd, b"release %d\n" % self._held)
            self._held = None
        line = os.read(self._fd, 4096)
        magic, path, size, offset, length, slot = line.split()
        if magic != b"DSSHM1":
            raise OSError(errno.EPROTO, f"sample.shm: not a version 1 descriptor: {line[:40]!r}")
        region = self._maps.get(path)
        if region is None:
            for old in self._maps.values():
                old.close()  # the daemon replaced the region (a bigger batch): the old one is done
            self._maps = {}
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                region = self._maps[path] = mmap.mmap(fd, int(size), prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        self._held = int(slot)
        return memoryview(region)[int(offset) : int(offset) + int(length)]

    def close(self) -> None:
        for region in self._maps.values():
            try:
                region.close()
            except BufferError:
                pass  # a view of the last batch is still alive: the mapping goes with it
        self._maps = {}
        os.close(self._fd)


def update_priorities(buffer_dir: str | os.PathLike[str], indices: Iterable[int], priorities: Iterable[float]) -> None:
    """Set priorities in one write (all applied, or none: OSError EINVAL)."""
    pairs = np.zeros(0, dtype=[("index", "<i8"), ("priority", "<f8")])
    index_array = np.asarray(list(indices), dtype=np.int64)
    pairs = np.zeros(len(index_array), dtype=pairs.dtype)
    pairs["index"] = index_array
    pairs["priority"] = np.asarray(list(priorities), dtype=np.float64)
    out = io.BytesIO()
    np.save(out, pairs, allow_pickle=False)
    with open(os.path.join(buffer_dir, "priority"), "wb", buffering=0) as f:
        f.write(out.getvalue())


# --- weights ------------------------------------------------------------------------------

WEIGHTS_CONTROL = frozenset({"version", "wait"})


def model_version(model_dir: str | os.PathLike[str]) -> int:
    """The model's current version number (0 before the first publish)."""
    with open(os.path.join(model_dir, "version"), "rb") as f:
        return int(f.read().split()[0])


def open_model(model_dir: str | os.PathLike[str], attempts: int = 100) -> tuple[int, dict[bytes, Any]]:
    """Open every file of the model's current version: (version, {name: open file}).

    The files are opened between two reads of `version` and the opens are retried until
    both reads agree, so all of them belong to one version; each open file then reads
    that version however many are published meanwhile. The caller closes them.
    """
    directory = os.fsencode(model_dir)
    for _ in range(attempts):
        files: dict[bytes, Any] = {}
        try:
            before = model_version(model_dir)
            for name in os.listdir(directory):
                if name.decode(errors="replace") not in WEIGHTS_CONTROL:
                    files[name] = open(os.path.join(directory, name), "rb")  # noqa: SIM115
            if model_version(model_dir) == before:
                return before, files
        except FileNotFoundError:
            pass  # a publish replaced the model or a file meanwhile: try again
        except BaseException:
            for f in files.values():
                f.close()
            raise
        for f in files.values():
            f.close()
    raise TimeoutError(f"{model_dir}: versions changed during each of {attempts} attempts to open one")


def map_version(path: str | os.PathLike[str], attempts: int = 100, transport: str = "auto") -> tuple[int, memoryview]:
    """(version, a read-only zero-copy view) of one published file of a model, e.g.
    `map_version(".../weights/policy/model.safetensors")`.

    With `transport="auto"` (the default) or `"shm"`, it maps the current version's
    shared copy: a sealed memfd the daemon fills once per version and hands over on its
    Unix socket after a getxattr of the path names the version, read at memory speed
    with no read through FUSE (docs/formats.md, "Weights through shared memory, version
    1"). Where the daemon has no shared memory (no /dev/shm, another node's mount, its
    budget used up), `"auto"` maps through the mount instead and `"shm"` raises the
    error. Through the mount (`"mount"`) it opens `NAME@V`, the file as of the current
    version V, and maps it: one inode per version, so every reader of a version shares
    the kernel's page cache of it (the first reads it from the daemon). Either way a
    publish landing in between makes it try the new version.

    The view stays valid and unchanged while it is held, whatever is published
    meanwhile; it is freed when the view and the arrays made from it are gone.
    `np.frombuffer(view, ...)` and `torch.frombuffer(view, ...)` do not copy;
    `safetensors.torch.load(bytes(view))` copies once. An empty file maps to an empty
    view.
    """
    if transport not in ("auto", "shm", "mount"):
        raise ValueError(f"transport is 'auto', 'shm' or 'mount', not {transport!r}")
    path = os.fspath(path)
    if transport != "mount":
        for _ in range(attempts):
            try:
                return _map_shared_copy(path)
            except _Republished:
                continue  # a publish came in between: the new version
            except OSError:
                if transport == "shm":
                    raise
                break
        else:
            raise TimeoutError(f"{path}: versions changed during each of {attempts} attempts to map one")
    model_dir = os.path.dirname(path)
    for _ in range(attempts):
        version = model_version(model_dir)
        try:
            fd = os.open(f"{path}@{version}", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if model_version(model_dir) == version:
                raise FileNotFoundError(errno.ENOENT, f"{path}: no such file in version {version}") from None
            continue  # a publish came in between: try the new version
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return version, memoryview(b"")
            return version, memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
        finally:
            os.close(fd)
    raise TimeoutError(f"{path}: versions changed during each of {attempts} attempts to map one")


def _received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors a datagram from the daemon carried (SCM_RIGHTS), now this process's."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return fds.tolist()


class _Republished(OSError):
    """The version asked for was replaced before its copy was handed over."""


SHM_XATTR = "user.distore.shm"
COPY_REPLY = struct.Struct("<iQ")
COPY_TIMEOUT_S = 60.0  # the daemon copies the version into shared memory first (once per version)
SHARED_MAP_FLAGS = mmap.MAP_SHARED | mmap.MAP_POPULATE  # one call maps every page: no fault per 16 pages


def _map_shared_copy(path: str) -> tuple[int, memoryview]:
    """(version, view) of the current version's shared copy of the weights file `path`:
    a getxattr gets the version and a ticket, the daemon's socket the sealed memfd for
    it, which is mapped (two requests through the mount, none of the bytes)."""
    try:
        words = os.getxattr(path, SHM_XATTR).split()
    except OSError as exc:
        if exc.errno == errno.ESTALE:
            raise _Republished(exc.errno, exc.strerror) from None
        raise
    if len(words) != 4 or words[0] != b"DSSHMW1" or not words[3].isdigit():
        raise OSError(errno.EPROTO, f"{SHM_XATTR}: not a version 1 ticket: {b' '.join(words)[:40]!r}")
    version = int(words[3])
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(COPY_TIMEOUT_S)
        sock.connect(os.fsdecode(words[1]))
        sock.send(words[2])
        reply, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(4))
    fds = _received_fds(ancdata)
    try:
        if len(reply) < 4:
            raise OSError(errno.ECONNRESET, "the daemon closed the hand-over")
        status = int.from_bytes(reply[:4], "little", signed=True)
        if status == errno.ENOENT:
            raise _Republished(status, "the version was replaced before its hand-over")
        if status:
            raise OSError(status, f"no shared copy: {reply[SESSION_REPLY.size :].decode(errors='replace')}")
        if len(reply) != COPY_REPLY.size or len(fds) != 1:
            raise OSError(errno.EPROTO, "a hand-over reply is its size and one descriptor")
        _status, size = COPY_REPLY.unpack(reply)
        if size == 0:
            return version, memoryview(b"")
        return version, memoryview(mmap.mmap(fds[0], size, flags=SHARED_MAP_FLAGS, prot=mmap.PROT_READ))
    finally:
        for received in fds:
            os.close(received)


ADOPT_XATTR = "user.distore.adopt"
_FALLBACK_CHUNK = 1 << 20


def _on_distorefs(fd: int) -> bool:
    """Whether open file `fd` lies on a distorefs mount (its device in mountinfo)."""
    dev = os.fstat(fd).st_dev
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[2] == want and " - fuse.distorefs " in line:
                    return True
    except OSError:
        pass
    return False


class StagedFile(io.BufferedWriter):
    """A file written into a memfd of this process and handed to the daemon whole at
    close (see `staged_open`). `adopted` says, after close, whether the daemon took the
    memory over (True) or the bytes went through the mount instead (False)."""

    def __init__(self, target_fd: int, memfd: int) -> None:
        super().__init__(io.FileIO(memfd, "wb", closefd=True), buffer_size=_FALLBACK_CHUNK)
        self._memfd = memfd
        self._target = target_fd
        self.adopted = False
        self.fallback_reason = ""

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abandon()  # a save that raised: the file stays as its open left it (empty)
        else:
            self.close()

    def abandon(self) -> None:
        """Close without handing anything over: the target keeps what its open left it
        (empty). What `with` does when the block raises."""
        if self.closed:
            return
        target, self._target = self._target, -1
        os.close(target)
        with contextlib.suppress(OSError):  # unwritten buffered bytes are dropped with the memfd
            super().close()

    @property
    def path(self) -> str:
        """A path to the staged bytes, for writers that take a path (see `staged_path`)."""
        return f"/proc/self/fd/{self._memfd}"

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
            memfd = self._memfd
            try:
                fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _SEALS)
                os.setxattr(self._target, ADOPT_XATTR, b"%d" % memfd)
                self.adopted = True
            except OSError as exc:
                # Not taken over (no room in DRAM, a daemon that may not reach into this
                # process, an older daemon): the same bytes through the mount.
                self.fallback_reason = f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"
                _copy_through(memfd, self._target)
            target, self._target = self._target, -1
            os.close(target)  # the close of the file: it persists like any other (errors too)
        finally:
            if self._target >= 0:
                os.close(self._target)
                self._target = -1
            super().close()


def _copy_through(memfd: int, target: int) -> None:
    size = os.fstat(memfd).st_size
    with mmap.mmap(memfd, size, prot=mmap.PROT_READ) if size else contextlib.nullcontext(b"") as data:
        view = memoryview(data)
        at = 0
        while at < size:
            at += os.pwrite(target, view[at : at + _FALLBACK_CHUNK], at)
        view.release()


_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def staged_open(path: str | os.PathLike[str], mode: str = "wb") -> io.BufferedWriter:
    """Open `path` for writing a whole file through shared memory instead of FUSE
    writes: `with staged_open(f"{M}/checkpoints/run1/step-100.pt", "wb") as f:
    torch.save(sd, f)`.

    The bytes go into a memfd of this process at memory speed. At close the memfd is
    sealed and handed to the daemon, which makes it the file's content without a copy
    through the kernel's FUSE path: the file shows its new bytes in the mount at once and
    persists like a file written through the mount (under checkpoints/: in the
    background, with `user.distore.state`, fsync, retention and replicas; elsewhere: in
    the log before close returns). The writer may die right after close: the daemon
    holds the memory until the bytes are durable. Permissions are the mount's: the file
    is created (or truncated) through the mount first, with this process's rights.

    Where the daemon cannot take the memory (not enough DRAM budget, no memfd, a daemon
    not allowed to reach into this process) the same bytes are written through the mount
    at close; off a distorefs mount, the file is simply written where it is. The mode
    is "wb" only: the file is written whole, never read back through this object.
    """
    if mode not in ("wb", "bw"):
        raise ValueError(f"staged_open writes whole files: mode must be 'wb', got {mode!r}")
    target = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        memfd = -1
        if _on_distorefs(target):
            with contextlib.suppress(OSError):  # no memfd here: the plain file below
                memfd = os.memfd_create("distorefs-staged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        if memfd < 0:
            return open(target, "wb", closefd=True)  # noqa: SIM115  # the caller closes it
    except BaseException:
        os.close(target)
        raise
    return StagedFile(target, memfd)


def staged_path(f: io.BufferedWriter) -> str:
    """The path to write a file that `staged_open` returned, for writers that take a
    path (`torch.save(sd, staged_path(f))`): its memfd, or off a distorefs mount the file
    itself. Write through it or through `f`, not both. Writers that write a temporary
    file beside the path and rename it (safetensors' `save_file`) cannot use it: give
    them bytes instead (`f.write(safetensors.torch.save(sd))`)."""
    if isinstance(f, StagedFile):
        return f.path
    return f"/proc/self/fd/{f.fileno()}"


def read_model(model_dir: str | os.PathLike[str]) -> tuple[int, dict[bytes, bytes]]:
    """Read every file of one version of the model: (version, {name: bytes})."""
    number, files = open_model(model_dir)
    try:
        return number, {name: f.read() for name, f in files.items()}
    finally:
        for f in files.values():
            f.close()
