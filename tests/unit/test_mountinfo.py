"""Reading /proc/self/mountinfo: a mount point's path with the kernel's escapes undone."""

from __future__ import annotations

from distorefs.daemon import mountinfo_path


def test_mountinfo_escapes_of_space_tab_newline_and_backslash_are_undone() -> None:
    assert mountinfo_path("/mnt/distore") == "/mnt/distore"
    assert mountinfo_path(r"/a\040b\011c\012d\134e") == "/a b\tc\nd\\e"
    # a backslash in the name comes as \134: what follows it is the name's, not an escape
    assert mountinfo_path(r"/x\134040") == "/x\\040"
