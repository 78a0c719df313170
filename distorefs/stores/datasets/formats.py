"""The byte formats of a dataset: its record index, what `order` takes, what `stream` returns.

Pure functions and an incremental parser; docs/formats.md has the layouts.

- Records are stored back to back in one byte stream per dataset. The index gives each
  record its offset, length and crc32c (INDEX_DTYPE, 16 bytes a record).
- `order` takes a `.npy` of integer indices, text (indices separated by white space or
  newlines), or one line `shuffle SEED` / `sequential`.
- `stream` returns the same formats as a buffer's `sample`: a `.npy` of the schema's
  records plus `_index` and `_weight` (1.0), or the framed DSBATCH1 batch for blob
  datasets. One stream is one batch holding the whole epoch (or a rank's share of it).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from distorefs.errors import InvalidArgument, describe
from distorefs.stores.replay.formats import BATCH_HEAD, BATCH_ITEM, BATCH_MAGIC, NPY_MAGIC, batch_dtype, npy_header
from distorefs.types import Writable

INDEX_DTYPE = np.dtype([("offset", "<u8"), ("length", "<u4"), ("crc", "<u4")])
MAX_RECORD_BYTES = 64 * 1024 * 1024
MAX_ORDER_TEXT_BYTES = 1 << 30
# An order holds at most this many indices a record (or ORDER_MIN_LENGTH in all): a
# stream's epoch may repeat records, but what a write to `order` makes the daemon hold
# is bounded by the dataset, not by the writer (a .npy header may announce any length).
ORDER_REPEATS = 16
ORDER_MIN_LENGTH = 1 << 20


@dataclass(frozen=True)
class OrderSpec:
    """How the next epoch's order is given: `sequential` (0..count-1), `shuffle` (a
    permutation of `count` records drawn from `seed`), or `explicit` (`length` indices
    stored in the dataset's order slot `slot`)."""

    kind: str = "sequential"
    seed: int = 0
    count: int = 0
    length: int = 0
    slot: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "seed": self.seed, "count": self.count, "length": self.length, "slot": self.slot}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> OrderSpec:
        return cls(**raw)

    def describe(self) -> str:
        if self.kind == "shuffle":
            return f"shuffle {self.seed} ({self.count} records)"
        if self.kind == "explicit":
            return f"explicit ({self.length} indices)"
        return "sequential"


SEED_DIGITS = 40  # a shuffle's seed: 128 bits and more; Python parses no more than 4,300 digits


def shuffled(seed: int, count: int) -> np.ndarray:
    """The permutation `shuffle SEED` stands for: the same on every node and every run."""
    return np.random.default_rng(seed).permutation(count).astype(np.int64)


class OrderInput:
    """What is written to `order` during one open, checked as it arrives.

    A `.npy` is complete when its last byte arrives and applies then (`feed` returns it).
    Text applies at close (`finish`), but every complete line is checked as it arrives, so
    a bad index fails the write that carried it (a shell's `echo ... > order` never sees
    errors at close). Indices must be in [0, count).
    """

    def __init__(self, name: str, count: int) -> None:
        self._name = name
        self._count = count
        self._pending = bytearray()
        self._npy: bool | None = None
        self._parts: list[np.ndarray] = []
        self._word: tuple[str, int] | None = None
        self._text_bytes = 0
        self._length = 0  # text indices taken so far
        self.max_length = max(ORDER_REPEATS * count, ORDER_MIN_LENGTH)

    @property
    def held_bytes(self) -> int:
        """What this input holds: bytes not parsed yet, and the text indices taken."""
        return len(self._pending) + 8 * self._length

    def _bad(self, why: str) -> InvalidArgument:
        self.reset()
        return InvalidArgument(f"datasets/{self._name}/order: {why}; the order is unchanged")

    def reset(self) -> None:
        self._pending.clear()
        self._npy, self._parts, self._word, self._text_bytes, self._length = None, [], None, 0, 0

    def feed(self, data: bytes) -> tuple[OrderSpec, np.ndarray | None] | None:
        self._pending += data
        if self._npy is None:
            if len(self._pending) < len(NPY_MAGIC) and NPY_MAGIC.startswith(bytes(self._pending)):
                return None
            self._npy = self._pending.startswith(NPY_MAGIC)
        if self._npy:
            return self._feed_npy()
        self._text_bytes += len(data)
        if self._text_bytes > MAX_ORDER_TEXT_BYTES:
            raise self._bad(f"text over {MAX_ORDER_TEXT_BYTES} bytes; send a .npy")
        cut = self._pending.rfind(b"\n") + 1
        if cut:
            lines = bytes(self._pending[:cut])
            del self._pending[:cut]
            self._take_text(lines)
        return None

    def _feed_npy(self) -> tuple[OrderSpec, np.ndarray | None] | None:
        try:
            parsed = npy_header(self._pending)
        except InvalidArgument as exc:
            raise self._bad(exc.message) from None
        if parsed is None:
            return None
        if parsed.dtype.kind not in "iu" or parsed.fortran_order or len(parsed.shape) != 1:
            raise self._bad(f"a .npy order must be a 1-d array of integers, got {parsed.dtype} {parsed.shape}")
        if parsed.shape[0] > self.max_length:
            raise self._bad(self._too_long(parsed.shape[0]))
        need = parsed.total_bytes
        if len(self._pending) < need:
            return None
        if len(self._pending) > need:
            raise self._bad("bytes after the end of the .npy")
        array = np.load(io.BytesIO(bytes(self._pending)), allow_pickle=False).astype(np.int64, copy=False)
        self.reset()
        return self._explicit(array)

    def _take_text(self, text: bytes) -> None:
        words = text.split()
        if not words:
            return
        if words[0] in (b"shuffle", b"sequential") or self._word is not None:
            if self._word is not None or self._parts:
                raise self._bad("`shuffle SEED` and `sequential` must be the whole input")
            if words[0] == b"sequential" and len(words) == 1:
                self._word = ("sequential", 0)
            elif words[0] == b"shuffle" and len(words) == 2 and words[1].isdigit() and len(words[1]) <= SEED_DIGITS:
                self._word = ("shuffle", int(words[1]))
            else:
                raise self._bad(
                    f"expected `shuffle SEED` (a non-negative integer of up to {SEED_DIGITS} digits) or"
                    f" `sequential`, got {describe(text)}"
                )
            return
        try:
            indices = np.array(words, dtype=np.int64)
        except (ValueError, OverflowError):
            bad = next((w for w in words if not w.lstrip(b"-").isdigit()), words[0])
            raise self._bad(f"not an index: {bad[:40]!r}") from None
        self._check(indices)
        self._length += len(indices)
        if self._length > self.max_length:
            raise self._bad(self._too_long(self._length))
        self._parts.append(indices)

    def _too_long(self, length: int) -> str:
        return (
            f"an order of {length} indices or more is past its bound of {self.max_length}"
            f" ({ORDER_REPEATS} a record, or {ORDER_MIN_LENGTH})"
        )

    def _check(self, indices: np.ndarray) -> None:
        if len(indices) and (indices.min() < 0 or indices.max() >= self._count):
            bad = indices[(indices < 0) | (indices >= self._count)][0]
            raise self._bad(f"index {bad} is out of range: the dataset has {self._count} records")

    def _explicit(self, indices: np.ndarray) -> tuple[OrderSpec, np.ndarray]:
        self._check(indices)
        if not len(indices):
            raise self._bad("the order is empty")
        return OrderSpec("explicit", length=len(indices)), indices

    def finish(self) -> tuple[OrderSpec, np.ndarray | None] | None:
        """At a close: the text order written in this open, or None when nothing was."""
        if self._npy:
            if self._pending:
                raise self._bad(f"the .npy ended early ({len(self._pending)} bytes)")
            return None
        if self._pending:
            tail = bytes(self._pending)
            self._pending.clear()
            self._take_text(tail)
        word, parts = self._word, self._parts
        self.reset()
        if word is not None:
            kind, seed = word
            if kind == "sequential":
                return OrderSpec("sequential"), None
            return OrderSpec("shuffle", seed=seed, count=self._count), None
        if not parts:
            return None
        return self._explicit(np.concatenate(parts))


# --- stream layout ------------------------------------------------------------------------


_BATCH_ITEM_DTYPE = np.dtype([("index", "<i8"), ("weight", "<f4"), ("length", "<u8")])
assert _BATCH_ITEM_DTYPE.itemsize == BATCH_ITEM.size
_ROW_SUFFIX_DTYPE = np.dtype([("index", "<i8"), ("weight", "<f4")])  # a schema row's `_index`, `_weight`


def npy_header_bytes(dtype: np.dtype[Any], count: int) -> bytes:
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        head, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
    )
    return head.getvalue()


class StreamLayout:
    """Where each record of a stream sits in the stream's bytes.

    Schema datasets: a `.npy` header, then per record the record's bytes, `_index` (int64)
    and `_weight` (float32, 1.0). Blob datasets: the DSBATCH1 header, then per record
    `<q index><f 1.0><Q length>` and the bytes. `ends[p]` is where position p's bytes end.
    """

    def __init__(self, schema: np.dtype[Any] | None, indices: np.ndarray, lengths: np.ndarray) -> None:
        """`indices`: the records in stream order (a view of the dataset's order is kept as
        it is, not copied); `lengths`: their lengths (not kept: `ends` says them)."""
        self.indices = indices
        count = len(indices)
        if schema is not None:
            self.prefix = 0
            self.suffix = 12
            self.header = npy_header_bytes(batch_dtype(schema), count)
        else:
            self.prefix = BATCH_ITEM.size
            self.suffix = 0
            total = BATCH_HEAD.size + int(lengths.sum()) + count * BATCH_ITEM.size
            self.header = BATCH_HEAD.pack(BATCH_MAGIC, count, total)
        # the one array a layout holds per position (8 bytes): where each position ends
        self.ends = np.cumsum(lengths, dtype=np.int64)
        self.ends += np.arange(1, count + 1, dtype=np.int64) * (self.prefix + self.suffix) + len(self.header)
        self.total = int(self.ends[-1]) if count else len(self.header)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def nbytes(self) -> int:
        """Memory the layout holds of its own (its indices are a view of the order)."""
        own = self.indices.nbytes if self.indices.base is None else 0
        return self.ends.nbytes + own + len(self.header)

    def start(self, position: int) -> int:
        return int(self.ends[position - 1]) if position else len(self.header)

    def lengths(self, first: int, last: int) -> np.ndarray:
        """The record lengths of positions [first, last) (int64)."""
        if first:
            out = np.diff(self.ends[first - 1 : last])
        else:
            out = np.diff(self.ends[:last], prepend=np.int64(len(self.header)))
        out -= self.prefix + self.suffix
        return out

    def position_at(self, offset: int) -> int:
        """The position whose bytes hold `offset` (len(self) past the end)."""
        return int(np.searchsorted(self.ends, offset, side="right"))

    def affixes(self, first: int, last: int) -> np.ndarray:
        """The bytes the layout adds to positions [first, last), back to back: each blob
        item's `<q index><f 1.0><Q length>` prefix, or each schema row's `_index` (int64)
        and `_weight` (float32, 1.0) suffix; a (last - first, prefix + suffix) uint8 array.
        All at once: 3,000 pack_into calls a batch cost a few ms on the event loop."""
        items = np.empty(last - first, dtype=_BATCH_ITEM_DTYPE if self.prefix else _ROW_SUFFIX_DTYPE)
        items["index"] = self.indices[first:last]
        items["weight"] = 1.0
        if self.prefix:
            items["length"] = self.lengths(first, last)
        return items.view(np.uint8).reshape(last - first, self.prefix + self.suffix)

    def frame(self, out: Writable, first: int, last: int) -> np.ndarray:
        """Lay out positions [first, last) in `out` (sized for them) with their prefixes or
        suffixes written; returns where each record's own bytes go in `out`."""
        base = self.start(first)
        starts: np.ndarray = self.ends[first:last] - base - self.lengths(first, last) - self.suffix
        affixes = self.affixes(first, last)
        if self.prefix:
            where = (starts - self.prefix)[:, None] + np.arange(self.prefix)
            np.frombuffer(out, dtype=np.uint8)[where] = affixes
        else:
            rows = np.frombuffer(out, dtype=np.uint8).reshape(last - first, -1)
            rows[:, -self.suffix :] = affixes
        return starts
