"""The byte formats of a buffer's files: what `append` and `priority` take, what `sample`
returns. Pure functions and small incremental parsers; docs/formats.md has the layouts.

- Schema buffers take raw records of the schema's itemsize, or one `.npy` of the schema's
  structured dtype. `sample` returns a `.npy` of the schema's fields plus `_index`
  (int64) and `_weight` (float32).
- Blob buffers take one item per open, or a framed stream: the 8-byte magic `DSITEMS1`,
  then per item a little-endian u64 length and the bytes. `sample` returns the framed
  batch: magic `DSBATCH1`, u32 count, u64 total bytes of the batch, then per item
  `<q index><f weight><Q length>` and the bytes.
- `priority` takes text lines `index priority`, or a `.npy` of a structured array with
  fields (index int64, priority float64), or an (N, 2) numeric array.
"""

from __future__ import annotations

import ast
import bisect
import functools
import io
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distorefs.compiled import Kernels
from distorefs.errors import InvalidArgument
from distorefs.memory import unzeroed

NPY_MAGIC = b"\x93NUMPY"
ITEMS_MAGIC = b"DSITEMS1"
BATCH_MAGIC = b"DSBATCH1"
BATCH_HEAD = struct.Struct("<8sIQ")  # magic, item count, total batch bytes (header included)
BATCH_ITEM = struct.Struct("<qfQ")
FRAME = struct.Struct("<Q")
(ITEMS_MAGIC_WORD,) = FRAME.unpack(ITEMS_MAGIC)  # the magic read as a length (past MAX_ITEM_BYTES)
MAX_ITEM_BYTES = 64 * 1024 * 1024
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


PAIRS = Kernels("distorefs.stores.replay.pairs_jit", "DISTOREFS_PAIRS", "numpy")  # whole_indices, set_pairs


def load_compiled() -> bool:
    """Load the compiled priority pairs (pairs_jit.py); until then, or without numba, numpy's."""
    return PAIRS.load()


MAX_NPY_HEADER_BYTES = 64 * 1024
MAX_NPY_DATA_BYTES = 1 << 40


@dataclass(frozen=True)
class NpyHeader:
    """A validated .npy header: a dtype without objects, a shape of sane sizes."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int  # where the array's bytes start

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def data_bytes(self) -> int:
        return self.count * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.data_bytes


def npy_dtype(descr: object) -> np.dtype[Any]:
    """The dtype a .npy header's `descr` names; EINVAL for anything numpy would refuse
    or that holds Python objects (never unpickled here)."""
    if not isinstance(descr, (str, list)):
        raise InvalidArgument(f".npy header: descr must be a string or a list, got {type(descr).__name__}")
    try:
        dtype = np.lib.format.descr_to_dtype(descr)  # type: ignore[arg-type]  # str is accepted too
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError):
        raise InvalidArgument(".npy header: descr does not name a numpy dtype") from None
    if dtype.hasobject:
        raise InvalidArgument(".npy header: object dtypes are not accepted")
    return dtype


def npy_header(buf: bytes | bytearray | memoryview) -> NpyHeader | None:
    """Parse and validate a .npy header if all of it is in `buf`, else None. EINVAL for a
    malformed header, a bad dtype or shape, or an array of more than 1 TiB."""
    if len(buf) < 10:
        return None
    major = buf[6]
    if major == 1:
        size_len, fmt = 2, "<H"
    elif major in (2, 3):
        size_len, fmt = 4, "<I"
    else:
        raise InvalidArgument(f"unsupported .npy version {major}")
    if len(buf) < 8 + size_len:
        return None
    (header_len,) = struct.unpack(fmt, bytes(buf[8 : 8 + size_len]))
    if header_len > MAX_NPY_HEADER_BYTES:
        raise InvalidArgument(f".npy header of {header_len} bytes: at most {MAX_NPY_HEADER_BYTES} accepted")
    start = 8 + size_len
    if len(buf) < start + header_len:
        return None
    return _parse_npy_header(bytes(buf[start : start + header_len]), start + header_len)


@functools.lru_cache(maxsize=256)
def _parse_npy_header(raw: bytes, data_offset: int) -> NpyHeader:
    """The checks of `npy_header` on the header's text; cached, since a writer sends the
    same header again and again (a learner's priority updates, an actor's appends)."""
    text = raw.decode("latin1")
    try:
        header = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise InvalidArgument("malformed .npy header") from None
    if not isinstance(header, dict) or not {"descr", "fortran_order", "shape"} <= set(header):
        raise InvalidArgument("malformed .npy header")
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        raise InvalidArgument(".npy header: shape must be a tuple of integers")
    if any(n < 0 for n in shape) or len(shape) > 32:
        raise InvalidArgument(".npy header: shape must have at most 32 non-negative sizes")
    if not isinstance(header["fortran_order"], bool):
        raise InvalidArgument(".npy header: fortran_order must be True or False")
    parsed = NpyHeader(npy_dtype(header["descr"]), shape, header["fortran_order"], data_offset)
    if parsed.data_bytes > MAX_NPY_DATA_BYTES:
        raise InvalidArgument(f".npy header: an array of {parsed.data_bytes} bytes is more than accepted")
    return parsed


class _Stream:
    """What both `append` streams share: writes in order, bytes pending, a leading magic."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self.offset = 0

    def _advance(self, offset: int, data: bytes | memoryview) -> None:
        if offset != self.offset:
            raise InvalidArgument(f"append is a stream: write at offset {offset}, expected {self.offset}")
        self.offset += len(data)

    @property
    def pending_bytes(self) -> int:
        """What this stream holds of records or items not complete yet."""
        return len(self._pending)

    def _accept(self, offset: int, data: bytes | memoryview) -> None:
        self._advance(offset, data)
        self._pending += data

    def _starts_with(self, magic: bytes) -> bool | None:
        """Whether the pending bytes start with `magic`; None while too few to tell."""
        if len(self._pending) < len(magic) and magic.startswith(bytes(self._pending)):
            return None
        return self._pending.startswith(magic)


class RecordStream(_Stream):
    """Splits an `append` stream of a schema buffer into complete records, in order."""

    def __init__(self, dtype: np.dtype[Any]) -> None:
        super().__init__()
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        self._mode: str | None = None  # "raw" or "npy"
        self._npy_left: int | None = None

    def feed(self, offset: int, data: bytes | memoryview) -> list[bytearray]:
        """The records completed by `data`, each a new bytearray (the block tier takes it
        over without a copy). A stream is raw records, or .npy files one after another
        (each `np.save` to the same open, or each `client.append` on its kept descriptor,
        starts a new one where the last ended)."""
        self._accept(offset, data)
        records: list[bytearray] = []
        while True:
            if self._mode is None:
                is_npy = self._starts_with(NPY_MAGIC)
                if is_npy is None:
                    return records
                self._mode = "npy" if is_npy else "raw"
            if self._mode == "npy" and self._npy_left is None:
                parsed = npy_header(self._pending)
                if parsed is None:
                    return records
                if parsed.dtype != self.dtype:
                    raise InvalidArgument(f"append: .npy dtype {parsed.dtype} is not the buffer's schema {self.dtype}")
                if parsed.fortran_order or len(parsed.shape) != 1:
                    raise InvalidArgument(f"append: .npy must be a 1-d array of records, got shape {parsed.shape}")
                self._npy_left = parsed.shape[0]
                del self._pending[: parsed.data_offset]
            count = len(self._pending) // self.itemsize
            if self._npy_left is not None:
                count = min(count, self._npy_left)
                self._npy_left -= count
            size, pending = self.itemsize, self._pending
            records += [pending[i * size : (i + 1) * size] for i in range(count)]  # (a slice is a copy)
            del self._pending[: count * self.itemsize]
            if self._npy_left != 0:
                return records
            self._mode, self._npy_left = None, None  # this .npy is complete: another may follow
            if not self._pending:
                return records

    def reset(self) -> None:
        """Drop what is pending; the next write starts a new stream at the same offset."""
        self._pending.clear()
        self._mode, self._npy_left = None, None

    def finish(self) -> list[bytearray]:
        """At a close: a trailing partial record (or a short .npy) is an error and is
        dropped; otherwise nothing more to add (records were added as they arrived).
        Writes after this start a new stream (a dup'ed descriptor may still write)."""
        pending, npy_left = len(self._pending), self._npy_left
        self.reset()
        if npy_left:
            raise InvalidArgument(f"append: the .npy ended {npy_left} records short; the rest were added")
        if pending:
            raise InvalidArgument(
                f"append: {pending} trailing bytes are not a whole record of {self.itemsize} bytes; not added"
            )
        return []


class BlobStream(_Stream):
    """An `append` stream of a blob buffer: one item per open, or DSITEMS1 frames. The
    magic may come again between frames (a length prefix never equals it: it is past
    MAX_ITEM_BYTES), so each write of a whole DSITEMS1 stream stands on its own.

    Frames are parsed as they stream in: each byte is copied once, straight into its
    item's own buffer (which the block tier then takes over), whatever the write sizes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._framed: bool | None = None
        self._head = bytearray()  # a frame's length prefix, while incomplete
        self._item: bytearray | None = None  # the frame being filled
        self._filled = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes pending, and the buffer of a frame being filled (made at its length
        prefix: uninitialised memory, which the kernel supplies as its bytes arrive)."""
        return len(self._pending) + len(self._head) + (len(self._item) if self._item is not None else 0)

    def feed(self, offset: int, data: bytes | memoryview) -> list[bytearray]:
        self._advance(offset, data)
        if self._framed is False:
            self._pending += data
            if len(self._pending) > MAX_ITEM_BYTES:
                raise InvalidArgument(f"append: an item over {MAX_ITEM_BYTES} bytes")
            return []
        if self._framed is None:
            self._pending += data
            framed = self._starts_with(ITEMS_MAGIC)
            if framed is None:
                return []
            self._framed = framed
            if not framed:
                return self.feed(self.offset, b"")  # size check; the bytes stay pending
            rest, self._pending = self._pending, bytearray()
            return self._frames(memoryview(rest)[len(ITEMS_MAGIC) :])
        return self._frames(memoryview(data).cast("B"))

    def _frames(self, view: memoryview) -> list[bytearray]:
        items: list[bytearray] = []
        while len(view):
            if self._item is None and not self._head:
                view = self._whole_frames(view, items)
                if not len(view):
                    break
            if self._item is None:
                need = FRAME.size - len(self._head)
                self._head += view[:need]
                view = view[need:]
                if len(self._head) < FRAME.size:
                    break
                if self._head == ITEMS_MAGIC:  # another stream's start (a kept descriptor's next append)
                    self._head.clear()
                    continue
                (length,) = FRAME.unpack(self._head)
                self._head.clear()
                if length > MAX_ITEM_BYTES:
                    raise InvalidArgument(f"append: frame of {length} bytes exceeds {MAX_ITEM_BYTES}")
                self._item, self._filled = unzeroed(length), 0  # (every byte is written before use)
            take = min(len(self._item) - self._filled, len(view))
            self._item[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == len(self._item):
                items.append(self._item)
                self._item = None
        return items

    @staticmethod
    def _whole_frames(view: memoryview, items: list[bytearray]) -> memoryview:
        """Add the whole frames at the start of `view` to `items`; return the rest (a frame
        that continues in the next write, or one over the limit: `_frames` handles both).
        One look per frame: a megabyte of 8-byte items is 65,536 frames, which the general
        loop took 78 ms for (1.2 µs a frame) on the event loop."""
        unpack, head, size, at = FRAME.unpack_from, FRAME.size, len(view), 0
        while size - at >= head:
            (length,) = unpack(view, at)
            if length == ITEMS_MAGIC_WORD:  # another stream's start (a kept descriptor's next append)
                at += head
                continue
            end = at + head + length
            if end > size or length > MAX_ITEM_BYTES:
                break
            items.append(bytearray(view[at + head : end]))
            at = end
        return view[at:]

    def reset(self) -> None:
        """Drop what is pending; the next write starts a new item or stream."""
        self._pending = bytearray()
        self._framed = None
        self._head.clear()
        self._item = None

    def finish(self) -> list[bytearray]:
        """At a close: the single item written since the last close (unframed), or nothing
        more (framed, all complete). Writes after this start a new item or stream."""
        framed, pending, head, item, filled = self._framed, self._pending, len(self._head), self._item, self._filled
        self.reset()
        if framed:
            if item is not None:
                raise InvalidArgument(f"append: a partial frame at close ({filled} of {len(item)} bytes); not added")
            if head:
                raise InvalidArgument(f"append: a partial frame length at close ({head} of {FRAME.size} bytes)")
            return []
        if not pending:
            return []  # nothing written since the last close
        return [pending]


def frame_items(items: Sequence[bytes]) -> bytes:
    """The DSITEMS1 stream for `items` (what distorefs.client.append writes)."""
    parts = [ITEMS_MAGIC]
    for item in items:
        parts.append(FRAME.pack(len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def parse_priorities(data: bytes | bytearray) -> tuple[np.ndarray, np.ndarray] | None:
    """(indices int64, priorities float64) from a complete `priority` write, or None when
    more bytes are needed (text without its final newline, a short .npy)."""
    if data.startswith(NPY_MAGIC):
        parsed = npy_header(data)
        if parsed is None:
            return None
        if len(data) < parsed.total_bytes:
            return None
        if len(data) > parsed.total_bytes:
            raise InvalidArgument("priority: bytes after the end of the .npy")
        # bytes(): the array must not export the caller's bytearray, which is cleared
        # after this returns or raises (a traceback would keep the export alive)
        array = np.frombuffer(bytes(data), dtype=parsed.dtype, count=parsed.count, offset=parsed.data_offset)
        array = array.reshape(parsed.shape, order="F" if parsed.fortran_order else "C")
        if array.dtype.names and len(array.dtype.names) == 2 and array.ndim == 1:
            first, second = array.dtype.names
            return _pairs(array[first], array[second])
        if array.ndim == 2 and array.shape[1] == 2:
            return _pairs(array[:, 0], array[:, 1])
        raise InvalidArgument(f"priority: .npy must hold (index, priority) pairs, got {array.dtype} {array.shape}")
    if not data.endswith(b"\n"):
        return None
    indices, priorities = [], []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise InvalidArgument(f"priority line {number}: expected 'index priority', got {len(parts)} words")
        try:
            index, priority = int(parts[0]), float(parts[1])
        except ValueError:
            raise InvalidArgument(f"priority line {number}: expected 'index priority' (two numbers)") from None
        if not INT64_MIN <= index <= INT64_MAX:
            raise InvalidArgument(f"priority line {number}: the index is out of the int64 range")
        indices.append(index)
        priorities.append(priority)
    return np.array(indices, dtype=np.int64), np.array(priorities, dtype=np.float64)


def _pairs(indices: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 indices and float64 priorities from two numeric columns; EINVAL for other
    kinds, or indices that are not whole numbers in the int64 range."""
    if indices.dtype.kind not in "iuf" or priorities.dtype.kind not in "iuf":
        raise InvalidArgument(f"priority: .npy columns must be numbers, got {indices.dtype} and {priorities.dtype}")
    if indices.dtype.kind == "u" and len(indices) and int(indices.max()) > INT64_MAX:
        raise InvalidArgument("priority: an index is out of the int64 range")
    jit = PAIRS.module
    if jit is not None and indices.dtype == np.float64:  # (a .npy of float pairs: the usual update)
        whole_indices = np.empty(len(indices), np.int64)
        if jit.whole_indices(indices, whole_indices) >= 0:
            raise InvalidArgument("priority: indices must be whole numbers in the int64 range")
        return whole_indices, priorities.astype(np.float64)
    if indices.dtype.kind == "f":
        whole = np.isfinite(indices) & (indices == np.round(indices)) & (np.abs(indices) < 2.0**63)
        if not whole.all():
            raise InvalidArgument("priority: indices must be whole numbers in the int64 range")
    return indices.astype(np.int64), priorities.astype(np.float64)


def batch_length(head: bytes | bytearray | memoryview) -> int | None:
    """The total size of a batch from its first bytes (a DSBATCH1 or .npy header), or
    None when `head` is too short to tell."""
    head = bytes(head)
    if head.startswith(BATCH_MAGIC):
        if len(head) < BATCH_HEAD.size:
            return None
        return int(BATCH_HEAD.unpack_from(head)[2])
    if head.startswith(NPY_MAGIC):
        parsed = npy_header(head)
        return None if parsed is None else parsed.total_bytes
    raise ValueError(f"not a distorefs batch (starts {head[:8]!r})")


@functools.lru_cache(maxsize=64)
def batch_dtype(schema: np.dtype[Any]) -> np.dtype[Any]:
    """The schema's record followed by `_index` (int64) and `_weight` (float32), packed."""
    assert schema.names is not None
    assert schema.fields is not None
    names = list(schema.names) + ["_index", "_weight"]
    formats = [schema.fields[n][0] for n in schema.names] + [np.dtype("<i8"), np.dtype("<f4")]
    offsets = [schema.fields[n][1] for n in schema.names] + [schema.itemsize, schema.itemsize + 8]
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": schema.itemsize + 12})


@functools.lru_cache(maxsize=256)
def npy_batch_header(schema: np.dtype[Any], count: int) -> bytes:
    """The .npy header of a batch of `count` records of `schema` (cached: building one
    costs more than copying a small batch)."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        head, {"descr": np.lib.format.dtype_to_descr(batch_dtype(schema)), "fortran_order": False, "shape": (count,)}
    )
    return head.getvalue()


def npy_batch_bytes(schema: np.dtype[Any], count: int) -> int:
    """How long the .npy of a batch of `count` records is: a sample file's st_size."""
    return len(npy_batch_header(schema, count)) + count * (schema.itemsize + 12)


SCATTER_RECORD_BYTES = 4096  # records this big are served as views, not copied into one buffer
# Smaller records are copied into the batch one memcpy each from this size, which skips
# the joined copy in between (a SAC batch of 256 x 3 KB: 85 -> 46 µs alone); below it,
# a step per record costs more than the second copy (1,024 x 100 bytes: 21 against 71 µs)
RECORD_COPY_BYTES = 1024
# A run of small records is joined this many records at a time (at most about 1 MiB):
# one join holds the GIL throughout, and a batch of 500,000 records of 512 bytes joined
# whole (256 MB) held it for 0.2-0.3 s, in a worker thread (draws.encoded_batch) as on
# the event loop. (Counting each record's bytes instead cost a SAC batch 81 -> 92 µs.)
JOINED_RUN_ITEMS = 256
_TAIL = np.dtype([("index", "<i8"), ("weight", "<f4")])  # what batch_dtype adds after a record


def encode_npy_batch(
    schema: np.dtype[Any],
    payloads: Sequence[bytes | memoryview] | np.ndarray,
    indices: np.ndarray,
    weights: np.ndarray,
) -> bytearray | ScatteredBytes:
    """One `.npy` holding the batch. Small records are copied into one buffer (cheaper
    than many pieces); big ones stay views of the items with each record's 12-byte
    `_index`/`_weight` between them, as the blob format does, so the daemon copies
    nothing before the reply. `payloads` may be the records as one (count, itemsize)
    uint8 array (a buffer's rows, stores/replay/rows.py)."""
    count = len(payloads)
    header = npy_batch_header(schema, count)
    if schema.itemsize >= SCATTER_RECORD_BYTES:
        tails = np.empty(count, dtype=_TAIL)
        tails["index"] = indices
        tails["weight"] = weights
        packed = memoryview(tails.tobytes())
        pieces: list[bytes | memoryview] = [header]
        for k, payload in enumerate(payloads):
            pieces.append(payload)
            pieces.append(packed[_TAIL.itemsize * k : _TAIL.itemsize * (k + 1)])
        return ScatteredBytes(pieces)
    dtype = batch_dtype(schema)
    # unzeroed: every byte is written below (the header, then each row's record, `_index`
    # and `_weight`, packed); zeroing 770 KB first cost a SAC batch 30-60 µs of memset
    out = unzeroed(len(header) + count * dtype.itemsize)
    out[: len(header)] = header
    rows = np.frombuffer(out, dtype=np.uint8, offset=len(header)).reshape(count, dtype.itemsize)
    if isinstance(payloads, np.ndarray):
        rows[:, : schema.itemsize] = payloads
    elif schema.itemsize >= RECORD_COPY_BYTES:  # one memcpy a record, straight into its row
        flat, at, size = memoryview(out), len(header), schema.itemsize
        for payload in payloads:
            flat[at : at + size] = payload  # (a payload of another length: ValueError)
            at += dtype.itemsize
    elif count:  # tiny records: one joined copy and one strided copy, not a step per record
        joined = b"".join(payloads)
        rows[:, : schema.itemsize] = np.frombuffer(joined, dtype=np.uint8).reshape(count, schema.itemsize)
    records = np.frombuffer(out, dtype=dtype, offset=len(header))
    records["_index"] = indices
    records["_weight"] = weights
    return out


class ScatteredBytes:
    """Bytes kept as a list of pieces (headers and item views), read by range without
    gathering them first: a read inside one piece is a zero-copy memoryview."""

    def __init__(self, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        self._pieces = [memoryview(p).cast("B") for p in pieces]
        self._starts: list[int] = np.cumsum([0] + [len(p) for p in self._pieces]).tolist()
        self.length: int = self._starts[-1]

    def __len__(self) -> int:
        return self.length

    def pieces(self) -> list[memoryview]:
        """The pieces in order (to copy them somewhere without joining them first)."""
        return list(self._pieces)

    def parts(self, offset: int, size: int) -> list[memoryview]:
        """The bytes from `offset` (at most `size`) as views of the pieces they span, in
        order, not joined: none empty, none past the end."""
        end = min(offset + size, self.length)
        if offset >= end:
            return []
        # bisect on the list: numpy's searchsorted made an array of the whole list at
        # every call (9 µs a READ for 65 pieces, 26 for 513, 14 ms for 400,001)
        first = bisect.bisect_right(self._starts, offset) - 1
        inner = offset - self._starts[first]
        piece = self._pieces[first]
        if inner + (end - offset) <= len(piece):
            return [piece[inner : inner + end - offset]]
        last = bisect.bisect_left(self._starts, end) - 1
        between = [part for part in self._pieces[first + 1 : last] if len(part)]
        return [piece[inner:], *between, self._pieces[last][: end - self._starts[last]]]

    def tobytes(self) -> bytes:
        return b"".join(self._pieces)


def joined(parts: list[memoryview], into: bytearray | None = None) -> memoryview | bytes:
    """`parts` (ScatteredBytes.parts) as one buffer: the part itself when there is one,
    else joined into `into` where it is big enough (a buffer the caller keeps for its
    next read: no new memory per read), and into new memory otherwise."""
    if not parts:
        return b""
    if len(parts) == 1:
        return parts[0]
    total = sum(len(part) for part in parts)
    if into is None or len(into) < total:
        return b"".join(parts)
    view, filled = memoryview(into), 0
    for part in parts:
        view[filled : filled + len(part)] = part
        filled += len(part)
    return view[:filled]


def encode_blob_batch(
    payloads: Sequence[bytes | memoryview], indices: np.ndarray, weights: np.ndarray
) -> ScatteredBytes:
    """The DSBATCH1 framed batch: views of the big items (SCATTER_RECORD_BYTES and up: no
    copy), and between them the item headers and small items joined. A view per small
    item cost more than copying it: a batch of 513 pieces took 153 µs to make, one of
    400,001 (200,000 items of 8 bytes) 0.16 s."""
    total = BATCH_HEAD.size + sum(BATCH_ITEM.size + len(p) for p in payloads)
    pieces: list[bytes | memoryview] = []
    run: list[bytes | memoryview] = [BATCH_HEAD.pack(BATCH_MAGIC, len(payloads), total)]
    index_list, weight_list = indices.tolist(), weights.tolist()
    for start in range(0, len(payloads), JOINED_RUN_ITEMS):
        end = start + JOINED_RUN_ITEMS
        items = zip(payloads[start:end], index_list[start:end], weight_list[start:end], strict=True)
        for payload, index, weight in items:
            run.append(BATCH_ITEM.pack(index, weight, len(payload)))
            if len(payload) < SCATTER_RECORD_BYTES:
                run.append(payload)
                continue
            pieces.append(b"".join(run))
            pieces.append(payload)
            run = []
        if run:
            pieces.append(b"".join(run))
            run = []
    if run:  # (no items: the head alone)
        pieces.append(b"".join(run))
    return ScatteredBytes(pieces)


def decode_blob_batch(
    data: bytes | bytearray | memoryview, copy: bool = True
) -> list[tuple[int, float, bytes | memoryview]]:
    """(index, weight, item) for each item of a DSBATCH1 batch; with copy=False the items
    are memoryviews into `data` (no copy)."""
    view = memoryview(data)
    magic, count, _total = BATCH_HEAD.unpack_from(view)
    if magic != BATCH_MAGIC:
        raise ValueError(f"not a distorefs batch (magic {bytes(magic)!r})")
    at = BATCH_HEAD.size
    out = []
    for _ in range(count):
        index, weight, length = BATCH_ITEM.unpack_from(view, at)
        at += BATCH_ITEM.size
        item = view[at : at + length]
        out.append((index, weight, bytes(item) if copy else item))
        at += length
    return out
