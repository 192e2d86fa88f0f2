"""`speculative:` on every surface: EngineConfig / LLM, the Serve app's args (AppConfig),
the Helm chart's values, and the pd_spec_decode_* metrics the router exports."""
from __future__ import annotations

import pytest
import yaml
from prometheus_client import generate_latest
from tests.support.helm import CHART, only, run_helm, template

from actors.messages import ReplicaLoad
from pd_cluster import EngineConfig
from pd_cluster.spec_decode.decoder import SpecStats
from router.app_config import AppConfig
from router.metrics import SPEC_COUNTERS, RouterMetrics

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_engine_config_takes_speculative_and_names_bad_fields():
    cfg = EngineConfig.of(speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative.num_speculative_tokens == 3 and cfg.speculative.max_batch_size == 16
    assert EngineConfig.of().speculative is None
    with pytest.raises(ValueError, match="speculative: method draft_model needs draft_model"):
        EngineConfig.of(speculative={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative: prompt_lookup_min"):
        EngineConfig.of(speculative={"prompt_lookup_min": 5, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        EngineConfig.of(speculative={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative: unknown key"):
        EngineConfig.of(speculative={"k": 4})


def test_app_config_validates_engine_speculative():
    cfg = AppConfig.from_args({"engine": {"speculative": {"method": "ngram"}}})
    assert cfg.engine.speculative.method == "ngram"
    with pytest.raises(ValueError, match="engine.speculative.method"):
        AppConfig.from_args({"engine": {"speculative": {"method": "eagle"}}})
    with pytest.raises(ValueError, match="^engine.speculative: not supported with "
                                         "decode_tensor_parallel_size 2"):
        AppConfig.from_args({"engine": {"speculative": {"method": "ngram"}},
                             "decode_tensor_parallel_size": 2})


def test_helm_values_become_engine_speculative_in_snake_case(helm):
    rendered = template(helm, "--set", "engine.speculative.method=ngram",
                        "--set", "engine.speculative.numSpeculativeTokens=3",
                        "--set", "engine.speculative.maxBatchSize=8")
    serve = yaml.safe_load(only(rendered, "RayService")["spec"]["serveConfigV2"])
    args = serve["applications"][0]["args"]
    assert args["engine"]["speculative"] == {"method": "ngram", "num_speculative_tokens": 3,
                                             "max_batch_size": 8}
    assert AppConfig.from_args(args).engine.speculative.num_speculative_tokens == 3
    done = run_helm(helm, "template", "pd", str(CHART),
                    "--set", "engine.speculative.numSpeculativeTokenz=3")
    assert done.returncode != 0 and "numSpeculativeTokenz" in done.stderr


def test_router_exports_pd_spec_decode_metrics_per_replica():
    stats = SpecStats(steps=5, proposed=20, accepted=15, emitted=20, seq_fallbacks=1,
                      batch_fallbacks=2)
    metrics = RouterMetrics("m")
    metrics.set_loads([ReplicaLoad("decode", 0, spec_decode=stats.as_dict()),
                       ReplicaLoad("prefill", 0)])
    text = generate_latest(metrics.registry).decode()
    for name in SPEC_COUNTERS:
        assert f'pd_spec_decode_{name}_total{{replica="0",role="decode"}}' in text
    assert 'pd_spec_decode_accepted_total{replica="0",role="decode"} 15.0' in text
    assert 'pd_spec_decode_acceptance_rate{replica="0",role="decode"} 0.75' in text
    assert 'role="prefill"} ' not in text.split("pd_spec_decode_steps")[1].split("# HELP")[0]


@pytest.mark.slow
def test_usage_names_the_drafts_a_request_verified(default_model_dir):
    """The HTTP usage carries the request's draft counts (`spec_decode`) when its engine
    speculated, and stays OpenAI's own otherwise."""
    import dataclasses

    from pd_cluster.tokenizer import load_tokenizer
    from tests.support.scripted_router import complete, make_client

    client, engine = make_client(load_tokenizer(default_model_dir))
    scripted = engine.generate

    async def speculating(*args, **kwargs):
        async for out in scripted(*args, **kwargs):
            yield dataclasses.replace(out, spec_proposed_tokens=8, spec_accepted_tokens=5)

    with client:
        plain = complete(client, n=2, max_tokens=3).json()["usage"]
        engine.generate = speculating
        usage = complete(client, n=2, max_tokens=3).json()["usage"]
    assert "spec_decode" not in plain
    assert usage == {**plain, "spec_decode": {"proposed_tokens": 16, "accepted_tokens": 10}}


def test_draft_counts_add_up_across_a_re_run_on_another_replica():
    from actors.messages import StreamAccumulator, StreamDelta

    acc = StreamAccumulator("r", [1, 2])
    for proposed, accepted in [(4, 3), (8, 6), (2, 1)]:     # the third: another replica
        out = acc.add(StreamDelta([5], "x", None, False, None, None, 0, None, None,
                                  proposed, accepted))
    assert (out.spec_proposed_tokens, out.spec_accepted_tokens) == (10, 7)
