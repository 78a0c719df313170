"""Every range of owner ids and inode numbers, in one place.

Two number spaces meet in the daemon:

Owner ids name whose blocks a block key holds in the tiers (`BlockKey.owner`):

    0                             the block tier's row notes (tiers/writeback.py), never a block
    [1, 2**46)                    tree files: the owner is the file's inode number
    [DATASET_OWNER_BASE, +2**46)  datasets, OWNERS_PER_DATASET consecutive owners each
    [WEIGHT_OWNER_BASE, +2**47)   weight files: one owner per published (or pending) version
    [BUFFER_OWNER_BASE, ...)      replay buffers: one owner per buffer, its key number is the item index

Inode numbers are what the kernel sees:

    [1, VIRTUAL_BASE)             the POSIX tree (stores/files.py hands them out from 2 up)
    [VIRTUAL_BASE, RECORD_BASE)   registered virtual nodes (control files, kind directories)
    [RECORD_BASE, ITEM_BASE)      dataset records, computed: RECORD_BASE | dataset number << INDEX_BITS | index
    [ITEM_BASE, ...)              buffer items, computed: ITEM_BASE | buffer number << INDEX_BITS | index

Computed inodes cost no memory, so a buffer of a million items lists without a node each.
"""

from __future__ import annotations

ROW_NOTES_OWNER = 0
DATASET_OWNER_BASE = 1 << 46
OWNERS_PER_DATASET = 4
WEIGHT_OWNER_BASE = 1 << 47
BUFFER_OWNER_BASE = 1 << 48

VIRTUAL_BASE = 1 << 62
RECORD_BASE = VIRTUAL_BASE | (1 << 60)
RECORD_SPAN = 1 << 59
ITEM_BASE = VIRTUAL_BASE | (1 << 61)
ITEM_SPAN = 1 << 60
INDEX_BITS = 36  # a buffer item's or dataset record's index within its computed inode


def is_dataset_owner(owner: int) -> bool:
    return DATASET_OWNER_BASE <= owner < WEIGHT_OWNER_BASE


def is_weight_owner(owner: int) -> bool:
    return WEIGHT_OWNER_BASE <= owner < BUFFER_OWNER_BASE
