"""Issue budget of the SM90 kernels' main loops, read off the SASS (CPU only: nvcc + cuobjdump).

    python scripts/sass_budget.py [--arch 90a] [-D SM90_MT=2 ...] [--kernel sm90_gemm_decode] [--leads]

Compiles kernels_cuda/sm90/grouped_gemm.cu to a cubin, disassembles it and, for each kernel, finds
the loop (a backward branch) with the most HMMA instructions: it prints the loop's instruction
count, its HMMA count and the instructions per k16 step per lane (= per HMMA / (MT x NT) mma per
step), plus any local-memory traffic (LDL / STL) anywhere in the kernel. With --leads it also prints,
for each global load in the loop (by opcode), its lead: how many HMMA the warp issues between the load
and the first instruction that reads what it loaded, counted around the loop's back-edge. A register
ring of P k64 steps would give its refills about (P - 1) / P of the loop's HMMA; ptxas places the
refills itself, and a lead of 0 means the warp waits for that load's whole latency.
cuobjdump is looked up on PATH and in the nvidia-cuda-cuobjdump wheel of the running Python.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "kernels_cuda" / "sm90" / "grouped_gemm.cu"

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def find_tool(name: str) -> str | None:
    found = shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")
    if found:
        return found
    try:
        import nvidia  # type: ignore[import-not-found]

        for base in getattr(nvidia, "__path__", []):
            for candidate in Path(base).glob(f"*/bin/{name}"):
                return str(candidate)
    except ImportError:
        pass
    return None


@dataclass
class LoopReport:
    kernel: str
    instructions: int  # in the loop body, branch included
    hmma: int
    local_memory: int  # LDL / STL anywhere in the kernel
    registers: int | None = None
    load_leads: dict[str, list[int]] = field(default_factory=dict)  # LDG opcode -> the leads of its loads (sorted)

    def per_k16(self, mma_per_k16: int) -> float:
        return self.instructions / max(self.hmma // max(mma_per_k16, 1), 1)


def cubin_command(arch: str, defines: list[str], source: Path = SOURCE) -> list[str]:
    """The nvcc -cubin command (ptxas -v), without its -o OUT."""
    sys.path.insert(0, str(ROOT))
    from cudnn_moe.kernels import cuda_defines

    nvcc = find_tool("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    return [
        nvcc, "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", str(ROOT / "kernels_cuda"),
        *cuda_defines(), *[f"-D{d}" for d in defines], "-Xptxas", "-v", "-cubin", str(source),
    ]


def compile_cubin(arch: str, defines: list[str], out: Path, source: Path = SOURCE) -> str:
    """nvcc -cubin; returns ptxas' -v report."""
    result = subprocess.run([*cubin_command(arch, defines, source), "-o", str(out)], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr)
    return result.stderr


def disassemble(cubin: Path) -> dict[str, list[tuple[int, str]]]:
    """kernel name -> [(address, instruction)]."""
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump not found")
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in text.splitlines():
        match = re.search(r"Function : (\S+)", line)
        if match:
            current = kernels.setdefault(match.group(1), [])
            continue
        match = _INSTR.search(line)
        if match and current is not None:
            current.append((int(match.group(1), 16), match.group(2).strip()))
    return kernels


_REGISTER = re.compile(r"\bR(\d+)(?:\.(64|128))?\b")
_HMMA_16816_WIDTHS = (4, 4, 2, 4)  # D, A, B, C registers of an m16n8k16 mma with FP32 accumulators


def _split(instruction: str) -> tuple[str, list[str]]:
    """(opcode, operands) of one SASS instruction, its guard predicate dropped."""
    text = re.sub(r"^@!?U?P\w+\s+", "", instruction)
    opcode, _, rest = text.partition(" ")
    return opcode, [part.strip() for part in rest.split(",")] if rest else []


def _width(suffixed: str) -> int:
    """Registers of a 32-bit operand from a .64 / .128 suffix in ``suffixed`` (an opcode or a register)."""
    return 4 if ".128" in suffixed else 2 if ".64" in suffixed else 1


def _registers(operand: str, width: int = 1) -> set[int]:
    """The R registers an operand names: ``width`` from its first register, or its .64 / .128 suffix."""
    out: set[int] = set()
    for number, suffix in _REGISTER.findall(operand):
        count = _width(f".{suffix}") if suffix else width
        out.update(range(int(number), int(number) + count))
    return out


def _reads(instruction: str) -> set[int]:
    """The registers an instruction reads: every operand of a store or reduction, the others past the first."""
    opcode, operands = _split(instruction)
    if opcode.startswith("HMMA.16816"):
        return set().union(*(_registers(o, w) for o, w in zip(operands[1:], _HMMA_16816_WIDTHS[1:], strict=False)))
    if opcode.startswith(("ST", "RED")):  # the data operand, last, is as wide as the opcode says
        return set().union(*(_registers(o, _width(opcode) if i == len(operands) - 1 else 1)
                             for i, o in enumerate(operands)))
    return set().union(*(_registers(o) for o in operands[1:]))


def load_leads(body: list[str]) -> dict[str, list[int]]:
    """For each global load (LDG) of a loop body: the HMMA issued between it and the first instruction that reads a
    register it writes, around the back-edge; by opcode, sorted."""
    hmma_before = [0]
    for instruction in body:
        hmma_before.append(hmma_before[-1] + ("HMMA" in instruction))
    total = hmma_before[-1]
    reads = [_reads(instruction) for instruction in body]  # parsed once for every load's search
    leads: dict[str, list[int]] = {}
    for index, instruction in enumerate(body):
        opcode, operands = _split(instruction)
        if not re.fullmatch(r"LDG(\..*)?", opcode) or not operands:  # a register load (not LDGSTS / LDGDEPBAR)
            continue
        written = _registers(operands[0].split()[0], _width(opcode))
        for step in range(1, len(body) + 1):
            other = (index + step) % len(body)
            if written & reads[other]:
                lead = hmma_before[other] - hmma_before[index + 1]
                leads.setdefault(opcode, []).append(lead if other > index else lead + total)
                break
    return {opcode: sorted(values) for opcode, values in leads.items()}


def main_loop(kernel: str, code: list[tuple[int, str]]) -> LoopReport:
    best: tuple[int, list[str]] = (0, [])
    for index, (address, instruction) in enumerate(code):
        match = _BRANCH.search(instruction)
        if not match:
            continue
        target = int(match.group(1), 16)
        if target >= address:
            continue
        body = [ins for addr, ins in code[: index + 1] if addr >= target]
        hmma = sum("HMMA" in ins for ins in body)
        if hmma > best[0]:
            best = (hmma, body)
    local = sum(bool(re.search(r"\b(LDL|STL)\b", ins)) for _, ins in code)
    return LoopReport(kernel, len(best[1]), best[0], local, load_leads=load_leads(best[1]))


def registers_of(report: str) -> dict[str, int]:
    out: dict[str, int] = {}
    kernel = None
    for line in report.splitlines():
        match = re.search(r"Compiling entry function '(\w+)'", line)
        if match:
            kernel = match.group(1)
        match = re.search(r"Used (\d+) registers", line)
        if match and kernel:
            out[kernel] = int(match.group(1))
    return out


def budget_of(cubin: Path, report: str) -> dict[str, LoopReport]:
    """kernel name -> its main loop, from a cubin and ptxas' -v report of its build."""
    registers = registers_of(report)
    reports = {}
    for kernel, code in disassemble(cubin).items():
        loop = main_loop(kernel, code)
        loop.registers = registers.get(kernel)
        reports[kernel] = loop
    return reports


def budget(arch: str = "90a", defines: list[str] | None = None) -> dict[str, LoopReport]:
    defines = defines or []
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        return budget_of(cubin, compile_cubin(arch, defines, cubin))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="90a")
    parser.add_argument("-D", dest="defines", action="append", default=[], help="macro, e.g. SM90_MT=2")
    parser.add_argument("--kernel", default=None)
    parser.add_argument("--leads", action="store_true", help="the lead of each global load in the loop, in HMMA")
    args = parser.parse_args()
    macros = dict(d.split("=", 1) for d in args.defines if "=" in d)
    mma_per_k16 = {
        "sm90_gemm_decode": int(macros.get("SM90_MT", 1)) * int(macros.get("SM90_NT", 1)),
        "sm90_gemm_prefill": 16,
    }
    for kernel, loop in sorted(budget(args.arch, args.defines).items()):
        if args.kernel and kernel != args.kernel:
            continue
        per = loop.per_k16(mma_per_k16.get(kernel, 1))
        print(f"{kernel}: {loop.registers} registers, main loop {loop.instructions} instructions, {loop.hmma} HMMA, "
              f"{per:.1f} instructions per k16 step per lane, {loop.local_memory} LDL/STL")
        if args.leads:
            for opcode, leads in sorted(loop.load_leads.items()):
                mean = sum(leads) / len(leads)
                print(f"  {opcode}: leads {leads} HMMA (mean {mean:.1f} of {loop.hmma})")


if __name__ == "__main__":
    main()
