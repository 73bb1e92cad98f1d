"""Summary of ab_native.sh: per submit_overhead row, the median hot submit time (us) with the C
helpers (KVTIER_NATIVE=1) and without (=0), over the rounds, and the change."""

import glob
import json
import statistics
import sys


def main(out: str) -> None:
    by = {}  # (case, native) -> [submit_hot_us]
    for f in sorted(glob.glob(f"{out}/n[01]r*/*.json")):
        native = f.split("/")[-2][1]
        with open(f) as fh:
            rows = json.load(fh)["rows"]
        for row in rows:
            if row["suite"] == "submit_overhead" and "submit_hot_us" in row["params"]:
                by.setdefault((row["case"], native), []).append(row["params"]["submit_hot_us"])
    cases = sorted({c for c, _ in by}, key=lambda c: (c.split()[0], int(c.split()[1][2:]), c))
    print("| row | C helpers on (us) | off (us) | off / on |")
    print("| --- | --- | --- | --- |")
    for c in cases:
        on, off = by.get((c, "1")), by.get((c, "0"))
        if not on or not off:
            continue
        a, b = statistics.median(on), statistics.median(off)
        print(
            f"| {c} | {a:.1f} ({', '.join(f'{x:.0f}' for x in on)}) | {b:.1f} "
            f"({', '.join(f'{x:.0f}' for x in off)}) | {b / a:.2f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
