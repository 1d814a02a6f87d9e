#!/usr/bin/env python3
"""Decode attention, attn_decode_split vs attn_decode_mma, from tests/bench_attention.rs output: one
self-contained SVG, grouped bars of K/V bytes per second as a share of the device copy rate.

    scripts/decode_attn_chart.py BENCH_ATTENTION.log OUT.svg "subtitle"
"""
import re
import sys

from svg_bars import bar, percent_grid


def parse(path):
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
        kernel, a, b, _us, _gbs, pct = m.groups()
        if section != "bf16 @32K":
            label = f"{section} {int(a) // 1024}K b{b}"
        else:
            label = f"bf16 32K b{b} p{a}"
        out.setdefault(label, {})[kernel] = int(pct)
    return out


def main():
    rows, path, sub = parse(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
    labels = list(rows)
    w, h, pad, top = 1240, 400, 60, 80
    pw, ph = w - 2 * pad, h - top - 70
    slot = pw / max(len(labels), 1)
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
         f'<text x="{pad}" y="24" font-size="14">Decode attention at the 27B shape: K/V read rate, % of the copy rate</text>',
         f'<text x="{pad}" y="42" fill="#555">{sub} · light: attn_decode_split · dark: attn_decode_mma (tensor cores)'
         ' · bf16 labels: batch, partition cap</text>',
         f'<rect x="{pad}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
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
    s.append("</svg>")
    open(path, "w").write("\n".join(s) + "\n")


if __name__ == "__main__":
    main()
