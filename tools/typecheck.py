"""The type gate: mypy over ``shardflow/`` against a checked-in baseline that may only shrink.

shardflow started checking types with 530 errors at mypy's default strictness (issue #34). Rather than silence
them, ``tools/mypy-baseline.txt`` lists each one as ``path: [code] message`` (no line numbers, so an edit above an
error does not move it). This script runs mypy and fails when

* an error is not in the baseline (new code must type-check), or
* a baseline entry no longer occurs (the baseline must shrink with the fixes: rewrite it).

    python tools/typecheck.py            # the gate (``make typecheck``, ``.ci/run``)
    python tools/typecheck.py --update   # rewrite the baseline after fixing errors (it may only get shorter)

Exit status 0 when the errors are exactly the baseline's, 1 otherwise (the differences listed), 2 when mypy itself
fails to run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tools" / "mypy-baseline.txt"
ERROR = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*?)\s+\[(?P<code>[\w-]+)\]$")


def errors() -> Counter[str]:
    """mypy's errors over shardflow/ (settings in pyproject.toml), as baseline entries with their counts."""
    run = subprocess.run([sys.executable, "-m", "mypy", "shardflow"], cwd=ROOT, capture_output=True, text=True)
    if run.returncode not in (0, 1):  # 1: type errors found; anything else: mypy could not check
        print(f"typecheck: mypy did not run (exit {run.returncode}):\n{run.stdout}{run.stderr}", file=sys.stderr)
        sys.exit(2)
    found: Counter[str] = Counter()
    for line in run.stdout.splitlines():
        if m := ERROR.match(line):
            message = re.sub(r"\bline \d+", "line N", m["message"])  # "already defined on line 12": no line numbers
            found[f"{m['path']}: [{m['code']}] {message}"] += 1
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--update", action="store_true", help="rewrite the baseline (it may only shrink)")
    args = p.parse_args(argv)
    found = errors()
    base = Counter(BASELINE.read_text().splitlines()) if BASELINE.exists() else Counter()
    if args.update:
        if BASELINE.exists() and (new := found - base):  # the first baseline is what there is
            print("typecheck: not writing a baseline that grows; fix these first:", *sorted(new), sep="\n  ")
            return 1
        BASELINE.write_text("".join(f"{e}\n" for e in sorted(found.elements())))
        print(f"typecheck: baseline rewritten, {sum(found.values())} errors ({sum(base.values())} before)")
        return 0
    new, fixed = found - base, base - found
    for title, entries in (
        ("new type errors (fix them)", new),
        ("fixed, still in the baseline (run python tools/typecheck.py --update)", fixed),
    ):
        if entries:
            print(f"typecheck: {sum(entries.values())} {title}:", *sorted(entries.elements()), sep="\n  ")
    if new or fixed:
        return 1
    print(f"typecheck: {sum(found.values())} errors, all in the baseline (tools/mypy-baseline.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
