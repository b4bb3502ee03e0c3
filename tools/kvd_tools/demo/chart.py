"""Runs in the operator's shell: line charts written as PNG, with numpy and zlib only.

matplotlib is no dependency of kvd, so `kvd bench e2e|throughput --png PATH`
draw with this: a title, axes with numeric ticks and grid lines, one coloured
polyline with markers per series, a legend; text in a 3x5 pixel font, scaled.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

Image = npt.NDArray[np.uint8]
Color = tuple[int, int, int]

# 3x5 glyphs, rows top to bottom ('#' = ink). Lower case prints as upper case.
_GLYPHS = {
    "0": "###/#.#/#.#/#.#/###", "1": ".#./##./.#./.#./###", "2": "###/..#/###/#../###",
    "3": "###/..#/###/..#/###", "4": "#.#/#.#/###/..#/..#", "5": "###/#../###/..#/###",
    "6": "###/#../###/#.#/###", "7": "###/..#/..#/..#/..#", "8": "###/#.#/###/#.#/###",
    "9": "###/#.#/###/..#/###", "A": ".#./#.#/###/#.#/#.#", "B": "##./#.#/##./#.#/##.",
    "C": ".##/#../#../#../.##", "D": "##./#.#/#.#/#.#/##.", "E": "###/#../##./#../###",
    "F": "###/#../##./#../#..", "G": ".##/#../#.#/#.#/.##", "H": "#.#/#.#/###/#.#/#.#",
    "I": "###/.#./.#./.#./###", "J": "..#/..#/..#/#.#/.#.", "K": "#.#/#.#/##./#.#/#.#",
    "L": "#../#../#../#../###", "M": "#.#/###/###/#.#/#.#", "N": "##./#.#/#.#/#.#/#.#",
    "O": ".#./#.#/#.#/#.#/.#.", "P": "##./#.#/##./#../#..", "Q": ".#./#.#/#.#/##./.##",
    "R": "##./#.#/##./#.#/#.#", "S": ".##/#../.#./..#/##.", "T": "###/.#./.#./.#./.#.",
    "U": "#.#/#.#/#.#/#.#/###", "V": "#.#/#.#/#.#/#.#/.#.", "W": "#.#/#.#/###/###/#.#",
    "X": "#.#/#.#/.#./#.#/#.#", "Y": "#.#/#.#/.#./.#./.#.", "Z": "###/..#/.#./#../###",
    ".": ".../.../.../.../.#.", ",": ".../.../.../.#./#..", "%": "#.#/..#/.#./#../#.#",
    "-": ".../.../###/.../...", "(": ".#./#../#../#../.#.", ")": ".#./..#/..#/..#/.#.",
    "/": "..#/..#/.#./#../#..", ":": ".../.#./.../.#./...", "+": ".../.#./###/.#./...",
    "=": ".../###/.../###/...", " ": ".../.../.../.../...",
}  # fmt: skip
PALETTE: tuple[Color, ...] = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189))
_INK: Color = (30, 30, 30)
_GRID: Color = (225, 225, 225)


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]
    dashed: bool = False
    color: int | None = None  # index into PALETTE; default: the series' own position


def text(img: Image, x: int, y: int, s: str, color: Color = _INK, scale: int = 2) -> None:
    """Writes `s` with its top-left corner at (x, y); unknown characters print as blanks."""
    for i, ch in enumerate(s.upper()):
        rows = _GLYPHS.get(ch, _GLYPHS[" "]).split("/")
        for r, row in enumerate(rows):
            for c, bit in enumerate(row):
                if bit == "#":
                    x0, y0 = x + (i * 4 + c) * scale, y + r * scale
                    img[y0 : y0 + scale, x0 : x0 + scale] = color


def text_width(s: str, scale: int = 2) -> int:
    return len(s) * 4 * scale


def line(
    img: Image,
    p0: tuple[float, float],
    p1: tuple[float, float],
    color: Color,
    width: int = 2,
    dashed: bool = False,
) -> None:
    """A straight line of `width` pixels (every other 6-pixel stretch left out when dashed)."""
    n = int(max(abs(p1[0] - p0[0]), abs(p1[1] - p0[1]))) + 1
    for k, t in enumerate(np.linspace(0.0, 1.0, n)):
        if dashed and (k // 6) % 2:
            continue
        x = round(p0[0] + (p1[0] - p0[0]) * t) - width // 2
        y = round(p0[1] + (p1[1] - p0[1]) * t) - width // 2
        img[max(y, 0) : max(y + width, 0), max(x, 0) : max(x + width, 0)] = color


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    span = hi - lo if hi > lo else abs(hi) or 1.0
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    v = first
    while v < hi + step * 0.999:
        ticks.append(round(v, 10))
        v += step
    return ticks


def _label(v: float) -> str:
    if v == int(v):
        return f"{int(v)}"
    return f"{v:.2f}".rstrip("0")


def write_png(path: Path, img: Image) -> None:
    """`img` [height, width, 3] as an 8-bit RGB PNG (no filter, zlib-compressed)."""
    height, width, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
    path.write_bytes(png + chunk(b"IEND", b""))


def line_chart(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    series: Sequence[Series],
    width: int = 720,
    height: int = 440,
) -> None:
    """Draws `series` against shared axes (starting at 0 on y) and writes a PNG to `path`."""
    img: Image = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 80, width - 24, 48, height - 56
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x_ticks = nice_ticks(min(xs), max(xs))
    y_ticks = nice_ticks(0.0, max(ys) if ys else 1.0)
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x0) / ((x1 - x0) or 1) * (right - left),
            bottom - (y - y0) / ((y1 - y0) or 1) * (bottom - top),
        )

    for v in y_ticks:
        _, py = at(x0, v)
        line(img, (left, py), (right, py), _GRID, 1)
        label = _label(v)
        text(img, left - 8 - text_width(label), round(py) - 5, label)
    for v in x_ticks:
        px, _ = at(v, y0)
        line(img, (px, top), (px, bottom), _GRID, 1)
        label = _label(v)
        text(img, round(px) - text_width(label) // 2, bottom + 8, label)
    line(img, (left, bottom), (right, bottom), _INK, 2)
    line(img, (left, top), (left, bottom), _INK, 2)
    text(img, (width - text_width(title, 3)) // 2, 12, title, scale=3)
    text(img, (left + right - text_width(x_label)) // 2, height - 24, x_label)
    text(img, 8, top - 22, y_label)
    for i, s in enumerate(series):
        color = PALETTE[(i if s.color is None else s.color) % len(PALETTE)]
        pts = [at(x, y) for x, y in sorted(s.points)]
        for a, b in itertools.pairwise(pts):
            line(img, a, b, color, 3, s.dashed)
        for px, py in pts:
            img[round(py) - 3 : round(py) + 4, round(px) - 3 : round(px) + 4] = color
        ly = top + 8 + i * 18
        line(img, (left + 14, ly + 4), (left + 40, ly + 4), color, 3, s.dashed)
        text(img, left + 48, ly, s.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_png(path, img)
