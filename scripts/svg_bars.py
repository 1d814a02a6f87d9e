"""Pieces of a self-contained SVG bar chart (shared by the chart scripts): a bar with its value above it,
the plot's horizontal percent grid."""


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
