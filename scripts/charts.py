#!/usr/bin/env python3
"""charts.py — self-contained SVG charts (and text summaries) of deltaserve's measurements. Standard
library only.

  scripts/charts.py summary FILE.json...            print the figures of `deltaserve bench|soak|probe --json`
  scripts/charts.py decode-ab OUT.svg TITLE SUBTITLE TARGET_PCT LABEL=FILE[,FILE...]...
                                                    decode A/B of builds from `deltaserve bench --json` files:
                                                    % of the bandwidth roofline per decode point, one colour
                                                    per build (the mean over its files), a line at the target
  scripts/charts.py decode-attn BENCH_ATTENTION.log OUT.svg [SUBTITLE]
                                                    attn_decode_split vs attn_decode_mma from the output of
                                                    tests/bench_attention.rs: K/V read rate, % of copy rate
  scripts/charts.py decode-variants IN.tsv OUT.svg TITLE SUBTITLE ROOFLINE_MS TARGET_PCT
                                                    a bar per build variant (IN.tsv: `label<TAB>ms[,ms...]`
                                                    a line, # comments): share of the bandwidth roofline
  scripts/charts.py spec OUT.svg BENCH.json...      speculative step costs (`bench --speculative-tokens K`)
  scripts/charts.py step-phases BENCH.json OUT.svg TITLE
                                                    where a decode step's wall time goes (`bench --phases`)
  scripts/charts.py tp TP1.json TP2.json OUT.svg    one GPU vs tensor parallel 2 (`bench --json` files)
  scripts/charts.py timeline TRACE.csv[.gz] [--svg F] [--tsv F] [--last 'name[blocks]'] [--window N]
                                                    one decode step's kernel timeline from a
                                                    DELTASERVE_TRACE file (see `timeline --help`)
"""
import argparse
import csv
import gzip
import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict

# ---------------------------------------------------------------------------------------------------------
# SVG pieces shared by the bar charts.


def svg_open(w, h, font="sans-serif"):
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="{font}" font-size="11">'


def frame(w, h, pad, top, pw, ph, title, sub, extra=()):
    """The chart's opening lines: the `w` x `h` SVG, `title`, `sub` (grey), the `extra` lines, and the plot's
    border (`pw` x `ph` at (`pad`, `top`))."""
    return [svg_open(w, h),
            f'<text x="{pad}" y="24" font-size="14">{title}</text>',
            f'<text x="{pad}" y="42" fill="#555">{sub}</text>',
            *extra,
            f'<rect x="{pad}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']


def target_line(s, pad, top, pw, ph, target):
    """Appends to `s` a dashed red line across the plot at `target` percent, labelled at its right end."""
    y = top + ph - ph * target / 100
    s.append(f'<line x1="{pad}" y1="{y:.1f}" x2="{pad + pw}" y2="{y:.1f}" stroke="#c33" stroke-dasharray="6 4"/>')
    s.append(f'<text x="{pad + pw - 4}" y="{y - 4:.1f}" text-anchor="end" fill="#c33">target {target:.0f}%</text>')


def bar(s, x, bw, top, ph, bh, color, value, title=None):
    """Appends to `s` a bar of height `bh` standing on the plot's floor (`top + ph`), at `x`, `bw` wide,
    its `value` text above it and an optional hover `title`."""
    tip = f"<title>{title}</title>" if title else ""
    s.append(f'<rect x="{x:.1f}" y="{top + ph - bh:.1f}" width="{bw:.1f}" height="{bh:.1f}" fill="{color}">{tip}</rect>')
    s.append(f'<text x="{x + bw / 2:.1f}" y="{top + ph - bh - 4:.1f}" text-anchor="middle">{value}</text>')


def percent_grid(s, pad, top, pw, ph, pcts):
    """Appends to `s` a light line and a left label at each percentage in `pcts` of the plot (`pw` x `ph`
    at (`pad`, `top`), 100% at its top)."""
    for pct in pcts:
        y = top + ph - ph * pct / 100
        s.append(f'<line x1="{pad}" y1="{y:.1f}" x2="{pad + pw}" y2="{y:.1f}" stroke="#ddd"/>')
        s.append(f'<text x="{pad - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#777">{pct}%</text>')


def write_svg(path, lines):
    lines.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def load_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------
# summary: the figures of a bench, soak or probe JSON file, one line each.


def summary(a):
    for path in a.files:
        try:
            d = load_json(path)
        except (OSError, ValueError) as e:
            print(f"{path}: {e}")
            continue
        print(f"== {path}")
        if "decode" in d or "prefill" in d:
            print("gpu", d.get("gpu"), "tensor_parallel", d.get("tensor_parallel"), "model", d.get("model"))
            print("ceilings", d.get("ceilings"))
            for r in d.get("prefill", []):
                print("prefill", r["tokens"], r["tokens_per_s"], "tok/s", r.get("roofline_ratio"),
                      "allreduce", r.get("allreduce_share"), r.get("driver_peak_bytes"))
            for r in d.get("decode", []):
                print("decode b", r["batch"], "ctx", r["context"], r["ms_per_step"], "ms", r.get("roofline_ratio"),
                      "argmax", r.get("ms_per_step_argmax"), "allreduce", r.get("allreduce_share"))
            for r in d.get("verify", []):
                print("verify-shaped", r)
            for r in d.get("speculative", []):
                print("spec", r)
            print("snapshots", d.get("snapshots_ms"), "plan", d.get("plan_bytes"), "driver peak",
                  d.get("driver_peak_bytes"), "skipped", d.get("skipped"))
        elif "rungs" in d:
            for r in d["rungs"] + d.get("turns", []):
                print(r)
            print("passed", d.get("passed"), d.get("failures"), "plan", d.get("plan_bytes"))
        elif "turns" in d:
            for t in d["turns"]:
                print(t["turn"], t["prompt_tokens"], t["cached_tokens"], t["new_tokens"], round(t["ttft_ms"], 1),
                      round(t["ttft_per_new_token_ms"], 4))
            print(d.get("summary"))
        else:
            print(json.dumps(d)[:2000])


# ---------------------------------------------------------------------------------------------------------
# decode-ab: builds side by side over the decode points of `bench --json` files.

AB_COLORS = ["#b0b0b0", "#9db7e0", "#2f5fb3", "#e0a040"]


def decode_means(files):
    """(batch, context) -> (mean ms per step, mean % of the roofline) over the files."""
    acc = {}
    for f in files:
        for r in load_json(f)["decode"]:
            acc.setdefault((r["batch"], r["context"]), []).append((r["ms_per_step"], 100 * r["roofline_ratio"]))
    return {k: (sum(v[0] for v in vs) / len(vs), sum(v[1] for v in vs) / len(vs)) for k, vs in acc.items()}


def decode_ab(a):
    builds = [(b.split("=", 1)[0], decode_means(b.split("=", 1)[1].split(","))) for b in a.builds]
    points = sorted({p for _, d in builds for p in d}, key=lambda p: (p[1], p[0]))
    w, h, pad, top = 960, 400, 60, 80
    pw, ph = w - 2 * pad, h - top - 70
    slot = pw / max(len(points), 1)
    legend = " · ".join(f'<tspan fill="{AB_COLORS[i % len(AB_COLORS)]}">■</tspan> {n}' for i, (n, _) in enumerate(builds))
    s = frame(w, h, pad, top, pw, ph, a.title, a.subtitle,
              [f'<text x="{pad}" y="60">{legend} · bars: % of the bandwidth roofline (value: ms per step)</text>'])
    percent_grid(s, pad, top, pw, ph, (20, 40, 60, 80, 100))
    target_line(s, pad, top, pw, ph, a.target)
    for i, p in enumerate(points):
        bw = slot * 0.7 / max(len(builds), 1)
        x0 = pad + i * slot + slot * 0.15
        for j, (name, d) in enumerate(builds):
            if p not in d:
                continue
            ms, pct = d[p]
            bar(s, x0 + j * bw, bw, top, ph, ph * min(pct, 100) / 100, AB_COLORS[j % len(AB_COLORS)], f"{ms:.2f}",
                f"{name} b{p[0]} @ {p[1]}: {ms:.3f} ms, {pct:.1f}% of the roofline")
        s.append(f'<text x="{x0 + 0.35 * slot:.1f}" y="{top + ph + 16}" text-anchor="middle">b{p[0]} @ {p[1] // 1024}K</text>')
    write_svg(a.out, s)


# ---------------------------------------------------------------------------------------------------------
# decode-attn: the two decode attention kernels from tests/bench_attention.rs output.


def parse_attn_log(path):
    """label -> {kernel: share of copy}; bf16 rows are (cap, batch) at 32K, quantised-cache rows (fp8,
    int4) (context, batch)."""
    out, section = {}, None
    for line in open(path):
        q = re.match(r"attn_decode (\w+) K/V", line)
        if line.startswith("attn_decode, "):
            section = "bf16 @32K"
        elif q:
            section = q.group(1)
        m = re.match(r"\s*(attn_decode_\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+(\d+)%", line)
        if not m or section is None:
            continue
        kernel, x, b, _us, _gbs, pct = m.groups()
        label = f"bf16 32K b{b} p{x}" if section == "bf16 @32K" else f"{section} {int(x) // 1024}K b{b}"
        out.setdefault(label, {})[kernel] = int(pct)
    return out


def decode_attn(a):
    rows = parse_attn_log(a.log)
    labels = list(rows)
    w, h, pad, top = 1240, 400, 60, 80
    pw, ph = w - 2 * pad, h - top - 70
    slot = pw / max(len(labels), 1)
    s = frame(w, h, pad, top, pw, ph, "Decode attention at the 27B shape: K/V read rate, % of the copy rate",
              f"{a.subtitle} · light: attn_decode_split · dark: attn_decode_mma (tensor cores)"
              " · bf16 labels: batch, partition cap")
    percent_grid(s, pad, top, pw, ph, (25, 50, 75, 100))
    for i, lab in enumerate(labels):
        x0 = pad + i * slot + slot * 0.15
        bw = slot * 0.34
        for j, (k, color) in enumerate([("attn_decode_split", "#9db7e0"), ("attn_decode_mma", "#2f5fb3")]):
            v = rows[lab].get(k)
            if v is None:
                continue
            bar(s, x0 + j * bw, bw, top, ph, ph * min(v, 100) / 100, color, v, f"{lab} {k}: {v}% of copy")
        s.append(f'<text x="{x0 + bw:.1f}" y="{top + ph + 16}" text-anchor="middle">{lab}</text>')
    write_svg(a.out, s)


# ---------------------------------------------------------------------------------------------------------
# decode-variants: a bar per build variant from a TSV of step times.


def decode_variants(a):
    rows = []
    for line in open(a.tsv):
        if line.strip() and not line.startswith("#"):
            label, ms = line.rstrip("\n").split("\t")
            vals = [float(v) for v in ms.split(",")]
            rows.append((label, sum(vals) / len(vals)))
    w, h, pad, top = 960, 460, 60, 70
    pw, ph = w - 2 * pad, h - top - 130
    slot = pw / max(len(rows), 1)
    s = frame(w, h, pad, top, pw, ph, a.title, a.subtitle)
    percent_grid(s, pad, top, pw, ph, (20, 40, 60, 80, 100))
    target_line(s, pad, top, pw, ph, a.target)
    for i, (label, ms) in enumerate(rows):
        pct = 100 * a.roofline_ms / ms
        x = pad + i * slot + slot * 0.2
        color = "#b0b0b0" if label.startswith("bound:") else "#2f5fb3"
        bar(s, x, slot * 0.6, top, ph, ph * min(pct, 100) / 100, color, f"{ms:.2f} ms", f"{label}: {pct:.1f}%")
        cx, cy = x + slot * 0.3, top + ph + 12
        s.append(f'<text x="{cx:.1f}" y="{cy}" text-anchor="end" transform="rotate(-35 {cx:.1f} {cy})">{label}</text>')
    write_svg(a.out, s)


# ---------------------------------------------------------------------------------------------------------
# spec: speculative step costs against plain decode.

SPEC_COLORS = {"draft": "#8e6bbf", "verify": "#3b7dd8", "commit": "#e0a030"}


def spec(a):
    """One bar per (K, batch, context): the MTP draft, the verify forward and the commit stacked, against the
    one-token decode step of the same run (a tick at 1x decode) and the break-even of 2.5 and 3 tokens per
    step (ticks where the step would cost 2.5x and 3x a decode step)."""
    rows = []
    for p in a.benches:
        d = load_json(p)
        rows += [(r, d["gpu"]) for r in d.get("speculative", [])]
    if not rows:
        sys.exit("no speculative rows in " + ", ".join(a.benches))
    rows.sort(key=lambda x: (x[0]["draft_tokens"], x[0]["context"], x[0]["batch"]))
    left, bar_h, gap, width, top = 210, 22, 12, 560, 70
    scale_ms = max(max(r["step_ms"], 3 * r["decode_ms_per_step"]) for r, _ in rows) * 1.05

    def px(ms):
        return left + ms / scale_ms * width

    h = top + len(rows) * (bar_h + gap) + 60
    s = [svg_open(left + width + 40, h),
         f'<text x="10" y="20" font-size="14">Speculative decoding step (MTP draft + verify + commit) vs plain decode — {rows[0][1]}</text>',
         '<text x="10" y="38" fill="#555">27B shapes, random weights; ticks: 1× decode step (black), 2.5× and 3× (grey: break-even at that many tokens per step)</text>']
    x = left
    for name, c in SPEC_COLORS.items():
        s.append(f'<rect x="{x}" y="48" width="12" height="10" fill="{c}"/><text x="{x + 16}" y="57">{name}</text>')
        x += 80
    for i, (r, _) in enumerate(rows):
        y = top + i * (bar_h + gap)
        s.append(f'<text x="10" y="{y + 15}">K={r["draft_tokens"]} batch {r["batch"]} @ {r["context"] // 1024}K</text>')
        x0 = 0.0
        for name, key in (("draft", "draft_ms"), ("verify", "verify_ms"), ("commit", "commit_ms")):
            w = r[key] / scale_ms * width
            s.append(f'<rect x="{px(x0):.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{SPEC_COLORS[name]}"><title>{name} {r[key]:.2f} ms</title></rect>')
            x0 += r[key]
        s.append(f'<text x="{px(x0) + 4:.1f}" y="{y + 15}">{r["step_ms"]:.1f} ms (×{r["speedup_at_3_tokens"]:.2f} at 3 tok/step)</text>')
        for mult, col in ((1, "#000"), (2.5, "#999"), (3, "#999")):
            xx = px(mult * r["decode_ms_per_step"])
            s.append(f'<line x1="{xx:.1f}" y1="{y - 3}" x2="{xx:.1f}" y2="{y + bar_h + 3}" stroke="{col}" stroke-width="2"/>')
    y = top + len(rows) * (bar_h + gap) + 10
    for t in range(0, int(scale_ms) + 1, 10):
        s.append(f'<line x1="{px(t):.1f}" y1="{y}" x2="{px(t):.1f}" y2="{y + 5}" stroke="#000"/><text x="{px(t) - 6:.1f}" y="{y + 18}">{t}</text>')
    s.append(f'<text x="{left + width / 2 - 20}" y="{y + 34}">ms per step</text>')
    write_svg(a.out, s)
    print("wrote", a.out)


# ---------------------------------------------------------------------------------------------------------
# batches: decode ms per step by batch size, one line per bench run (the cliff chart).

BATCH_COLORS = ["#2f5fb3", "#c0504d", "#7a7a7a", "#e0a030"]


def batches(a):
    """Decode ms per step (greedy, launched ahead where measured) by batch at the first context, one line per
    bench JSON file (labelled by its file name), on a log2 batch axis; prints each run's table and the ratio
    of each batch's step to the previous batch's."""
    runs = []
    for p in a.benches:
        d = load_json(p)
        pts = {}
        for r in d.get("decode", []):
            ms = r.get("ms_per_step_argmax_ahead") or r.get("ms_per_step_argmax") or r["ms_per_step"]
            pts.setdefault(r["batch"], ms)
        if pts:
            runs.append((os.path.basename(p).removesuffix(".json"), sorted(pts.items()), d["gpu"]))
    if not runs:
        sys.exit("no decode rows in " + ", ".join(a.benches))
    for name, pts, _ in runs:
        steps = " ".join(f"b{b} {ms:.2f}" + (f" (x{ms / pts[i - 1][1]:.2f})" if i else "") for i, (b, ms) in enumerate(pts))
        print(f"{name}: {steps}")
    pad, top, pw, ph = 60, 70, 560, 300
    bs = sorted({b for _, pts, _ in runs for b, _ in pts})
    ymax = max(ms for _, pts, _ in runs for _, ms in pts) * 1.1
    lo, hi = math.log2(bs[0]), math.log2(bs[-1]) or 1

    def px(b):
        return pad + pw * (math.log2(b) - lo) / max(hi - lo, 1)

    def py(ms):
        return top + ph - ph * ms / ymax

    s = frame(pw + 2 * pad + 120, top + ph + 60, pad, top, pw, ph,
              f"Decode ms per step by batch — {runs[0][2]}", "27B shapes, random weights, context 1K, greedy")
    for t in range(0, int(ymax) + 1, max(1, int(ymax) // 8)):
        s.append(f'<line x1="{pad}" y1="{py(t):.1f}" x2="{pad + pw}" y2="{py(t):.1f}" stroke="#eee"/>')
        s.append(f'<text x="{pad - 6}" y="{py(t) + 4:.1f}" text-anchor="end" fill="#777">{t}</text>')
    for b in bs:
        s.append(f'<text x="{px(b):.1f}" y="{top + ph + 16}" text-anchor="middle" fill="#777">{b}</text>')
    s.append(f'<text x="{pad + pw / 2}" y="{top + ph + 34}" text-anchor="middle">sequences per step</text>')
    s.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" text-anchor="middle">ms per step</text>')
    for i, (name, pts, _) in enumerate(runs):
        c = BATCH_COLORS[i % len(BATCH_COLORS)]
        path = " ".join(f"{px(b):.1f},{py(ms):.1f}" for b, ms in pts)
        s.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        for b, ms in pts:
            s.append(f'<circle cx="{px(b):.1f}" cy="{py(ms):.1f}" r="3" fill="{c}"><title>{name} b{b}: {ms:.2f} ms</title></circle>')
        s.append(f'<text x="{pad + pw + 8}" y="{top + 14 + 16 * i}" fill="{c}">{name}</text>')
    write_svg(a.out, s)
    print("wrote", a.out)


# ---------------------------------------------------------------------------------------------------------
# step-phases: host work, uploads, forward and outputs of each decode point (`bench --phases`).

PHASES = [
    ("host: building the inputs", "#9a9a9a"),
    ("uploads + launch, until the forward starts", "#e0a030"),
    ("forward (GPU)", "#2f5fb3"),
    ("outputs to the host", "#c0504d"),
    ("rest of the step", "#d8d8d8"),
]


def step_phases(a):
    rows = load_json(a.bench)["phases"]
    w, pad, top, lab, bh, gap = 980, 20, 64, 190, 22, 10
    h = top + len(rows) * (bh + gap) + 70
    longest = max(r["wall_ms"] for r in rows)
    pw = w - pad - lab - 90
    sub = "medians over the timed steps; bar length: the step's wall time"
    s = [svg_open(w, h),
         f'<text x="{pad}" y="24" font-size="14">{a.title}</text>',
         f'<text x="{pad}" y="42" fill="#555">{sub}</text>']
    for i, r in enumerate(rows):
        y = top + i * (bh + gap)
        parts = [r["host_prep_ms"], r["gpu_inputs_ms"], r["gpu_forward_ms"], r["output_ms"]]
        parts.append(max(r["wall_ms"] - sum(parts), 0.0))
        s.append(f'<text x="{pad + lab - 8}" y="{y + bh * 0.7:.1f}" text-anchor="end">'
                 f'batch {r["batch"]} @ {r["context"]}, {r["output"]}</text>')
        x = pad + lab
        for (name, color), ms in zip(PHASES, parts):
            bw = pw * ms / longest
            s.append(f'<rect x="{x:.1f}" y="{y}" width="{bw:.2f}" height="{bh}" fill="{color}">'
                     f'<title>{name}: {ms:.3f} ms</title></rect>')
            x += bw
        s.append(f'<text x="{x + 6:.1f}" y="{y + bh * 0.7:.1f}">{r["wall_ms"]:.3f} ms</text>')
    y = top + len(rows) * (bh + gap) + 14
    x = pad
    for name, color in PHASES:
        s.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{color}"/>')
        s.append(f'<text x="{x + 16}" y="{y + 10}">{name}</text>')
        x += 24 + 6.2 * len(name)
    write_svg(a.out, s)


# ---------------------------------------------------------------------------------------------------------
# tp: one GPU against tensor parallel 2.


def tp_rows(d):
    out = [(f"prefill {r['tokens'] // 1024}K", r["tokens_per_s"]) for r in d["prefill"]]
    out += [(f"decode b{r['batch']} @{r['context'] // 1024}K", r["tokens_per_s"]) for r in d["decode"]]
    return out


def tp(a):
    one, two = load_json(a.tp1), load_json(a.tp2)
    ra, rb = tp_rows(one), tp_rows(two)
    vb = dict(rb)
    labels = [x[0] for x in ra if x[0] in vb]
    va = dict(ra)
    w, h, pad, top = 860, 390, 60, 80
    pw, ph = w - 2 * pad, h - top - 60
    slot = pw / max(len(labels), 1)
    s = frame(w, h, pad, top, pw, ph,
              "deltaserve, 27B shapes (bf16, random weights): one GPU vs tensor parallel 2",
              f"{one['gpu']} · bars: tokens/s; label: TP=2 speed-up (each pair scaled to its larger bar)")
    for i, lab in enumerate(labels):
        group = [va[lab], vb[lab]]
        # Prefill and decode differ by 1000x: scale each group to its own larger bar.
        m = max(group)
        x0 = pad + i * slot + slot * 0.15
        bw = slot * 0.33
        for j, (v, color) in enumerate(zip(group, ["#9db7e0", "#2f5fb3"])):
            bar(s, x0 + j * bw, bw, top, ph, 0.88 * ph * v / m, color, f"{v:.0f}", f"{lab} TP={j + 1}: {v:.0f} tok/s")
        s.append(f'<text x="{x0 + bw:.1f}" y="{top + ph + 16}" text-anchor="middle">{lab}</text>')
        s.append(f'<text x="{x0 + bw:.1f}" y="{top + ph + 32}" text-anchor="middle" font-weight="bold">{vb[lab] / va[lab]:.2f}×</text>')
    s.append(f'<rect x="{pad}" y="52" width="10" height="10" fill="#9db7e0"/><text x="{pad + 15}" y="61">TP=1 (one GPU)</text>')
    s.append(f'<rect x="{pad + 120}" y="52" width="10" height="10" fill="#2f5fb3"/><text x="{pad + 135}" y="61">TP=2 (two GPUs)</text>')
    write_svg(a.out, s)


# ---------------------------------------------------------------------------------------------------------
# timeline: one decode step's kernel timeline from a DELTASERVE_TRACE file (crates/cuda/src/trace.rs).

TIMELINE_HELP = """Records are blocks (kernel, block, SM, start / wait-return / end in ns). The blocks of one kernel are
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

  DELTASERVE_TRACE=/tmp/t.csv deltaserve bench --batches 1 --contexts 1024 --steps 8 ...
  scripts/charts.py timeline /tmp/t.csv --svg step.svg --tsv step.tsv
"""

# A block that starts this long after every block of the current launch has ended begins a new one
# (the next launch's first block may have an index the current grid lacks).
GAP_NS = 2000


def load_trace(path):
    recs = []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for r in csv.DictReader(f):
            recs.append((r["kernel"], int(r["block"]), int(r["sm"]), int(r["start_ns"]), int(r["wait_ns"]),
                         int(r["end_ns"])))
    return recs


def launches(recs):
    by_kernel = defaultdict(list)
    for r in recs:
        by_kernel[r[0]].append(r)
    out = []
    for rs in by_kernel.values():
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


def launch_label(l):
    return f'{l["kernel"]}[{l["blocks"]}]'


def split_steps(ls, last):
    idx = [i for i, l in enumerate(ls) if launch_label(l) == last]
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


def timeline_svg(step, kernels, window, path):
    total = step[-1]["end"] - step[0]["start"]
    W, left, row = 1100, 260, 12
    rows = step[:window]
    h_sum = 18 * len(kernels) + 40
    H = h_sum + row * len(rows) + 80
    span = max(l["end"] for l in rows) - rows[0]["start"] if rows else 1
    o = [svg_open(W, H, "monospace"),
         f'<text x="8" y="16" font-size="13">decode step {total / 1e6:.3f} ms: exposed time per kernel '
         f'(sums to the step); dark = after the hand-over, light = hand-over latency</text>']
    xmax = max(k[1] for k in kernels) or 1
    for i, (name, exp, lat, n) in enumerate(kernels):
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
        o.append(f'<text x="{left - 6}" y="{y + 9}" text-anchor="end">{launch_label(l)}</text>')
        o.append(f'<rect x="{x:.1f}" y="{y}" width="{max(xr - x, 0.5):.1f}" height="{row - 2}" fill="#cbd5e0"/>')
        o.append(f'<rect x="{xr:.1f}" y="{y}" width="{max(xe - xr, 0.5):.1f}" height="{row - 2}" fill="#2f855a"/>')
    write_svg(path, o)


def print_launches(step):
    t0 = step[0]["start"]
    print("i\tkernel\tblocks\tsms\tstart_us\twait_us\tend_us\texposed_us\tlatency_us\tafter_us")
    for i, l in enumerate(step):
        w = "" if l["wait"] is None else f'{(l["wait"] - t0) / 1e3:.2f}'
        print(f'{i}\t{l["kernel"]}\t{l["blocks"]}\t{l["sms"]}\t{(l["start"] - t0) / 1e3:.2f}\t{w}\t'
              f'{(l["end"] - t0) / 1e3:.2f}\t{l["exposed"] / 1e3:.2f}\t{l["latency"] / 1e3:.2f}\t{l["after"] / 1e3:.2f}')


def write_launches_tsv(step, path):
    t0 = step[0]["start"]
    with open(path, "w") as f:
        f.write("i\tkernel\tblocks\tstart_ns\twait_ns\tend_ns\texposed_ns\tlatency_ns\tafter_ns\n")
        for i, l in enumerate(step):
            w = "" if l["wait"] is None else l["wait"] - t0
            f.write(f'{i}\t{l["kernel"]}\t{l["blocks"]}\t{l["start"] - t0}\t{w}\t{l["end"] - t0}\t'
                    f'{l["exposed"]}\t{l["latency"]}\t{l["after"]}\n')


def timeline(a):
    recs = load_trace(a.trace)
    starts = sorted({r[3] for r in recs})
    res = min((b - x for x, b in zip(starts, starts[1:]) if b > x), default=0)
    ls = launches(recs)
    if not ls:
        sys.exit("no records")
    last = a.last or launch_label(ls[-1])
    ss = split_steps(ls, last)
    if not ss:
        sys.exit(f"no complete step: fewer than two launches labelled {last} in {len(ls)} launches")
    lens = [s[-1]["end"] - s[0]["start"] for s in ss]
    counts = sorted({len(s) for s in ss})
    print(f"{len(recs)} block records, {len(ls)} launches, {len(ss)} complete steps ending at {last} "
          f"(launches per step: {counts}); timer step >= {res} ns")
    print("step ms: " + " ".join(f"{x / 1e6:.3f}" for x in lens))
    common = statistics.mode(len(s) for s in ss)
    cand = sorted((s for s in ss if len(s) == common), key=lambda s: s[-1]["end"] - s[0]["start"])
    step = annotate(cand[len(cand) // 2])
    total = step[-1]["end"] - step[0]["start"]
    if not a.quiet:
        print_launches(step)
    agg = defaultdict(lambda: [0, 0, 0])
    for l in step:
        s = agg[launch_label(l)]
        s[0] += l["exposed"]
        s[1] += max(l["latency"], 0)
        s[2] += 1
    kernels = sorted(((k, v[0], v[1], v[2]) for k, v in agg.items()), key=lambda x: -x[1])
    print(f"\nstep {total / 1e6:.3f} ms ({len(step)} launches); exposed time per kernel[blocks]:")
    print("kernel\tlaunches\texposed_ms\tshare\thand-over_ms\tper_launch_us")
    for k, e, lat, n in kernels:
        print(f"{k}\t{n}\t{e / 1e6:.3f}\t{100 * e / total:.1f}%\t{lat / 1e6:.3f}\t{e / n / 1e3:.2f}")
    if a.tsv:
        write_launches_tsv(step, a.tsv)
    if a.svg:
        timeline_svg(step, kernels, a.window, a.svg)


# ---------------------------------------------------------------------------------------------------------


def command(sub, name, run, help, *args, **kw):
    """A subcommand `name` that calls `run`; each of `args` is a positional name or (name, options)."""
    p = sub.add_parser(name, help=help, **kw)
    for arg in args:
        arg_name, opts = arg if isinstance(arg, tuple) else (arg, {})
        p.add_argument(arg_name, **opts)
    p.set_defaults(run=run)
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="chart", required=True, metavar="CHART")
    many = {"nargs": "+"}
    pct = ("target", {"type": float, "help": "target, % of the roofline"})
    command(sub, "summary", summary, "print the figures of bench / soak / probe JSON files", ("files", many))
    command(sub, "decode-ab", decode_ab, "decode A/B of builds from bench JSON files", "out", "title", "subtitle",
            pct, ("builds", {"nargs": "+", "metavar": "LABEL=FILE[,FILE...]"}))
    command(sub, "decode-attn", decode_attn, "decode attention kernels from bench_attention output", "log", "out",
            ("subtitle", {"nargs": "?", "default": ""}))
    command(sub, "decode-variants", decode_variants, "a bar per build variant from a TSV of step times", "tsv",
            "out", "title", "subtitle", ("roofline_ms", {"type": float}), pct)
    command(sub, "spec", spec, "speculative step costs from bench --speculative-tokens JSON files", "out",
            ("benches", many))
    command(sub, "batches", batches, "decode ms per step by batch from bench JSON files", "out", ("benches", many))
    command(sub, "step-phases", step_phases, "where a decode step's wall time goes (bench --phases JSON)", "bench",
            "out", "title")
    command(sub, "tp", tp, "TP=1 vs TP=2 from two bench JSON files", "tp1", "tp2", "out")
    p = command(sub, "timeline", timeline, "one decode step's kernel timeline from a DELTASERVE_TRACE file",
                "trace", description=TIMELINE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--last", help="the launch label (name[blocks]) that ends a step")
    p.add_argument("--svg")
    p.add_argument("--tsv")
    p.add_argument("--window", type=int, default=40, help="launches in the Gantt")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    a = ap.parse_args()
    a.run(a)


if __name__ == "__main__":
    main()
