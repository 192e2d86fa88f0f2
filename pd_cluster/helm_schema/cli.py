"""`pd-cluster helm-schema`: print helm/values.schema.json as generated from the config tree, or
write it (`--output helm/values.schema.json` after changing a config field)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_helm_schema(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("helm-schema", help="the Helm chart's values.schema.json, generated "
                                           "from the config models")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="file to write, e.g. helm/values.schema.json (default: stdout)")
    p.set_defaults(func=_helm_schema)


def _helm_schema(args: argparse.Namespace) -> int:
    # Imported here: it imports the router's config, which no other subcommand needs.
    from pd_cluster.helm_schema.generate import schema_text

    text = schema_text()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0
