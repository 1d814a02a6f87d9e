#!/usr/bin/env python3
"""Decode A/B from `deltaserve bench --json` files: one self-contained SVG, grouped bars of the share of
the bandwidth roofline per decode point (batch @ context), one colour per build, the mean over each
build's files (rounds), and a line at the target.

    scripts/decode_ab_chart.py OUT.svg "title" "subtitle" TARGET_PCT LABEL=FILE[,FILE...] ...
"""
import json
import sys

from svg_bars import bar, frame, percent_grid, target_line

COLORS = ["#b0b0b0", "#9db7e0", "#2f5fb3", "#e0a040"]


def load(files):
    """(batch, context) -> (mean ms per step, mean % of the roofline) over the files."""
    acc = {}
    for f in files:
        for r in json.load(open(f))["decode"]:
            acc.setdefault((r["batch"], r["context"]), []).append((r["ms_per_step"], 100 * r["roofline_ratio"]))
    return {k: (sum(v[0] for v in vs) / len(vs), sum(v[1] for v in vs) / len(vs)) for k, vs in acc.items()}


def main():
    out, title, sub, target = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    builds = [(a.split("=", 1)[0], load(a.split("=", 1)[1].split(","))) for a in sys.argv[5:]]
    points = sorted({p for _, d in builds for p in d}, key=lambda p: (p[1], p[0]))
    w, h, pad, top = 960, 400, 60, 80
    pw, ph = w - 2 * pad, h - top - 70
    slot = pw / max(len(points), 1)
    legend = " · ".join(f'<tspan fill="{COLORS[i % len(COLORS)]}">■</tspan> {n}' for i, (n, _) in enumerate(builds))
    s = frame(w, h, pad, top, pw, ph, title, sub,
              [f'<text x="{pad}" y="60">{legend} · bars: % of the bandwidth roofline (value: ms per step)</text>'])
    percent_grid(s, pad, top, pw, ph, (20, 40, 60, 80, 100))
    target_line(s, pad, top, pw, ph, target)
    for i, p in enumerate(points):
        bw = slot * 0.7 / max(len(builds), 1)
        x0 = pad + i * slot + slot * 0.15
        for j, (name, d) in enumerate(builds):
            if p not in d:
                continue
            ms, pct = d[p]
            bar(s, x0 + j * bw, bw, top, ph, ph * min(pct, 100) / 100, COLORS[j % len(COLORS)], f"{ms:.2f}",
                f"{name} b{p[0]} @ {p[1]}: {ms:.3f} ms, {pct:.1f}% of the roofline")
        s.append(f'<text x="{x0 + 0.35 * slot:.1f}" y="{top + ph + 16}" text-anchor="middle">b{p[0]} @ {p[1] // 1024}K</text>')
    s.append("</svg>")
    open(out, "w").write("\n".join(s) + "\n")


if __name__ == "__main__":
    main()
