"""INFO lines of our own modules inside Serve replicas.

Serve sets up its own loggers only, so a module's INFO lines (replicas started, drained,
changing roles; the planner's decisions; the service ready at its URL) would be dropped:
log_info sends them to the replica's stderr, which `serve run` and Ray's log files show.
"""
from __future__ import annotations

import logging


def log_info(*names: str) -> None:
    for name in names:
        log = logging.getLogger(name)
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: "
                                                   "%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
