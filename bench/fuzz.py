"""The fuzzer's long run: random architectures exported int8 with no option.

Each seed of `tests/fuzz/generator.py` ends as one of: exported (and right
on unseen inputs: every op within its kernel's tolerance of `simulate`), a
named refusal before conversion, a named refusal after it, a verification
error, a crash (anything but an odmlq error, or the worker process killed by a
signal) or silently wrong (exported, then off on unseen inputs). Seeds run in
worker processes, so a LiteRT abort is recorded as a crash of that seed and
the run goes on.

With --mixed, each seed that exports is exported again with one or two of its
matmuls and convolutions kept in float or int16x8 (`run_case(case,
mixed=True)`): that export must also be right, and no further than 3 dB
below the one-line rule's from float ('worse_with_float').

With --family nnx_seq, every seed builds an NNX sequence model (nnx.Linear,
nnx.Einsum, norms, nnx.MultiHeadAttention blocks as Python layers or stacked
by nnx.vmap and applied by nnx.scan, 1-D nnx.Conv): a family the seeded draw
never picks, so the other families' seeds stay as measured.

Run:
  python bench/fuzz.py [--seeds 0:300] [--mixed] [--family nnx_seq] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _worker(seeds: list[int], mixed: bool = False, family: str | None = None) -> None:
    """Runs seeds in order; prints 'start <seed>' before and a JSON line after each."""
    import dataclasses
    import warnings

    warnings.simplefilter("ignore")
    from tests.fuzz.generator import make_case, run_case

    for seed in seeds:
        print(f"start {seed}", flush=True)
        case = make_case(seed, family)
        t = time.time()
        outcome = run_case(case, mixed=mixed)
        row = {**dataclasses.asdict(outcome), "description": case.description, "seconds": time.time() - t}
        print("result " + json.dumps(row), flush=True)


def run(seeds: list[int], mixed: bool = False, family: str | None = None) -> list[dict]:
    rows, todo = [], list(seeds)
    while todo:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", ",".join(map(str, todo))]
                                + (["--mixed"] if mixed else []) + (["--family", family] if family else []),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        current = None
        for line in proc.stdout:
            if line.startswith("start "):
                current = int(line.split()[1])
            elif line.startswith("result "):
                row = json.loads(line[len("result "):])
                rows.append(row)
                todo.remove(row["seed"])
                current = None
                print(f"{row['seed']:4d} {row['family']:8s} {row['kind']:27s} "
                      f"{'' if row['sqnr_db'] is None else format(row['sqnr_db'], '.1f'):>6s}  "
                      f"{row['detail'][:90]}", flush=True)
        code = proc.wait()
        if current is not None:  # the worker died inside a seed
            rows.append({"seed": current, "family": "?", "kind": "crash", "detail": f"worker exit {code}",
                         "sqnr_db": None, "description": "", "seconds": 0.0})
            todo.remove(current)
            print(f"{current:4d} crash (worker exit {code})", flush=True)
        elif code != 0 and todo:
            raise SystemExit(f"worker failed outside a seed (exit {code})")
    return rows


# An export this far from float is right (it computes what `simulate` says)
# but useless; the table lists them.
LOW_SQNR_DB = 15.0


def table(rows: list[dict]) -> str:
    kinds = collections.Counter(r["kind"] for r in rows)
    lines = ["| outcome | models | share |", "|---|---|---|"]
    from tests.fuzz.generator import OUTCOMES

    for kind in OUTCOMES:
        lines.append(f"| {kind} | {kinds.get(kind, 0)} | {100.0 * kinds.get(kind, 0) / max(len(rows), 1):.1f}% |")
    sqnr = sorted(r["sqnr_db"] for r in rows if r["kind"] == "exported" and r["sqnr_db"] is not None)
    if sqnr:
        lines.append("")
        lines.append(f"Exported: output SQNR vs float on unseen inputs, median {sqnr[len(sqnr) // 2]:.1f} dB, "
                     f"minimum {sqnr[0]:.1f} dB ({len(sqnr)} models).")
        low = sorted((r["sqnr_db"], r["seed"]) for r in rows
                     if r["kind"] == "exported" and r["sqnr_db"] is not None and r["sqnr_db"] < LOW_SQNR_DB)
        if low:
            lines.append(f"Exported but under {LOW_SQNR_DB:g} dB against float (right against simulate, "
                         "an accuracy problem): " + ", ".join(f"seed {s} {q:.1f} dB" for q, s in low) + ".")
    details = collections.Counter((r["kind"], r["detail"][:120]) for r in rows if r["kind"] != "exported")
    if details:
        lines.append("")
        lines.append("| outcome | what | models |")
        lines.append("|---|---|---|")
        for (kind, detail), n in details.most_common():
            lines.append(f"| {kind} | {detail.replace('|', '/')} | {n} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0:300", help="start:stop")
    parser.add_argument("--mixed", action="store_true", help="some ops in float or int16x8 (see above)")
    parser.add_argument("--family", default=None,
                        help="build every seed as this family (nnx_seq: NNX sequence models, drawn only so)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker([int(s) for s in args.worker.split(",")], args.mixed, args.family)
        return
    start, stop = (int(x) for x in args.seeds.split(":"))
    t = time.time()
    rows = run(list(range(start, stop)), args.mixed, args.family)
    print()
    print(f"seeds {start}:{stop}{', mixed rules' if args.mixed else ''}"
          f"{', family ' + args.family if args.family else ''}, {time.time() - t:.0f} s")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if any(r["kind"] in ("crash", "silently_wrong", "worse_with_float") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
