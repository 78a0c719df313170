"""distorefs.client: helpers for replay buffers that use only the files.

Nothing here talks to the daemon other than through open/read/write on the mount, so a
user of another language can do the same by following docs/formats.md.

Examples:
    >>> from distorefs import client
    >>> client.append("/mnt/distore/buffers/dqn", [pickle.dumps(t) for t in transitions])
    >>> batch = client.sample("/mnt/distore/buffers/dqn")          # blob buffer
    >>> [(index, weight, item), ...] = batch
    >>> client.update_priorities("/mnt/distore/buffers/dqn", indices, td_errors)
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from distorefs.stores.replay.formats import NPY_MAGIC, decode_blob_batch, frame_items


def append(buffer_dir: str | os.PathLike[str], items: Sequence[bytes] | np.ndarray) -> None:
    """Append items in one open: a structured numpy array to a schema buffer (as .npy),
    or byte strings to a blob buffer (as a DSITEMS1 stream). Returns once acknowledged."""
    path = os.path.join(buffer_dir, "append")
    if isinstance(items, np.ndarray):
        out = io.BytesIO()
        np.save(out, items, allow_pickle=False)
        data = out.getvalue()
    else:
        data = frame_items(items)
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data)
        while view:
            written = f.write(view)
            assert written is not None
            view = view[written:]


def read_all(path: str | os.PathLike[str]) -> bytes:
    """Read a control file to EOF (they have size 0, so read until an empty read).

    Raises OSError with EAGAIN when the daemon could not serve it in time (os.read, not
    a file object: FileIO.read returns None on EAGAIN, which looks like EOF).
    """
    chunks: list[bytes] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def sample(buffer_dir: str | os.PathLike[str], batch_size: int | None = None) -> Any:
    """Draw one batch: a numpy structured array (schema buffers, with `_index` and
    `_weight`), or a list of (index, weight, item bytes) (blob buffers)."""
    name = "sample" if batch_size is None else f"sample.{batch_size}"
    data = read_all(os.path.join(buffer_dir, name))
    if data.startswith(NPY_MAGIC):
        return np.load(io.BytesIO(data), allow_pickle=False)
    return decode_blob_batch(data)


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
