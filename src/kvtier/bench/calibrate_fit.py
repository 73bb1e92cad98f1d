"""The fitting half of `kvtier calibrate`, plain Python: points of predicted vs
measured time, one correction per quantity fitted on part of them, and a `why` for each point the
corrected prediction still misses by more than 10%.

Per quantity the points sorted by prediction alternate between "fit" (first, last and every other
one) and "check" (held out). The fit is ``measured ~ overhead_ms + predicted_ms / efficiency``:
least squares on the relative error, the overhead kept >= 0 (else efficiency alone).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

QUANTITIES = ("h2d", "d2h", "decode", "prefill")
TOLERANCE_PCT = 10.0


@dataclass(slots=True)
class Point:
    quantity: str
    case: str
    predicted_ms: float
    measured_ms: float
    min_ms: float
    max_ms: float
    spread_pct: float  # (p90 - p10) / median of the measurement
    params: dict = field(default_factory=dict)
    role: str = "fit"  # "fit": used by the fit; "check": held out
    calibrated_ms: float | None = None
    why: str | None = None

    @property
    def error_pct(self) -> float:
        return (self.predicted_ms / self.measured_ms - 1) * 100

    @property
    def calibrated_error_pct(self) -> float | None:
        return None if self.calibrated_ms is None else (self.calibrated_ms / self.measured_ms - 1) * 100

    def to_json(self) -> dict:
        out = asdict(self)
        out |= {"error_pct": self.error_pct, "calibrated_error_pct": self.calibrated_error_pct}
        err = self.calibrated_error_pct
        out["within_tolerance"] = err is not None and abs(err) <= TOLERANCE_PCT
        return out


@dataclass(frozen=True, slots=True)
class Fit:
    """measured_ms ~ overhead_ms + predicted_ms / efficiency."""

    overhead_ms: float
    efficiency: float
    fit_points: int

    def apply(self, predicted_ms: float) -> float:
        return self.overhead_ms + predicted_ms / self.efficiency


def fit(pairs: list[tuple[float, float]]) -> Fit:
    """Least squares on relative error over (predicted_ms, measured_ms) pairs; overhead >= 0.
    With one pair, or when the free fit wants a negative overhead: efficiency only."""
    if not pairs or any(not (p > 0 and m > 0) for p, m in pairs):
        raise ValueError(f"pairs: need (predicted_ms, measured_ms) > 0, got {pairs!r}")
    rows = [(1 / m, p / m) for p, m in pairs]  # residual a * w + b * x - 1, w = 1/m, x = p/m
    sww = sum(w * w for w, _ in rows)
    swx = sum(w * x for w, x in rows)
    sxx = sum(x * x for _, x in rows)
    sw, sx = sum(w for w, _ in rows), sum(x for _, x in rows)
    det = sww * sxx - swx * swx
    if len(pairs) >= 2 and det > 1e-12 * sww * sxx:
        a, b = (sw * sxx - sx * swx) / det, (sww * sx - swx * sw) / det
        if a >= 0 and b > 0:
            return Fit(a, 1 / b, len(pairs))
    return Fit(0.0, sxx / sx, len(pairs))  # b = sx / sxx: through the origin


def assign_roles(points: list[Point]) -> None:
    """Per quantity, by predicted time: first, last and every other point fit; the rest check."""
    for q in QUANTITIES:
        mine = sorted((p for p in points if p.quantity == q), key=lambda p: p.predicted_ms)
        for i, p in enumerate(mine):
            p.role = "fit" if i % 2 == 0 or i == len(mine) - 1 else "check"


def calibrate(points: list[Point]) -> dict[str, Fit]:
    """Fit each quantity on its "fit" points, fill calibrated_ms and a why for each miss."""
    fits = {}
    for q in QUANTITIES:
        mine = [p for p in points if p.quantity == q]
        if not mine:
            continue
        fits[q] = fit([(p.predicted_ms, p.measured_ms) for p in mine if p.role == "fit"])
        lo = min(p.predicted_ms for p in mine if p.role == "fit")
        hi = max(p.predicted_ms for p in mine if p.role == "fit")
        for p in mine:
            p.calibrated_ms = fits[q].apply(p.predicted_ms)
            p.why = why(p, fits[q], lo, hi) if abs(p.calibrated_error_pct) > TOLERANCE_PCT else None
    return fits


def why(p: Point, f: Fit, lo: float, hi: float) -> str:
    """What the measurement says about a point the calibrated prediction misses by > 10%."""
    out = []
    if p.spread_pct > TOLERANCE_PCT:
        out.append(f"noisy measurement: p10-p90 spans {p.spread_pct:.0f}% of the median")
    if not lo <= p.predicted_ms <= hi:
        out.append(f"held out beyond the fitted range (fit points predict {lo:.3g}-{hi:.3g} ms)")
    share = f.overhead_ms / f.apply(p.predicted_ms)
    if share > 0.3:
        out.append(
            f"the fixed cost ({f.overhead_ms * 1e3:.0f} us) is {share:.0%} of it; its jitter is not modelled"
        )
    kv = p.params.get("kv_share")
    if p.quantity == "decode" and kv is not None and kv > 0.4:
        out.append(
            f"KV is {kv:.0%} of the step's bytes: attention reads KV at another fraction of HBM "
            "bandwidth than the weight GEMVs, and one efficiency covers both"
        )
    if p.quantity == "prefill" and p.params.get("bound") == "memory":
        out.append("a short prefill: memory- or launch-bound, not at the matmul rate the fit follows")
    if p.params.get("device") == "cpu":
        out.append("CPU dry run: caches, threads and Python overhead, not a roofline")
    if not out:
        sign = "slower" if p.measured_ms > f.apply(p.predicted_ms) else "faster"
        out.append(
            f"measured {sign} than the fitted line (overhead {f.overhead_ms:.3g} ms + predicted / "
            f"{f.efficiency:.3f}): this quantity is not affine in the roofline prediction here"
        )
    return "; ".join(out)


def p10(points: list[Point], device: str) -> dict:
    before = sum(abs(p.error_pct) <= TOLERANCE_PCT for p in points)
    misses = [
        {"case": p.case, "calibrated_error_pct": p.calibrated_error_pct, "why": p.why}
        for p in points
        if p.why is not None
    ]
    return {
        "target": f"within {TOLERANCE_PCT:g}% after calibration",
        "points": len(points),
        "within_before": before,
        "within_after": len(points) - len(misses),
        "status": "pass" if not misses else "miss",
        "misses": misses,
        "scope": "figures" if device == "cuda" else "CPU dry run of the method, not figures",
    }
