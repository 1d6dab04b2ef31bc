"""Benchmark expert parallelism: a DeepSeek-V3-shaped NVFP4 MoE layer on W GPUs (ExpertParallelMoe) vs 1 GPU.

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py [--tokens 1 64 4096] [--iters 20] [--markdown out.md]

Per T (tokens per rank): one EP layer with max_tokens_per_rank = T (its gathered batch is W * T rows
on every GPU: size the layer to the batch), each rank with its own random batch of T tokens. Columns:
- EP (W GPUs): one call on every rank (all-gather, fused_moe on this rank's experts for all W * T
  tokens, reduce-scatter), captured in a CUDA graph (eager where capture fails: noted); the slowest
  rank's median;
- 1 GPU at T: fused_moe on the full weights for the same per-rank batch of T tokens (rank 0);
- 1 GPU at W * T: the same total tokens as one EP call on one GPU (rank 0);
- the EP output's error against 1-GPU fused_moe on rank 0's batch (relative L2, worst row / total).
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

GB = 1e9


def weight_bytes(w: Nvfp4Weights) -> int:
    """Device bytes of prepared weights: codes, block scales and per-expert globals of both GEMMs."""
    return sum(t.nbytes for t in (w.w1, w.w1_scales, w.w1_alpha, w.w2, w.w2_scales, w.w2_alpha))


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> str:
    """'worst row / total' relative L2 error of got against ref."""
    got, ref = got.double(), ref.double()
    row = ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()
    return f"{row:.1e} / {((got - ref).norm() / ref.norm()).item():.1e}"


class EpBench:
    """The time table (rows as measured) and the memory table of one model; rank 0 prints them."""

    def __init__(self, args: argparse.Namespace, report: Report, m: ModelShape) -> None:
        self.args, self.report, self.m = args, report, m
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timer = Timer(args.iters)
        self.graph_ok = True

    def time_us(self, fn: Callable[[], object], collective: bool) -> float:
        """Median us of fn, captured in a CUDA graph; a collective fn falls back to eager timing (said in a note,
        its cells marked '(eager)') if capture fails."""
        try:
            replay = capture(fn).replay
        except RuntimeError as exc:
            if not collective:
                raise
            self.graph_ok = False
            self.report.note(f"rank {self.rank}: the EP call could not be captured in a CUDA graph "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0]}); EP timed eagerly")
            replay = fn
        if collective:
            dist.barrier()
        return self.timer.median_us(replay)

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
            report.table(["T per rank", f"EP {world} GPUs (us)", "1 GPU, T tokens (us)", f"1 GPU, {world}T tokens (us)",
                          f"1 GPU {world}T / EP", "EP vs 1 GPU: worst row / total rel. error"])
        buffers = {}
        for tokens in args.tokens:
            gen = torch.Generator(device="cuda").manual_seed(1000 * tokens + rank)
            x, ids, route_w = random_batch(m, tokens, gen)
            config = Nvfp4MoeConfig(max_num_tokens=world * tokens)
            layer = ExpertParallelMoe(config, shard, num_experts=m.experts, top_k=m.top_k, max_tokens_per_rank=tokens,
                                      reduce_dtype=args.reduce_dtype)
            layer.warmup()
            acts, routing = config.prepare_activations(x), Routing.unpacked(ids, route_w)
            out = torch.empty(tokens, m.hidden, dtype=torch.bfloat16, device="cuda")
            ep_us = self.time_us(lambda: layer(acts, routing, out=out), collective=True)  # noqa: B023
            buffers[tokens] = layer.buffer_bytes
            ep_all: list[tuple[float, bool]] = [(0.0, True)] * world
            dist.all_gather_object(ep_all, (ep_us, self.graph_ok))
            ep_slowest, ep_graphed = max(us for us, _ in ep_all), all(ok for _, ok in ep_all)
            if rank == 0:
                progress(f"T={tokens}: EP {ep_slowest:.1f} us; 1-GPU baselines on rank 0")
                ref = fused_moe(config, acts, routing, full)
                error = rel_errors(layer(acts, routing), ref)
                single = self.time_us(moe_call(config, full, x, ids, route_w), collective=False)
                x2, ids2, route_w2 = random_batch(m, world * tokens, gen)
                single_total = self.time_us(moe_call(config, full, x2, ids2, route_w2), collective=False)
                ep_cell = fmt(ep_slowest) + ("" if ep_graphed else " (eager)")
                report.emit(md_row([str(tokens), ep_cell, fmt(single), fmt(single_total),
                                    f"{single_total / ep_slowest:.2f}x", error]))
            else:
                layer(acts, routing)  # rank 0's error check calls the layer once more: every rank must
            dist.barrier()
            del layer
            gc.collect()
            torch.cuda.empty_cache()
        shard_bytes: list[int] = [0] * world
        dist.all_gather_object(shard_bytes, weight_bytes(shard))
        all_buffers: list[dict[int, int]] = [{}] * world
        dist.all_gather_object(all_buffers, buffers)
        if rank == 0:
            report.emit()
            report.table(["setup", "weights per GPU (GB)", "EP layer buffers per GPU (MB), by T per rank"])
            report.emit(md_row(["1 GPU, all experts", f"{weight_bytes(full) / GB:.2f}", "-"]))
            for r in range(world):
                cells = ", ".join(f"T={t}: {b / 1e6:.1f}" for t, b in all_buffers[r].items())
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
    args = parser.parse_args(argv)
    args.reduce_dtype = getattr(torch, args.reduce_dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
                                f"reduce {str(args.reduce_dtype).removeprefix('torch.')}"))
        report.emit()
        report.emit(f"{m.name} (E={m.experts}, H={m.hidden}, I={m.intermediate}, top-{m.top_k}, SwiGLU), uniform random "
                    f"distinct routing; median of {args.iters} CUDA-event-timed replays of one captured call, 256 MiB "
                    "L2 flush before each; us = microseconds.")
        report.emit()
    EpBench(args, report, m).run()
    if dist.get_rank() == 0:
        report.write(args.markdown)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
