"""helm/values.schema.json as `python -m router.helm_schema` writes it: tree.py's part with chart.py's
laid over it, as stable text (sorted keys, a final newline) that a test compares byte for byte
with the committed file."""
from __future__ import annotations

import json

from router.helm_schema import chart
from router.helm_schema.tree import Schema, tree_properties


def values_schema() -> Schema:
    """The chart's values schema: the config tree's values and the chart's own."""
    properties = _laid_over(tree_properties(), chart.PROPERTIES)
    return {**chart.HEADER, "properties": properties, "allOf": chart.RULES}


def schema_text() -> str:
    """values_schema() as the committed file holds it."""
    return json.dumps(values_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _laid_over(base: Schema, over: Schema) -> Schema:
    """`base` with `over`'s keys: mappings in both are merged, anything else is `over`'s."""
    merged = dict(base)
    for key, value in over.items():
        inner = base.get(key)
        merged[key] = _laid_over(inner, value) if isinstance(inner, dict) and \
            isinstance(value, dict) else value
    return merged
