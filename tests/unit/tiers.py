"""Tier set-up shared by the store unit tests: a log, a metadata database, a block store."""

from __future__ import annotations

from pathlib import Path

from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.dram import DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import NvmeLog


def open_tiers(path: Path, block_bytes: int, dram_blocks: int) -> tuple[BlockStore, MetaDb]:
    log = NvmeLog.open(str(path / "log"))
    meta = MetaDb.open(str(path / "meta.sqlite"))
    return BlockStore(log, DramCache(dram_blocks * block_bytes), meta, block_bytes=block_bytes), meta
