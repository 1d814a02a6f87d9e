#!/usr/bin/env python3
"""TP=1 vs TP=2 from two `deltaserve bench --json` files: one self-contained SVG, grouped bars.

    scripts/tp_chart.py TP1.json TP2.json OUT.svg
"""
import json
import sys

from svg_bars import bar, frame


def rows(d):
    out = []
    for r in d["prefill"]:
        out.append((f"prefill {r['tokens'] // 1024}K", r["tokens_per_s"], "tok/s"))
    for r in d["decode"]:
        out.append((f"decode b{r['batch']} @{r['context'] // 1024}K", r["tokens_per_s"], "tok/s"))
    return out


def main():
    one, two, path = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
    a, b = rows(one), rows(two)
    labels = [x[0] for x in a if any(y[0] == x[0] for y in b)]
    va = {x[0]: x[1] for x in a}
    vb = {x[0]: x[1] for x in b}
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
            bh = 0.88 * ph * v / m
            bar(s, x0 + j * bw, bw, top, ph, bh, color, f"{v:.0f}", f"{lab} TP={j + 1}: {v:.0f} tok/s")
        s.append(f'<text x="{x0 + bw:.1f}" y="{top + ph + 16}" text-anchor="middle">{lab}</text>')
        s.append(f'<text x="{x0 + bw:.1f}" y="{top + ph + 32}" text-anchor="middle" font-weight="bold">{vb[lab] / va[lab]:.2f}×</text>')
    s.append(f'<rect x="{pad}" y="52" width="10" height="10" fill="#9db7e0"/><text x="{pad + 15}" y="61">TP=1 (one GPU)</text>')
    s.append(f'<rect x="{pad + 120}" y="52" width="10" height="10" fill="#2f5fb3"/><text x="{pad + 135}" y="61">TP=2 (two GPUs)</text>')
    s.append("</svg>")
    open(path, "w").write("\n".join(s) + "\n")


if __name__ == "__main__":
    main()
