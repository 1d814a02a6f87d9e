"""One bar of a self-contained SVG bar chart, with its value above it (shared by the chart scripts)."""


def bar(s, x, bw, top, ph, bh, color, value, title=None):
    """Appends to `s` a bar of height `bh` standing on the plot's floor (`top + ph`), at `x`, `bw` wide,
    its `value` text above it and an optional hover `title`."""
    tip = f"<title>{title}</title>" if title else ""
    s.append(f'<rect x="{x:.1f}" y="{top + ph - bh:.1f}" width="{bw:.1f}" height="{bh:.1f}" fill="{color}">{tip}</rect>')
    s.append(f'<text x="{x + bw / 2:.1f}" y="{top + ph - bh - 4:.1f}" text-anchor="middle">{value}</text>')
