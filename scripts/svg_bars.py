"""Pieces of a self-contained SVG bar chart (shared by the chart scripts): the frame, a bar with its value
above it, the plot's horizontal percent grid, a dashed target line."""


def frame(w, h, pad, top, pw, ph, title, sub, extra=()):
    """The chart's opening lines: the `w` x `h` SVG, `title`, `sub` (grey), the `extra` lines, and the plot's
    border (`pw` x `ph` at (`pad`, `top`))."""
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
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
