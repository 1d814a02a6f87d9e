#!/usr/bin/env python3
"""Where a decode step's wall time goes, from `deltaserve bench --phases --json`, as one self-contained SVG:
a horizontal bar per (batch, context, logits | greedy), split into the host's work before its first upload,
the uploads and the launch until the forward starts on the GPU, the forward, the outputs' return, and the
rest of the wall time (the host after its outputs).

    scripts/step_phases_chart.py BENCH.json OUT.svg "title"
"""
import json
import sys

PARTS = [
    ("host: building the inputs", "#9a9a9a"),
    ("uploads + launch, until the forward starts", "#e0a030"),
    ("forward (GPU)", "#2f5fb3"),
    ("outputs to the host", "#c0504d"),
    ("rest of the step", "#d8d8d8"),
]


def main():
    src, out, title = sys.argv[1:4]
    rows = json.load(open(src))["phases"]
    w, pad, top, lab, bh, gap = 980, 20, 64, 190, 22, 10
    h = top + len(rows) * (bh + gap) + 70
    longest = max(r["wall_ms"] for r in rows)
    pw = w - pad - lab - 90
    sub = "medians over the timed steps; bar length: the step's wall time"
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
         f'<text x="{pad}" y="24" font-size="14">{title}</text>',
         f'<text x="{pad}" y="42" fill="#555">{sub}</text>']
    for i, r in enumerate(rows):
        y = top + i * (bh + gap)
        parts = [r["host_prep_ms"], r["gpu_inputs_ms"], r["gpu_forward_ms"], r["output_ms"]]
        parts.append(max(r["wall_ms"] - sum(parts), 0.0))
        s.append(f'<text x="{pad + lab - 8}" y="{y + bh * 0.7:.1f}" text-anchor="end">'
                 f'batch {r["batch"]} @ {r["context"]}, {r["output"]}</text>')
        x = pad + lab
        for (name, color), ms in zip(PARTS, parts):
            bw = pw * ms / longest
            s.append(f'<rect x="{x:.1f}" y="{y}" width="{bw:.2f}" height="{bh}" fill="{color}">'
                     f'<title>{name}: {ms:.3f} ms</title></rect>')
            x += bw
        s.append(f'<text x="{x + 6:.1f}" y="{y + bh * 0.7:.1f}">{r["wall_ms"]:.3f} ms</text>')
    y = top + len(rows) * (bh + gap) + 14
    x = pad
    for name, color in PARTS:
        s.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{color}"/>')
        s.append(f'<text x="{x + 16}" y="{y + 10}">{name}</text>')
        x += 24 + 6.2 * len(name)
    s.append("</svg>")
    open(out, "w").write("\n".join(s) + "\n")


if __name__ == "__main__":
    main()
