"""Check every sharding rule against the single-device result for every combination of input placements, and print
the table (the full sweep of :func:`shardflow.parallel.validate.validate_rules`, ~190 000 combinations, ~30–40 s
on 2 cores; the test suite runs a reduced set in tests/test_rule_validator.py).

Usage: python tools/validate_rules.py [--ops attention,linear] [--mesh dp=2,tp=2 ...] [--candidates]
Exit status 1 when any accepted combination computes a wrong result.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from shardflow.parallel.validate import DEFAULT_MESHES, validate_rules


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep the arguments ``argv`` choose; print progress on stderr and the table on stdout."""
    ap = argparse.ArgumentParser(
        prog="python tools/validate_rules.py",
        description="Check every sharding rule against the single-device result for every "
        "combination of input placements.",
    )
    ap.add_argument("--ops", help="comma-separated op kinds or case labels (default: all)")
    ap.add_argument("--mesh", action="append", help=f"a mesh such as dp=2,tp=2 (repeatable; default {DEFAULT_MESHES})")
    ap.add_argument("--max-combinations", type=int, help="sample at most this many combinations per op and mesh")
    ap.add_argument("--no-local-check", action="store_true", help="skip the locally-computable test of candidates")
    ap.add_argument("--candidates", action="store_true", help="also list every candidate with the rule's reason")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ops = [s.strip() for s in args.ops.split(",")] if args.ops else None
    report = validate_rules(
        ops,
        args.mesh,
        max_combinations=args.max_combinations,
        local_check=not args.no_local_check,
        seed=args.seed,
        progress=lambda r: print(
            f"  {r.label} on {r.mesh}: {r.tried} tried, {r.accepted} ok, {r.wrong} wrong ({r.seconds:.1f}s)",
            file=sys.stderr,
        ),
    )
    print(report.table())
    if args.candidates:
        print(f"\nvalid-but-rejected CANDIDATES ({len(report.candidates)}):")
        for f in report.candidates:
            print(f"  {f}")
    return 1 if report.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
