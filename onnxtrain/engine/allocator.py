"""Keep freed tensor memory in the process, so the next step reuses it instead of faulting in fresh pages.

glibc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB at first) with a fresh ``mmap`` and returns them
to the kernel on ``free``; the heap's top is also trimmed back to the kernel. A plan frees each activation
after its last use and allocates it again on the next run, so every run page-faults (and the kernel zeroes)
all of its large tensors: on the exported transformer that was about half the forward time. Raising the
thresholds once makes those blocks come from, and go back to, the heap; the peak of live memory (and so the
peak RSS) is unchanged, only the pages are kept between runs.

``ONNXTRAIN_ALLOCATOR=system`` leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 << 20  # larger blocks still get their own mapping
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap's top before it goes back to the kernel
TOP_PAD = 16 << 20  # extra heap grown at once, fewer brk calls

@functools.cache
def tune_allocator() -> bool:
    """Apply the thresholds once per process (glibc only); True when they are in effect."""
    if os.environ.get("ONNXTRAIN_ALLOCATOR", "").lower() == "system" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(
            libc.mallopt(param, value) == 1
            for param, value in (
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (M_TOP_PAD, TOP_PAD),
            )
        )
    except (OSError, AttributeError):
        return False


def release_free_memory() -> bool:
    """Give the heap's free pages back to the kernel (glibc only; True when done). For after a one-off
    peak, such as loading a large model whose serialized and parsed copies are gone once onnxruntime holds
    its weights: glibc keeps such blocks freed in the middle of the heap (192 MiB of weights: 388 -> 274 MiB
    of RSS, in 12 ms)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
