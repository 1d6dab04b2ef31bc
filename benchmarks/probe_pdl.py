"""Does a programmatic dependent launch start before its predecessor ends, eagerly and replayed from a CUDA graph?

The project launches every kernel with the programmatic-stream-serialization attribute (cudnn_moe.kernels.driver)
so that a kernel can become resident, and do work that needs nothing from its predecessor, while that one still
runs. This probe measures what the GPU does with it, with two tiny kernels and %globaltimer:

- ``primary`` (launched plainly) triggers its dependents at once, then spins for --spin-us;
- ``secondary`` (launched with the attribute) records when its first CTA started, before griddepcontrol.wait,
  and when the wait returned.

It prints, per form (eager; captured with torch.cuda.graph and replayed), per primary grid (CTAs per SM) and per
secondary grid, how long before the primary's end the secondary started (positive: it overlapped) and how long
after it the wait returned. A secondary that only starts once the primary ends means weight prefetches placed
before the wait cannot overlap the previous kernel.
Usage: python benchmarks/probe_pdl.py --help
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import gpu_missing, md_row, nvrtc_module, positive_int  # noqa: E402

from cudnn_moe.capture import capture_graph  # noqa: E402
from cudnn_moe.kernels import driver  # noqa: E402
from cudnn_moe.kernels.loader import packed_args  # noqa: E402

SOURCE = r"""
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// t[0]: primary end (max over CTAs); t[1]: secondary's first start; t[2]: secondary's first wait return.
extern "C" __global__ void primary(unsigned long long* t, unsigned long long spin_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const unsigned long long start = now_ns();
  unsigned long long now = start;
  while (now - start < spin_ns) now = now_ns();
  if (threadIdx.x == 0) atomicMax(t, now);
}
extern "C" __global__ void secondary(unsigned long long* t) {
  const unsigned long long start = now_ns();
  if (threadIdx.x == 0) atomicMin(t + 1, start);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) atomicMin(t + 2, now_ns());
}
"""

THREADS = 128


class Probe:
    """The two kernels on the current device, and a stamp buffer [3] uint64 (see SOURCE)."""

    def __init__(self, device: int) -> None:
        driver.make_device_current(device)
        module = nvrtc_module(SOURCE)
        self.primary = driver.module_get_function(module, "primary")
        self.secondary = driver.module_get_function(module, "secondary")
        self.stamps = torch.empty(3, dtype=torch.int64, device=f"cuda:{device}")

    def reset(self) -> None:
        self.stamps.copy_(torch.tensor([0, -1, -1], dtype=torch.int64))  # -1: the largest uint64 for atomicMin

    def launch(self, primary_ctas: int, secondary_ctas: int, spin_ns: int) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        address = np.uint64(self.stamps.data_ptr())
        driver.launch_kernel(self.primary, (primary_ctas, 1, 1), THREADS, 0, stream,
                             packed_args((address, np.uint64(spin_ns))).pointer)
        driver.launch_kernel_programmatic(self.secondary, (secondary_ctas, 1, 1), THREADS, 0, stream,
                                          packed_args((address,)).pointer)

    def read(self) -> tuple[float, float]:
        """(us the secondary started before the primary's end, us after it the wait returned). %globaltimer
        values (ns) stay below 2^63, so the int64 view of the stamps holds them as they are."""
        end, start, waited = self.stamps.tolist()
        if start == -1 or waited == -1 or end == 0:
            raise RuntimeError(f"a probe kernel did not record its time (stamps {end}, {start}, {waited})")
        return (end - start) / 1e3, (waited - end) / 1e3


def measure(probe: Probe, run: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median over ``repeats`` runs of Probe.read."""
    seen = []
    for _ in range(repeats):
        probe.reset()
        run()
        torch.cuda.synchronize()
        seen.append(probe.read())
    return statistics.median(s[0] for s in seen), statistics.median(s[1] for s in seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spin-us", type=positive_int, default=20, help="primary's run time (default: %(default)s)")
    parser.add_argument("--primary-ctas-per-sm", nargs="+", type=positive_int, default=[1, 4, 16],
                        help=f"primary grid per SM, {THREADS}-thread CTAs (default: %(default)s)")
    parser.add_argument("--secondary-ctas", nargs="+", type=positive_int, default=[1, 132, 1024],
                        help="secondary grid sizes (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=11, help="runs per median (default: %(default)s)")
    args = parser.parse_args(argv)
    if gpu_missing("probe_pdl"):
        return 2
    device = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    probe = Probe(device)
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs; primary spins {args.spin_us} us; medians of "
          f"{args.repeats}. started early = us the secondary's first CTA began before the primary's end (> 0: "
          f"overlap); wait returned = us after the primary's end")
    print()
    print(md_row(["form", "primary CTAs", "secondary CTAs", "started early (us)", "wait returned (us)"]))
    print(md_row(["---"] + ["---:"] * 4))
    for per_sm in args.primary_ctas_per_sm:
        for ctas in args.secondary_ctas:
            def run(p: int = per_sm * sms, s: int = ctas) -> None:
                probe.launch(p, s, args.spin_us * 1000)

            eager = measure(probe, run, args.repeats)
            replayed = measure(probe, capture_graph(run).replay, args.repeats)
            for form, (early, waited) in (("eager", eager), ("graph replay", replayed)):
                print(md_row([form, str(per_sm * sms), str(ctas), f"{early:.1f}", f"{waited:.1f}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
