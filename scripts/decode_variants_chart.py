#!/usr/bin/env python3
"""Decode step time of build variants measured in one session, as one self-contained SVG: a bar per variant
(height: share of the bandwidth roofline, roofline ms / measured ms; value: the mean ms per step over its
rounds), and a line at the target.

    scripts/decode_variants_chart.py IN.tsv OUT.svg "title" "subtitle" ROOFLINE_MS TARGET_PCT

IN.tsv: one variant a line, `label<TAB>ms[,ms...]` (the rounds); lines starting with # are skipped.
"""
import sys

from svg_bars import bar, frame, percent_grid, target_line


def main():
    src, out, title, sub = sys.argv[1:5]
    roof, target = float(sys.argv[5]), float(sys.argv[6])
    rows = []
    for line in open(src):
        if line.strip() and not line.startswith("#"):
            label, ms = line.rstrip("\n").split("\t")
            vals = [float(v) for v in ms.split(",")]
            rows.append((label, sum(vals) / len(vals)))
    w, h, pad, top = 960, 460, 60, 70
    pw, ph = w - 2 * pad, h - top - 130
    slot = pw / max(len(rows), 1)
    s = frame(w, h, pad, top, pw, ph, title, sub)
    percent_grid(s, pad, top, pw, ph, (20, 40, 60, 80, 100))
    target_line(s, pad, top, pw, ph, target)
    for i, (label, ms) in enumerate(rows):
        pct = 100 * roof / ms
        x = pad + i * slot + slot * 0.2
        color = "#b0b0b0" if label.startswith("bound:") else "#2f5fb3"
        bar(s, x, slot * 0.6, top, ph, ph * min(pct, 100) / 100, color, f"{ms:.2f} ms", f"{label}: {pct:.1f}%")
        cx, cy = x + slot * 0.3, top + ph + 12
        s.append(f'<text x="{cx:.1f}" y="{cy}" text-anchor="end" transform="rotate(-35 {cx:.1f} {cy})">{label}</text>')
    s.append("</svg>")
    open(out, "w").write("\n".join(s) + "\n")


if __name__ == "__main__":
    main()
