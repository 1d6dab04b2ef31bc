"""The aligned routing plan of vLLM / SGLang (``moe_align_block_size``), built with plain torch ops.

A plan lists routed slots grouped by expert, each expert's group padded to whole blocks of
``block_m`` entries, so that a GEMM kernel can give every block one expert:

- a slot is named by its flat id ``t * top_k + s`` (token t, slot s of ``topk_ids`` [M, top_k]);
- ``sorted_token_ids`` int32 [capacity]: expert 0's slots, then expert 1's, ...; each group is
  followed by padding entries up to a multiple of ``block_m``; the padding value is
  ``M * top_k``; every entry past the valid extent holds the padding value too;
- ``expert_ids`` int32 [capacity / block_m]: the expert of each block; blocks past the valid
  extent hold 0 (the value vLLM writes there, always a valid index);
- ``num_tokens_post_padded`` int32 [1]: the valid extent, the sum of the padded group sizes.

Choices, compared with vLLM (``vllm/model_executor/layers/fused_moe/moe_align_block_size.py``
and ``csrc/moe/moe_align_sum_kernels.cu``):

- capacity is vLLM's ``max_num_tokens_padded`` with ``pad_sorted_ids=True``: ``M * top_k +
  min(M * top_k, E) * (block_m - 1)`` rounded up to ``block_m`` (each non-empty expert wastes
  at most ``block_m - 1`` entries, and at most ``min(M * top_k, E)`` experts are non-empty);
- within one expert the slots keep ascending flat-id order; vLLM's kernels place them with
  atomics, so its order within an expert is unspecified and ours is one of its valid outcomes;
- a slot whose id lies outside [0, E) gets no entry (it is routed nowhere and is not counted).
  vLLM's general CUDA path skips ids >= E the same way; negative ids are undefined there, and
  here they are skipped too (the -1 that expert-parallel routers write for foreign experts).
"""

from __future__ import annotations

import torch

from ..kernels.codes import SORT_MAX_EXPERTS
from ..validate import require_int_arg

_INT32_MAX = (1 << 31) - 1


def plan_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Entries of ``sorted_token_ids`` that any routing of ``num_slots`` slots over ``num_experts``
    experts fits in: ``num_slots + min(num_slots, num_experts) * (block_m - 1)`` rounded up to block_m."""
    worst = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-worst // block_m) * block_m


def _check_topk_ids(topk_ids: object) -> torch.Tensor:
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {str(topk_ids.dtype).removeprefix('torch.')}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [num_tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids needs top_k >= 1 columns, got shape {tuple(topk_ids.shape)}")
    return topk_ids


def align_routing(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids (integer [M, top_k], CPU or CUDA) -> (sorted_token_ids int32 [C],
    expert_ids int32 [C / block_m], num_tokens_post_padded int32 [1]) on topk_ids' device,
    C = plan_capacity(M * top_k, num_experts, block_m). See the module docstring for the format.

    block_m: an int >= 8 and a multiple of 8; num_experts: an int in 1 .. SORT_MAX_EXPERTS (512,
    the most experts a layer holds; the plan's counts are sized by it). Raises TypeError /
    ValueError naming the argument, also when the plan's capacity would not fit in int32.
    No host synchronization: sizes come from shapes only, and ids are never read back to check
    them (ids outside [0, num_experts) are skipped on the device).
    """
    topk_ids = _check_topk_ids(topk_ids)
    require_int_arg("block_m", block_m, minimum=8)
    if block_m % 8:
        raise ValueError(f"block_m must be a multiple of 8, got {block_m}")
    require_int_arg("num_experts", num_experts, minimum=1, maximum=SORT_MAX_EXPERTS)
    num_slots = topk_ids.numel()
    capacity = plan_capacity(num_slots, num_experts, block_m)
    if capacity + num_slots > _INT32_MAX:
        raise ValueError(
            f"topk_ids has {num_slots} slots: the plan ({capacity} entries) would not fit int32 indexing"
        )
    device, i64 = topk_ids.device, torch.int64

    flat = topk_ids.reshape(-1).to(i64)
    # Bucket num_experts collects the slots that are routed nowhere.
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=i64, device=device)
    counts.index_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    group_end = torch.cumsum(padded, 0)
    # Where each bucket's entries start: experts at their padded offsets, the skipped slots
    # past the capacity (written to a scratch tail that is cut off below).
    group_start = torch.cat((group_end - padded, torch.full((1,), capacity, dtype=i64, device=device)))

    order = torch.sort(bucket, stable=True).indices  # slot ids grouped by bucket, ascending within
    sorted_bucket = bucket[order]
    run_start = torch.cumsum(counts, 0) - counts  # where each bucket's run begins in `order`
    rank = torch.arange(num_slots, dtype=i64, device=device) - run_start[sorted_bucket]
    entries = torch.full((capacity + num_slots,), num_slots, dtype=torch.int32, device=device)
    entries.scatter_(0, group_start[sorted_bucket] + rank, order.to(torch.int32))
    sorted_token_ids = entries[:capacity]

    num_tokens_post_padded = group_end[-1:]
    block_first = torch.arange(0, capacity, block_m, dtype=i64, device=device)
    owner = torch.searchsorted(group_end, block_first, right=True)  # first expert whose group ends past it
    expert_ids = torch.where(block_first < num_tokens_post_padded, owner, 0).to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded.to(torch.int32)
