"""Huge pages for the shared memory that the daemon and its samplers both map (replay
arenas, stores/replay/mirror.py).

Copying items out of a shared-memory mapping made of 4 KiB pages ran 25-30% slower here
than out of numpy's own arrays (110 KB rows, 32 at a time), which numpy backs with 2 MiB
pages: it asks for them with madvise for big arrays, and this kernel's
`transparent_hugepage/enabled` is `madvise`. Shared memory gets huge pages only where
`transparent_hugepage/shmem_enabled` allows them: `advise` honours the same madvise on
both sides' mappings, `within_size` and `always` need none; Debian's default is `never`.
The daemon never changes that setting (it is the host's: docs/operations.md). It asks on
every arena mapping, in the daemon and in the client, which costs nothing where the
answer is no.
"""

from __future__ import annotations

import mmap
import re

SHMEM_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# settings under which a mapping that asked gets huge pages
SHMEM_HUGE = frozenset({"advise", "within_size", "always", "force"})


def advise(region: mmap.mmap) -> None:
    """Ask for huge pages on this mapping (ignored by a kernel that has none)."""
    madv_hugepage = getattr(mmap, "MADV_HUGEPAGE", None)
    if madv_hugepage is None:
        return
    try:
        region.madvise(madv_hugepage)
    except OSError:  # EINVAL: a kernel built without transparent huge pages
        pass


def shmem_setting() -> str:
    """The selected word of `shmem_enabled` ("never" where the kernel has no such file)."""
    try:
        with open(SHMEM_SETTING, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "never"
    found = re.search(r"\[([\w+-]+)\]", text)
    return found.group(1) if found else "never"


def shmem_huge() -> bool:
    """Whether an arena mapping that asks gets huge pages on this host now."""
    return shmem_setting() in SHMEM_HUGE
