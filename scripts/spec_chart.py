#!/usr/bin/env python3
"""spec_chart.py — SVG of speculative step costs from `deltaserve bench --speculative-tokens K --json`.

One bar per (K, batch, context): the MTP draft, the verify forward and the commit stacked, against the
one-token decode step of the same run (a tick at 1× decode) and the break-even of 2.5 and 3 tokens per
step (ticks where the step would cost 2.5× and 3× a decode step: a bar ending left of a tick is faster
than plain decode at that acceptance). Stdlib only.

usage: spec_chart.py OUT.svg BENCH.json [BENCH.json ...]
"""
import json
import sys

out, paths = sys.argv[1], sys.argv[2:]
rows = []
for p in paths:
    d = json.load(open(p))
    rows += [(r, d["gpu"]) for r in d.get("speculative", [])]
if not rows:
    sys.exit("no speculative rows in " + ", ".join(paths))
rows.sort(key=lambda x: (x[0]["draft_tokens"], x[0]["context"], x[0]["batch"]))
colors = {"draft": "#8e6bbf", "verify": "#3b7dd8", "commit": "#e0a030"}
left, bar_h, gap, width = 210, 22, 12, 560
top = 70
scale_ms = max(max(r["step_ms"], 3 * r["decode_ms_per_step"]) for r, _ in rows) * 1.05
px = lambda ms: left + ms / scale_ms * width
h = top + len(rows) * (bar_h + gap) + 60
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 40}" height="{h}" font-family="sans-serif" font-size="11">',
       f'<text x="10" y="20" font-size="14">Speculative decoding step (MTP draft + verify + commit) vs plain decode — {rows[0][1]}</text>',
       '<text x="10" y="38" fill="#555">27B shapes, random weights; ticks: 1× decode step (black), 2.5× and 3× (grey: break-even at that many tokens per step)</text>']
x = left
for name, c in colors.items():
    svg.append(f'<rect x="{x}" y="48" width="12" height="10" fill="{c}"/><text x="{x + 16}" y="57">{name}</text>')
    x += 80
for i, (r, _) in enumerate(rows):
    y = top + i * (bar_h + gap)
    label = f'K={r["draft_tokens"]} batch {r["batch"]} @ {r["context"] // 1024}K'
    svg.append(f'<text x="10" y="{y + 15}">{label}</text>')
    x0 = 0.0
    for name, key in (("draft", "draft_ms"), ("verify", "verify_ms"), ("commit", "commit_ms")):
        w = r[key] / scale_ms * width
        svg.append(f'<rect x="{px(x0):.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colors[name]}"><title>{name} {r[key]:.2f} ms</title></rect>')
        x0 += r[key]
    svg.append(f'<text x="{px(x0) + 4:.1f}" y="{y + 15}">{r["step_ms"]:.1f} ms (×{r["speedup_at_3_tokens"]:.2f} at 3 tok/step)</text>')
    for mult, col in ((1, "#000"), (2.5, "#999"), (3, "#999")):
        xx = px(mult * r["decode_ms_per_step"])
        svg.append(f'<line x1="{xx:.1f}" y1="{y - 3}" x2="{xx:.1f}" y2="{y + bar_h + 3}" stroke="{col}" stroke-width="2"/>')
y = top + len(rows) * (bar_h + gap) + 10
for t in range(0, int(scale_ms) + 1, 10):
    svg.append(f'<line x1="{px(t):.1f}" y1="{y}" x2="{px(t):.1f}" y2="{y + 5}" stroke="#000"/><text x="{px(t) - 6:.1f}" y="{y + 18}">{t}</text>')
svg.append(f'<text x="{left + width / 2 - 20}" y="{y + 34}">ms per step</text></svg>')
open(out, "w").write("\n".join(svg))
print("wrote", out)
