"""`kv_tiers:` of the app's args (router/app_sections.py KVTiersConfig, issue 47): off by
default, and a config the tiers cannot serve is refused with an error naming the field."""
from __future__ import annotations

import pytest

from pd_cluster.kv_tiers import TierSettings
from router.app_config import AppConfig


def test_kv_tiers_defaults_and_errors_name_the_field():
    tiers = AppConfig.from_args({}).kv_tiers
    assert not tiers.enabled and tiers.disk_path is None
    on = AppConfig.from_args({"mode": "colocated", "kv_tiers": {
        "enabled": True, "host_bytes": 2**30, "disk_path": "/var/cache/pd-kv",
        "disk_bytes": 2**34, "prefill_tokens_per_s": 20_000}}).kv_tiers
    settings = TierSettings.of(on)         # what the engines and the host tiers get
    assert (settings.host_bytes, settings.disk_path, settings.prefill_tokens_per_s) == (
        2**30, "/var/cache/pd-kv", 20_000)
    assert settings.host_blocks(2**20) == 1024
    for args, error in [
            ({"kv_tiers": {"disk_path": "kv"}}, "kv_tiers.disk_path: 'kv' must be an absolute"),
            ({"kv_tiers": {"host_bytes": 0}}, "kv_tiers.host_bytes"),
            ({"kv_tiers": {"disk_bytes": -1}}, "kv_tiers.disk_bytes"),
            ({"kv_tiers": {"host_gbps": 0}}, "kv_tiers.host_gbps"),
            ({"kv_tiers": {"size": 1}}, r"kv_tiers: unknown key\(s\) size"),
            ({"kv_tiers": {"enabled": True}, "engine": {"enable_prefix_caching": False}},
             "kv_tiers.enabled: needs engine.enable_prefix_caching"),
            ({"kv_tiers": {"enabled": True}, "decode_tensor_parallel_size": 2},
             "kv_tiers.enabled: not supported with decode_tensor_parallel_size 2")]:
        with pytest.raises(ValueError, match=error):
            AppConfig.from_args(args)
    with pytest.raises(ValueError, match="kv_tiers.host_bytes: 100 is below one KV block"):
        TierSettings(host_bytes=100).host_blocks(4096)
