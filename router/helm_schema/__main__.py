"""`python -m router.helm_schema [--output helm/values.schema.json]`: print the chart's
values.schema.json as generated from the config tree, or write it (after changing a config
field)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from router.helm_schema.generate import schema_text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router.helm_schema",
                                 description="the Helm chart's values.schema.json, generated "
                                             "from the config models")
    ap.add_argument("-o", "--output", type=Path, default=None,
                    help="file to write, e.g. helm/values.schema.json (default: stdout)")
    args = ap.parse_args(argv)
    text = schema_text()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
