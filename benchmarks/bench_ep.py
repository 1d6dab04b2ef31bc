"""Benchmark expert parallelism: a DeepSeek-V3-shaped NVFP4 MoE layer on W GPUs (ExpertParallelMoe, both dispatches)
vs 1 GPU.

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py [--tokens 1 64 4096] [--iters 20] [--markdown out.md]
    python3 benchmarks/bench_ep.py --traffic [--worlds 2 4 8]   # the bytes-moved model only (no GPU)

Per T (tokens per rank): one EP layer per dispatch with max_tokens_per_rank = T (every rank's experts
run on W * T rows: size the layer to the batch), each rank with its own random batch of T tokens.
Time table:
- EP all-gather (W GPUs): all-gather, fused_moe on this rank's experts for all W * T tokens,
  reduce-scatter (--reduce-dtype); EP all-to-all: tokens only to the ranks holding their experts
  (T rows per peer, fixed splits), fused_moe on the received rows, partials back, FP32 combine. Each
  call captured in a CUDA graph (eager where capture fails: marked); the slowest rank's median;
- 1 GPU at T: fused_moe on the full weights for the same per-rank batch of T tokens (rank 0);
- 1 GPU at W * T: the same total tokens as one EP call on one GPU (rank 0);
- each EP output's error against 1-GPU fused_moe on rank 0's batch (relative L2, worst row / total).
Traffic table: the bytes each rank sends per call (= receives; cudnn_moe.distributed.ep_traffic) for
both dispatches, and how many other ranks rank 0's tokens needed in the all-to-all call (its
sent_counts) against the expectation for uniform routing (expected_remote_ranks).
Timing (common.py): median of --iters CUDA-event-timed replays, each after a 256 MiB L2 flush.
Then the weight bytes each GPU holds (NVFP4 codes + E4M3 scales + FP32 globals) and the EP buffers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MODELS, ModelShape, Report, Timer, capture, fmt, gpu_missing, header_line, md_row, moe_call, positive_int,
    progress, random_batch, random_weights,
)

from cudnn_moe import (  # noqa: E402
    ExpertParallelMoe, Nvfp4MoeConfig, Nvfp4Weights, Routing, SwiGLU, expert_shard, fused_moe, shard_weights,
)
from cudnn_moe.distributed import DISPATCHES, ep_traffic, expected_remote_ranks, token_record_bytes  # noqa: E402

GB = 1e9


def weight_bytes(w: Nvfp4Weights) -> int:
    """Device bytes of prepared weights: codes, block scales and per-expert globals of both GEMMs."""
    return sum(t.nbytes for t in (w.w1, w.w1_scales, w.w1_alpha, w.w2, w.w2_scales, w.w2_alpha))


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> str:
    """'worst row / total' relative L2 error of got against ref."""
    got, ref = got.double(), ref.double()
    row = ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()
    return f"{row:.1e} / {((got - ref).norm() / ref.norm()).item():.1e}"


def mb(count: float) -> str:
    """Bytes as a MB (10^6) cell."""
    return f"{count / 1e6:,.3f}"


TRAFFIC_COLUMNS = ["W", "T per rank", "all-gather MB per rank (dispatch + combine)",
                   "all-to-all MB per rank (dispatch + combine)", "all-to-all / all-gather",
                   "other ranks a token needs (expected)", "routed only MB (expected)"]


def traffic_table(m: ModelShape, worlds: list[int], tokens: list[int]) -> list[str]:
    """The bytes-moved model's markdown table (TRAFFIC_COLUMNS) for ``m`` at each W and T per rank (= Tmax):
    ep_traffic of both dispatches (all-gather with an FP32 reduce-scatter), and what an exchange moving only the
    routed (token, rank) pairs would send (records out, BF16 partials back) for uniform routing."""
    rows = [md_row(TRAFFIC_COLUMNS), md_row(["---"] * 2 + ["---:"] * (len(TRAFFIC_COLUMNS) - 2))]
    for world in worlds:
        peers = expected_remote_ranks(m.experts, m.top_k, world_size=world, rank=0)
        for t in tokens:
            shape = dict(world_size=world, max_tokens_per_rank=t, hidden_size=m.hidden, top_k=m.top_k)
            gathered, routed = ep_traffic("all_gather", **shape), ep_traffic("all_to_all", **shape)
            routed_only = t * peers * (token_record_bytes(m.hidden, m.top_k) + 2 * m.hidden)
            rows.append(md_row([str(world), str(t), mb(gathered.total), mb(routed.total),
                                f"{routed.total / gathered.total:.2f}", f"{peers:.2f}", mb(routed_only)]))
    return rows


class EpBench:
    """The time and traffic tables (rows as measured) and the memory table of one model; rank 0 prints them."""

    def __init__(self, args: argparse.Namespace, report: Report, m: ModelShape) -> None:
        self.args, self.report, self.m = args, report, m
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timer = Timer(args.iters)

    def time_us(self, fn: Callable[[], object], collective: bool) -> tuple[float, bool]:
        """(median us of fn, whether it was captured in a CUDA graph); a collective fn falls back to eager timing
        (said in a note) if capture fails."""
        try:
            replay, graphed = capture(fn).replay, True
        except RuntimeError as exc:
            if not collective:
                raise
            self.report.note(f"rank {self.rank}: an EP call could not be captured in a CUDA graph "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0]}); that EP call timed eagerly")
            replay, graphed = fn, False
        if collective:
            dist.barrier()
        return self.timer.median_us(replay), graphed

    def time_layer(self, layer: ExpertParallelMoe, acts: object, routing: Routing, tokens: int) -> tuple[float, bool]:
        """(the slowest rank's median us of one captured layer call, whether every rank captured it)."""
        out = torch.empty(tokens, self.m.hidden, dtype=torch.bfloat16, device="cuda")
        timing = self.time_us(lambda: layer(acts, routing, out=out), collective=True)
        timings: list[tuple[float, bool]] = [(0.0, True)] * self.world
        dist.all_gather_object(timings, timing)
        return max(us for us, _ in timings), all(ok for _, ok in timings)

    def run(self) -> None:
        m, args, report, rank, world = self.m, self.args, self.report, self.rank, self.world
        progress(f"rank {rank}: random BF16 weights (one seed on every rank), NVFP4 shard{' and full' if rank == 0 else ''}")
        w1, w2 = random_weights(m, torch.Generator(device="cuda").manual_seed(0))
        prep = Nvfp4MoeConfig(max_num_tokens=world * max(args.tokens))
        full = prep.prepare_weights(w1, w2, activation=SwiGLU()) if rank == 0 else None
        shard = prep.prepare_weights(*shard_weights(w1, w2, world_size=world, rank=rank), activation=SwiGLU())
        del w1, w2
        gc.collect()
        torch.cuda.empty_cache()
        if rank == 0:
            report.table(["T per rank", f"EP all-gather, {world} GPUs (us)", f"EP all-to-all, {world} GPUs (us)",
                          "1 GPU, T tokens (us)", f"1 GPU, {world}T tokens (us)", f"1 GPU {world}T / all-gather",
                          f"1 GPU {world}T / all-to-all", "all-gather vs 1 GPU: worst row / total rel. error",
                          "all-to-all vs 1 GPU: worst row / total rel. error"])
        buffers: dict[str, dict[int, int]] = {dispatch: {} for dispatch in DISPATCHES}
        traffic = []
        for tokens in args.tokens:
            gen = torch.Generator(device="cuda").manual_seed(1000 * tokens + rank)
            x, ids, route_w = random_batch(m, tokens, gen)
            config = Nvfp4MoeConfig(max_num_tokens=world * tokens)
            acts, routing = config.prepare_activations(x), Routing.unpacked(ids, route_w)
            ref = fused_moe(config, acts, routing, full) if rank == 0 else None
            cells, errors = [], []
            for dispatch in DISPATCHES:
                reduce_dtype = args.reduce_dtype if dispatch == "all_gather" else torch.float32
                layer = ExpertParallelMoe(config, shard, num_experts=m.experts, top_k=m.top_k, max_tokens_per_rank=tokens,
                                          reduce_dtype=reduce_dtype, dispatch=dispatch)
                layer.warmup()
                us, graphed = self.time_layer(layer, acts, routing, tokens)
                cells.append((us, graphed))
                buffers[dispatch][tokens] = layer.buffer_bytes
                got = layer(acts, routing)  # every rank calls: rank 0 checks its rows
                if rank == 0:
                    errors.append(rel_errors(got, ref))
                if dispatch == "all_to_all":
                    counts = layer.sent_counts.tolist()
                    traffic.append((tokens, (sum(counts) - counts[rank]) / tokens))
                dist.barrier()
                del layer, got
                gc.collect()
                torch.cuda.empty_cache()
            if rank == 0:
                progress(f"T={tokens}: EP all-gather {cells[0][0]:.1f} us, all-to-all {cells[1][0]:.1f} us; "
                         "1-GPU baselines on rank 0")
                single, _ = self.time_us(moe_call(config, full, x, ids, route_w), collective=False)
                x2, ids2, route_w2 = random_batch(m, world * tokens, gen)
                single_total, _ = self.time_us(moe_call(config, full, x2, ids2, route_w2), collective=False)
                times = [fmt(us) + ("" if graphed else " (eager)") for us, graphed in cells]
                report.emit(md_row([str(tokens), *times, fmt(single), fmt(single_total),
                                    *(f"{single_total / us:.2f}x" for us, _ in cells), *errors]))
            dist.barrier()
        if rank == 0:
            report.emit()
            report.table(["T per rank", "all-gather MB sent per rank (dispatch + combine)",
                          "all-to-all MB sent per rank (dispatch + combine)",
                          "other ranks a rank-0 token needed (this run)", "other ranks a token needs (expected)"])
            peers = expected_remote_ranks(m.experts, m.top_k, world_size=world, rank=0)
            for tokens, measured in traffic:
                shape = dict(world_size=world, max_tokens_per_rank=tokens, hidden_size=m.hidden, top_k=m.top_k)
                gathered = ep_traffic("all_gather", **shape, reduce_dtype=args.reduce_dtype)
                report.emit(md_row([str(tokens), mb(gathered.total), mb(ep_traffic("all_to_all", **shape).total),
                                    f"{measured:.2f}", f"{peers:.2f}"]))
        shard_bytes: list[int] = [0] * world
        dist.all_gather_object(shard_bytes, weight_bytes(shard))
        all_buffers: list[dict[str, dict[int, int]]] = [{}] * world
        dist.all_gather_object(all_buffers, buffers)
        if rank == 0:
            report.emit()
            report.table(["setup", "weights per GPU (GB)", "EP layer buffers per GPU (MB), by T per rank"])
            report.emit(md_row(["1 GPU, all experts", f"{weight_bytes(full) / GB:.2f}", "-"]))
            for r in range(world):
                cells = "; ".join(f"{dispatch}: " + ", ".join(f"T={t}: {b / 1e6:.1f}" for t, b in by_t.items())
                                  for dispatch, by_t in all_buffers[r].items())
                report.emit(md_row([f"EP rank {r}, experts {shard_range(m, r, world)}", f"{shard_bytes[r] / GB:.2f}", cells]))


def shard_range(m: ModelShape, rank: int, world: int) -> str:
    """'start..end' of rank's experts."""
    start, count = expert_shard(m.experts, world_size=world, rank=rank)
    return f"{start}..{start + count - 1}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v3", choices=list(MODELS), help="preset (default: %(default)s)")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=[1, 64, 4096],
                        help="tokens per rank (default: %(default)s)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed replays per median (default: %(default)s)")
    parser.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the cross-rank sum (default: %(default)s)")
    parser.add_argument("--markdown", type=Path, help="also write the tables here (rank 0)")
    parser.add_argument("--traffic", action="store_true",
                        help="print the bytes-moved model's table for --worlds and --tokens and exit (no GPU)")
    parser.add_argument("--worlds", nargs="+", type=positive_int, default=[2, 4, 8],
                        help="world sizes of the --traffic table (default: %(default)s)")
    args = parser.parse_args(argv)
    args.reduce_dtype = getattr(torch, args.reduce_dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.traffic:
        m = MODELS[args.model]
        print(f"{m.name} (E={m.experts}, H={m.hidden}, I={m.intermediate}, top-{m.top_k}): bytes each rank sends per "
              f"call (= receives), token record {token_record_bytes(m.hidden, m.top_k)} B")
        print()
        print("\n".join(traffic_table(m, args.worlds, args.tokens)))
        return 0
    if gpu_missing("bench_ep"):
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=datetime.timedelta(seconds=600))
    report = Report()
    m = MODELS[args.model]
    if dist.get_rank() == 0:
        report.emit(header_line(f"{dist.get_world_size()} ranks, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
                                f"all-gather reduce {str(args.reduce_dtype).removeprefix('torch.')}"))
        report.emit()
        report.emit(f"{m.name} (E={m.experts}, H={m.hidden}, I={m.intermediate}, top-{m.top_k}, SwiGLU), uniform random "
                    f"distinct routing; median of {args.iters} CUDA-event-timed replays of one captured call, 256 MiB "
                    "L2 flush before each; us = microseconds; MB = 10^6 bytes.")
        report.emit()
    EpBench(args, report, m).run()
    if dist.get_rank() == 0:
        report.write(args.markdown)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
