"""Sort: group routing slots by local expert into padded row segments (kernels_cuda/sort.cu)."""

from __future__ import annotations

import numpy as np
import torch

from .codes import SORT_MAX_EXPERTS, SORT_THREADS
from .loader import launch, ptr


def sort_routing(
    ids_flat: torch.Tensor,
    top_k: int,
    local_start: int,
    num_local: int,
    align: int,
    offsets: torch.Tensor,
    slot_to_row: torch.Tensor,
    row_to_slot: torch.Tensor,
    row_expert: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Group the B*k routing slots by local expert into segments padded to ``align`` rows.

    ids_flat int32 [B*k] (slot t*k+s); a slot is masked unless its id is in [local_start, local_start + num_local).
    Outputs (int32): offsets [num_local + 1] segment starts (offsets[num_local] = rows used), slot_to_row [B*k]
    (-1 masked), row_to_slot [R] and row_expert [R] for R = row_capacity = row_to_slot.numel() (every entry
    written: -1 for padding rows and rows past the end; row_expert is the segment's expert for padding rows
    inside a segment), counts [num_local] slots per local expert before padding. Rows within a segment
    follow slot order. R must cover the worst case
    roundup(B*k + min(num_local, B*k) * (align - 1), align).
    """
    num_slots, row_capacity = ids_flat.numel(), row_to_slot.numel()
    if not 1 <= num_local <= SORT_MAX_EXPERTS or align < 1 or top_k < 1 or num_slots % top_k:
        raise ValueError(
            f"sort needs 1 <= num_local <= {SORT_MAX_EXPERTS}, align >= 1 and top_k dividing the slot count; "
            f"got num_local={num_local}, align={align}, {num_slots} slots, top_k={top_k}"
        )
    if (ids_flat.dtype != torch.int32 or offsets.numel() != num_local + 1 or row_expert.numel() != row_capacity
            or counts.numel() != num_local):
        raise ValueError("sort operands: int32 ids, offsets [num_local + 1], counts [num_local], "
                         "row_expert as long as row_to_slot")
    launch(
        "sort.cu",
        "moe_sort",
        ids_flat.device,
        1,
        SORT_THREADS,
        (
            ptr(ids_flat),
            np.int32(num_slots),
            np.int32(local_start),
            np.int32(num_local),
            np.int32(align),
            np.int32(row_capacity),
            ptr(offsets),
            ptr(slot_to_row),
            ptr(row_to_slot),
            ptr(row_expert),
            ptr(counts),
        ),
    )
