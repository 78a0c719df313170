"""Small shared types: typed ids, the key that names a block in the tiers, writable buffers."""

from __future__ import annotations

from typing import NamedTuple, NewType, TypeAlias

InodeId = NewType("InodeId", int)
FileHandle = NewType("FileHandle", int)

# what a gather or a batch layout writes into (a stream's batch: a numpy array's memoryview)
Writable: TypeAlias = bytearray | memoryview


class BlockKey(NamedTuple):
    """Names one block in the tiers: an owner (a file's inode, later a buffer) and a block number."""

    owner: int
    number: int


class LogLocation(NamedTuple):
    """Where one record lives in the segment log: segment id, header offset, payload length."""

    segment: int
    offset: int
    length: int
