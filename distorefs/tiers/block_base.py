"""BlockTierBase: what the block tier's role modules share.

BlockStore (tiers/blocks.py) is one object made of roles, each in a module of its own:
byte ranges (tiers/byte_ranges.py), write-back (tiers/writeback.py) and compaction
(tiers/compaction.py). This base names the state they all read and the block operations
that BlockStore itself implements, so each role module type-checks on its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from distorefs.tiers.block_index import BlockIndex
from distorefs.tiers.dram import Block, DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import NvmeLog
from distorefs.types import BlockKey, LogLocation


class BlockTierBase:
    """State shared by the block tier's roles; BlockStore sets it and implements the methods."""

    block_bytes: int
    _log: NvmeLog
    _dram: DramCache
    _meta: MetaDb
    _index: BlockIndex
    _io_limiter: trio.CapacityLimiter

    async def get(self, key: BlockKey, transient: bool = False) -> Block | None:
        raise NotImplementedError

    async def put(self, key: BlockKey, data: bytes | bytearray | memoryview) -> None:
        raise NotImplementedError

    async def write(self, key: BlockKey, offset: int, data: bytes | memoryview) -> None:
        raise NotImplementedError

    async def write_whole(self, key: BlockKey, data: bytes) -> None:
        raise NotImplementedError

    async def truncate(self, key: BlockKey, length: int) -> None:
        raise NotImplementedError

    def delete(self, key: BlockKey) -> None:
        raise NotImplementedError

    def prefetch(self, keys: Iterable[BlockKey]) -> None:
        raise NotImplementedError

    def owner_keys(self, owner: int) -> list[BlockKey]:
        raise NotImplementedError

    def _set_location(self, key: BlockKey, location: LogLocation, stage: bool = True) -> None:
        raise NotImplementedError
