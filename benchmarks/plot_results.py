"""Plot benchmark tables: time vs token count (log-log) per model, one line per contender and the floor.

Reads the markdown the benchmarks write (``--markdown``; or any file holding such tables, RESULTS.md too):
every table with a "model" and a "T" column; each column whose header is "us" or ends in "(us)" is a series,
named by its header, and by the row's "format" (and "path") where the table has one. Writes one PNG per input
file and model next to ``--out`` (default: benchmarks/plots/). Needs matplotlib (the ``plots`` extra).
Usage: python benchmarks/plot_results.py benchmarks/data/bench_moe.md [more.md ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

Series = dict[str, dict[str, list[tuple[float, float]]]]  # model -> series name -> [(T, us)]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(text: str) -> float | None:
    match = re.match(r"^[<=~ ]*([0-9]+(?:\.[0-9]+)?)", text)
    return float(match.group(1)) if match else None


def read_tables(text: str) -> Series:
    """Every model's series of every table in ``text`` (see the module docstring)."""
    series: Series = defaultdict(lambda: defaultdict(list))
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or i + 1 >= len(lines) or not set(lines[i + 1]) <= set("|-: "):
            continue
        header = _cells(line)
        if "model" not in header or "T" not in header:
            continue
        times = [j for j, h in enumerate(header) if h == "us" or h.endswith("(us)")]
        labels = [header.index(h) for h in ("format", "path") if h in header]
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = _cells(row)
            tokens = _number(cells[header.index("T")]) if len(cells) == len(header) else None
            if tokens is None:
                continue
            for j in times:
                value = _number(cells[j])
                if value is not None:
                    name = " ".join([cells[k] for k in labels] + [header[j].removesuffix(" (us)")]).strip()
                    series[cells[header.index("model")]][name].append((tokens, value))
    return series


def plot(series: Series, title: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    out.mkdir(parents=True, exist_ok=True)
    for model, lines in series.items():
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for name, points in sorted(lines.items()):
            points.sort()
            style = "--" if "floor" in name else "-"
            axes.plot([t for t, _ in points], [us for _, us in points], style, marker="o", label=name)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("tokens per call (T)")
        axes.set_ylabel("time per layer (us)")
        axes.set_title(f"{model}: {title}")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = out / f"{re.sub(r'[^A-Za-z0-9]+', '-', f'{title}-{model}').strip('-').lower()}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="markdown files with benchmark tables")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "plots", help="output folder")
    args = parser.parse_args(argv)
    for path in args.inputs:
        series = read_tables(path.read_text())
        if not series:
            print(f"{path}: no table with model, T and time columns")
            continue
        for written in plot(series, path.stem, args.out):
            print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
