#!/usr/bin/env python3
"""One line per kernel of an Nsight Compute text report (`ncu … > LOG`), the
counters that say what bounds it, then each kernel's rule findings.

    bench/ncu_summary.py LOG [LOG …]

scripts/gpu-check.sh's `ncu` part profiles the fused attention's passes and
the embedding's backward with the sections this reads (SpeedOfLight,
Occupancy, LaunchStats, WarpStateStats, MemoryWorkloadAnalysis,
ComputeWorkloadAnalysis, SchedulerStats) and puts this summary in its report;
the whole report stays in the run's logs. A metric a report lacks prints as
"—": ncu's versions name a few of them differently.
"""
import re
import sys

# The kernel header: `  name (grid)x(block), Context 1, Stream 7, Device 0, CC 9.0`.
HEADER = re.compile(r"^\s{0,4}(\S+) \(([\d, ]+)\)x\(([\d, ]+)\), Context \d+, Stream \d+")
# A metric row: name, unit, value, separated by runs of two or more spaces.
METRIC = re.compile(r"^\s+(\S.*?)\s{2,}(\S+)\s+([-\d,.]+)\s*$")
# A rule's finding: `OPT`, `WRN` or `INF` and its text (continued on the
# following indented lines).
RULE = re.compile(r"^\s+(OPT|WRN)\s+(.*)$")

COLUMNS = [
    ("time", "Duration"),
    ("SM %", "Compute (SM) Throughput"),
    ("mem %", "Memory Throughput"),
    ("DRAM %", "DRAM Throughput"),
    ("L1 %", "L1/TEX Cache Throughput"),
    ("L2 %", "L2 Cache Throughput"),
    ("regs", "Registers Per Thread"),
    ("smem KB", "Dynamic Shared Memory Per Block"),
    ("occ th", "Theoretical Occupancy"),
    ("occ ach", "Achieved Occupancy"),
    ("blk/SM", "Block Limit Registers"),
    ("cyc/inst", "Warp Cycles Per Issued Instruction"),
    ("issue %", "Issue Slots Busy"),
    ("IPC", "Executed Ipc Active"),
    ("pipes %", "Mem Pipes Busy"),
    ("L2 hit", "L2 Hit Rate"),
]


def kernels(lines):
    """(name, grid, block, {metric: (unit, value)}, [finding]) per kernel."""
    current = None
    rule = None
    for line in lines:
        m = HEADER.match(line)
        if m:
            if current:
                yield current
            current = (m.group(1), m.group(2), m.group(3), {}, [])
            rule = None
            continue
        if current is None:
            continue
        r = RULE.match(line)
        if r:
            rule = [r.group(1), r.group(2).strip()]
            current[4].append(rule)
            continue
        mm = METRIC.match(line)
        if mm and not line.strip().startswith("-"):
            name, unit, value = mm.group(1).strip(), mm.group(2), mm.group(3)
            current[3].setdefault(name, (unit, value))
            rule = None
            continue
        if rule is not None and line.strip() and not line.strip().startswith(("Section:", "---")):
            rule[1] += " " + line.strip()
        else:
            rule = None
    if current:
        yield current


def cell(metrics, name):
    if name not in metrics:
        return "—"
    unit, value = metrics[name]
    if name == "Duration":
        return f"{value} {unit}"
    if name == "Dynamic Shared Memory Per Block":
        scale = {"byte": 1 / 1024, "Kbyte": 1, "Mbyte": 1024}.get(unit.split("/")[0])
        try:
            return f"{float(value.replace(',', '')) * scale:.1f}" if scale else f"{value} {unit}"
        except ValueError:
            return value
    return value


def main(paths):
    found = []
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                found.extend(kernels(f.read().splitlines()))
        except OSError as e:
            print(f"{path}: {e.strerror}")
    if not found:
        print("no kernel in the report (did ncu read the counters? see the log)")
        return 1
    width = max(len(k[0]) for k in found)
    print(f"{'kernel':<{width}}  {'grid':>12}  " + "  ".join(f"{c:>9}" for c, _ in COLUMNS))
    for name, grid, _block, metrics, _ in found:
        grid = "x".join(g.strip() for g in grid.split(","))
        print(f"{name:<{width}}  {grid:>12}  " + "  ".join(f"{cell(metrics, m):>9}" for _, m in COLUMNS))
    print()
    for name, _grid, _block, _metrics, findings in found:
        for kind, text in findings:
            # Newer ncu opens a finding with its estimated speedup; then
            # the first two sentences say what and how much, the rest is
            # ncu's advice.
            gain = ""
            m = re.match(r"Est\. (?:Local |Global )?Speedup: ([\d.]+%)\s*(.*)", text)
            if m:
                gain, text = f" (est. speedup {m.group(1)})", m.group(2)
            said = " ".join(re.split(r"(?<=\.)\s", text)[:2])
            print(f"{name}: {kind}{gain} {said[:400]}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
