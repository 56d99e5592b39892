"""Where weights live: buffers the kernel may back with 2 MB pages.

A decode step streams every weight once, a matrix-vector product per matrix, so a token's time is
how fast one core reads memory. With 4 KB pages that read walks the page tables every 4 KB; with
2 MB pages 512 times less often. One core multiplying 100 SmolLM2-sized matrices (354 MB) read
12.3-13.3 GB/s from 4 KB pages and 13.9-15.1 from 2 MB ones; a decoded token took 40.1 ms against
43.5 (`git log -p docs/decisions.md`). Linux gives anonymous memory 2 MB pages where the
region asks for them (madvise MADV_HUGEPAGE: transparent huge pages in "madvise" mode, the
usual default) or always; elsewhere the buffer is plain memory and everything works as before.

Only whole 2 MB pages inside a buffer are asked for: a buffer's tail stays in 4 KB pages, so a
buffer never holds more memory than its bytes (rounded to 4 KB).
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's transparent huge page
DATA_ALIGN = 64  # bytes: where each tensor's data starts (packed, or in a shard), for SIMD kernels


def weight_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` zeroed bytes (uint8), touched, starting on a 2 MB boundary, its whole 2 MB pages
    asked of the kernel as huge pages."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` open while it lives
    start = -whole.data_ptr() % HUGE_PAGE
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if huge and advice is not None:
        try:
            area.madvise(advice, start, huge)
        except OSError:  # EINVAL: a kernel built without transparent huge pages
            pass
    buffer = whole[start : start + nbytes]  # zeros: fresh anonymous memory
    buffer[:: mmap.PAGESIZE].zero_()  # touched now: the memory is taken before the first token
    return buffer


def pack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `tensors` in one `weight_buffer`, each starting on a DATA_ALIGN boundary."""
    offsets, end = {}, 0
    for name, t in tensors.items():
        offsets[name] = end
        end += -(-t.numel() * t.element_size() // DATA_ALIGN) * DATA_ALIGN
    buffer = weight_buffer(max(end, 1))
    out = {}
    for name, t in tensors.items():
        raw = buffer[offsets[name] : offsets[name] + t.numel() * t.element_size()]
        out[name] = raw.view(t.dtype).view(t.shape)
        out[name].copy_(t)
    return out
