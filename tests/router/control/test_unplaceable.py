"""An engine replica Ray cannot place (it asks for more CPUs than any node has) is named in
/health, with what it asks for and why no node takes it, within 30 s of the router answering,
instead of a silent wait; the app reports itself unavailable (503) meanwhile."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
from tests.support.serve_run import health, serve_run  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]


def test_unplaceable_replica_is_named_with_its_request_within_30s():
    began = time.monotonic()
    args = {"mode": "disaggregated", "num_prefill": 1, "num_decode": 1,
            "decode_resources": {"num_cpus": 64, "num_gpus": 0}}
    with serve_run(args, serving=False) as url:
        def named() -> dict | None:
            status, body = health(url)
            if body is None or status != 503 or "tiers" not in body:  # not while starting
                return None
            decode = body["tiers"]["decode"]["replicas"][0]
            return decode if "CPU: 64" in decode.get("detail", "") else None
        replica = wait_until(named, 30, 0.5, "/health naming the unplaced decode replica")
        waited = time.monotonic() - began
        _, body = health(url)
    assert replica["replica"] == "decode-0" and replica["state"] == "pending"
    assert replica["resources"]["num_cpus"] == 64
    assert "no node of the cluster has that much (the largest offers {CPU: 2})" \
        in replica["detail"]
    assert body["status"] == "unavailable" and body["tiers"]["decode"]["state"] == "pending"
    print(f"unplaced replica named {waited:.1f} s after `serve run` began")
