#!/usr/bin/env python3
"""trace_timeline.py — one decode step's kernel timeline from a DELTASERVE_TRACE file (src/trace.rs).

  DELTASERVE_TRACE=/tmp/t.csv deltaserve bench --batches 1 --contexts 1024 --steps 8 ...
  scripts/trace_timeline.py /tmp/t.csv[.gz] --svg step.svg --tsv step.tsv [--last 'w4p_hsb[1940]']

Records are blocks (kernel, block, SM, start / wait-return / end in ns). The blocks of one kernel are
cut into launches where a block index repeats (a launch's blocks all start before the next launch of
the same kernel does: its launch waits for their pdl_trigger or their completion) or where a block
starts more than 2 us after the current launch's blocks have all ended; launches are
ordered by their first start, and a step ends at each launch labelled --last (name[blocks]; default:
the label of the trace's last launch, e.g. the lm_head GEMV or the argmax). For the chosen step (the
median-length one of the complete steps) every launch gets:
  exposed  end - the previous launch's end: how far this launch moves the step's frontier (the
           exposed times add up to the step; with programmatic launches a kernel's work before its
           wait overlaps the kernels before it and is not counted);
  latency  its first wait return - the previous launch's end (kernels without pdl_wait: its first
           block's start): the dependency hand-over;
  after    its end - its first wait return (or first start): the work left after the hand-over.
Prints the launches and a summary per kernel (name[blocks]); --tsv writes the launches, --svg draws
the summary and a Gantt of the first --window launches (the pre-wait part of each bar is light).
Standard library only.
"""
import argparse
import csv
import gzip
import statistics
import sys
from collections import defaultdict


def load(path):
    recs = []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for r in csv.DictReader(f):
            recs.append((r["kernel"], int(r["block"]), int(r["sm"]), int(r["start_ns"]), int(r["wait_ns"]),
                         int(r["end_ns"])))
    return recs


# A block that starts this long after every block of the current launch has ended begins a new one
# (the next launch's first block may have an index the current grid lacks).
GAP_NS = 2000


def launches(recs):
    by_kernel = defaultdict(list)
    for r in recs:
        by_kernel[r[0]].append(r)
    out = []
    for name, rs in by_kernel.items():
        rs.sort(key=lambda r: (r[3], r[5]))
        cur, seen, cur_end = [], set(), 0
        for r in rs:
            if r[1] in seen or (cur and r[3] > cur_end + GAP_NS):
                out.append(cur)
                cur, seen, cur_end = [], set(), 0
            cur.append(r)
            seen.add(r[1])
            cur_end = max(cur_end, r[5])
        if cur:
            out.append(cur)
    res = []
    for blocks in out:
        waits = [b[4] for b in blocks if b[4] > 0]
        res.append({
            "kernel": blocks[0][0],
            "blocks": len(blocks),
            "start": min(b[3] for b in blocks),
            "last_start": max(b[3] for b in blocks),
            "wait": min(waits) if waits else None,
            "end": max(b[5] for b in blocks),
            "sms": len({b[2] for b in blocks}),
        })
    res.sort(key=lambda l: (l["start"], l["end"]))
    return res


def steps(ls, last):
    idx = [i for i, l in enumerate(ls) if label(l) == last]
    return [ls[a + 1:b + 1] for a, b in zip(idx, idx[1:])]


def annotate(step):
    prev_end = None
    for l in step:
        ready = l["wait"] if l["wait"] is not None else l["start"]
        if prev_end is None:
            l["exposed"], l["latency"] = l["end"] - l["start"], 0
        else:
            l["exposed"] = l["end"] - prev_end
            l["latency"] = ready - prev_end
        l["after"] = l["end"] - ready
        prev_end = max(prev_end or 0, l["end"])
    return step


def label(l):
    return f'{l["kernel"]}[{l["blocks"]}]'


def svg(step, summary, window, path):
    t0 = step[0]["start"]
    total = step[-1]["end"] - t0
    W, left, row = 1100, 260, 12
    rows = step[:window]
    h_sum = 18 * len(summary) + 40
    h_gantt = row * len(rows) + 60
    H = h_sum + h_gantt + 20
    span = max(l["end"] for l in rows) - rows[0]["start"] if rows else 1
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="monospace" font-size="11">',
         f'<text x="8" y="16" font-size="13">decode step {total / 1e6:.3f} ms: exposed time per kernel '
         f'(sums to the step); dark = after the hand-over, light = hand-over latency</text>']
    xmax = max(s[1] for s in summary) or 1
    for i, (name, exp, lat, n) in enumerate(summary):
        y = 30 + 18 * i
        wl = (W - left - 120) * max(lat, 0) / xmax
        we = (W - left - 120) * exp / xmax
        o.append(f'<text x="{left - 6}" y="{y + 11}" text-anchor="end">{name} x{n}</text>')
        o.append(f'<rect x="{left}" y="{y}" width="{we:.1f}" height="13" fill="#2b6cb0"/>')
        o.append(f'<rect x="{left}" y="{y}" width="{min(wl, we):.1f}" height="13" fill="#90cdf4"/>')
        o.append(f'<text x="{left + we + 4:.1f}" y="{y + 11}">{exp / 1e6:.3f} ms ({100 * exp / total:.1f}%)</text>')
    y0 = h_sum + 10
    o.append(f'<text x="8" y="{y0}" font-size="13">first {len(rows)} launches of the step ({span / 1e3:.1f} us): '
             f'light = before the block\'s wait returns, dark = after</text>')
    sc = (W - left - 20) / span if span else 1
    for i, l in enumerate(rows):
        y = y0 + 10 + row * i
        x = left + (l["start"] - rows[0]["start"]) * sc
        ready = l["wait"] if l["wait"] is not None else l["start"]
        xr = left + (ready - rows[0]["start"]) * sc
        xe = left + (l["end"] - rows[0]["start"]) * sc
        o.append(f'<text x="{left - 6}" y="{y + 9}" text-anchor="end">{label(l)}</text>')
        o.append(f'<rect x="{x:.1f}" y="{y}" width="{max(xr - x, 0.5):.1f}" height="{row - 2}" fill="#cbd5e0"/>')
        o.append(f'<rect x="{xr:.1f}" y="{y}" width="{max(xe - xr, 0.5):.1f}" height="{row - 2}" fill="#2f855a"/>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--last", help="the launch label (name[blocks]) that ends a step")
    ap.add_argument("--svg")
    ap.add_argument("--tsv")
    ap.add_argument("--window", type=int, default=40, help="launches in the Gantt")
    ap.add_argument("--quiet", action="store_true", help="only the summary")
    a = ap.parse_args()
    recs = load(a.trace)
    starts = sorted({r[3] for r in recs})
    res = min((b - a_ for a_, b in zip(starts, starts[1:]) if b > a_), default=0)
    ls = launches(recs)
    if not ls:
        sys.exit("no records")
    last = a.last or label(ls[-1])
    ss = steps(ls, last)
    if not ss:
        sys.exit(f"no complete step: fewer than two launches labelled {last} in {len(ls)} launches")
    lens = [s[-1]["end"] - s[0]["start"] for s in ss]
    counts = sorted({len(s) for s in ss})
    print(f"{len(recs)} block records, {len(ls)} launches, {len(ss)} complete steps ending at {last} "
          f"(launches per step: {counts}); timer step >= {res} ns")
    print("step ms: " + " ".join(f"{x / 1e6:.3f}" for x in lens))
    common = statistics.mode(len(s) for s in ss)
    cand = [s for s in ss if len(s) == common]
    cand.sort(key=lambda s: s[-1]["end"] - s[0]["start"])
    step = annotate(cand[len(cand) // 2])
    total = step[-1]["end"] - step[0]["start"]
    if not a.quiet:
        print("i\tkernel\tblocks\tsms\tstart_us\twait_us\tend_us\texposed_us\tlatency_us\tafter_us")
        for i, l in enumerate(step):
            t0 = step[0]["start"]
            w = "" if l["wait"] is None else f'{(l["wait"] - t0) / 1e3:.2f}'
            print(f'{i}\t{l["kernel"]}\t{l["blocks"]}\t{l["sms"]}\t{(l["start"] - t0) / 1e3:.2f}\t{w}\t'
                  f'{(l["end"] - t0) / 1e3:.2f}\t{l["exposed"] / 1e3:.2f}\t{l["latency"] / 1e3:.2f}\t{l["after"] / 1e3:.2f}')
    agg = defaultdict(lambda: [0, 0, 0])
    for l in step:
        s = agg[label(l)]
        s[0] += l["exposed"]
        s[1] += max(l["latency"], 0)
        s[2] += 1
    summary = sorted(((k, v[0], v[1], v[2]) for k, v in agg.items()), key=lambda x: -x[1])
    print(f"\nstep {total / 1e6:.3f} ms ({len(step)} launches); exposed time per kernel[blocks]:")
    print("kernel\tlaunches\texposed_ms\tshare\thand-over_ms\tper_launch_us")
    for k, e, lat, n in summary:
        print(f"{k}\t{n}\t{e / 1e6:.3f}\t{100 * e / total:.1f}%\t{lat / 1e6:.3f}\t{e / n / 1e3:.2f}")
    if a.tsv:
        with open(a.tsv, "w") as f:
            f.write("i\tkernel\tblocks\tstart_ns\twait_ns\tend_ns\texposed_ns\tlatency_ns\tafter_ns\n")
            t0 = step[0]["start"]
            for i, l in enumerate(step):
                w = "" if l["wait"] is None else l["wait"] - t0
                f.write(f'{i}\t{l["kernel"]}\t{l["blocks"]}\t{l["start"] - t0}\t{w}\t{l["end"] - t0}\t'
                        f'{l["exposed"]}\t{l["latency"]}\t{l["after"]}\n')
    if a.svg:
        svg(step, summary, a.window, a.svg)


if __name__ == "__main__":
    main()
