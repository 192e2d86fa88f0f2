"""Speculative decoding on the decode side of disaggregation: D speculates once P's KV and
first token have landed, and greedy output equals a colocated engine that never speculates;
also after D dies mid-stream and the request continues on another D (migration)."""
import asyncio

import pytest

from tests.support.engine_clients import collect
from pd_cluster import LLM, SamplingParams
from router.routing import Route
from tests.support.disagg import Pair
from tests.support.spec_decode import GREEDY, loopy_model
from tests.support.tiny_models import mixed_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def draft_of(model_dir: str) -> dict:
    """A draft model with the target's weights: every draft is kept."""
    return {"method": "draft_model", "draft_model": model_dir, "num_speculative_tokens": 3,
            "draft_num_kv_blocks": 128}


@pytest.mark.slow
# A covering set of family x method: each family and each method once.
@pytest.mark.parametrize("family,method", [("llama_gqa", "ngram"),
                                           ("qwen3_qknorm", "draft_model")])
def test_disaggregated_speculation_equals_colocated_plain(family, method, tiny_model_root):
    model_dir = loopy_model(family, tiny_model_root)
    spec = NGRAM if method == "ngram" else draft_of(model_dir)
    prompts = mixed_prompts()
    plain = LLM(model_dir, block_size=4).generate(prompts, GREEDY)
    # A small KV cache on D: requests get preempted there and recomputed.
    pair = Pair(model_dir, block_size=4, max_num_batched_tokens=16, num_kv_blocks=48,
                speculative=spec)
    try:
        outs, _ = pair.run(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        stats = pair.d.spec.stats
        assert 0 < stats.accepted <= stats.proposed
        assert pair.p.spec.stats.proposed == 0          # P only prefills
        assert pair.d.scheduler.stats.num_preemptions > 0
        for eng in (pair.p, pair.d):
            assert eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        pair.close()


ray = pytest.importorskip("ray")
from tests.support.disagg import run_all, shutdown, start, wait_all_free  # noqa: E402


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("transport,method", [("nixl", "ngram"), ("ray", "draft_model")])
def test_actors_speculate_on_d_and_after_migration(transport, method, tiny_model_root):
    """Over real transports: D's output equals plain colocated output and D reports
    acceptance; then D dies mid-stream and the request continues, still speculating, on
    another D (which rebuilds its speculation state, the draft's KV included, from the
    tokens it gets)."""
    model_dir = loopy_model("llama_gqa", tiny_model_root)
    prompts = mixed_prompts()[:4]
    plain = [o.outputs[0].token_ids for o in LLM(model_dir).generate(prompts, GREEDY)]
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    expected = LLM(model_dir).generate([prompts[0]], long)[0].outputs[0].token_ids
    spec = NGRAM if method == "ngram" else draft_of(model_dir)
    client = start(model_dir, transport, num_d=2, speculative=spec)
    try:
        assert run_all(client, prompts, GREEDY) == plain
        accepted = {ld.replica_id: ld.spec_decode["accepted"]
                    for ld in asyncio.run(client.loads()) if ld.role == "decode"}
        assert sum(accepted.values()) > 0

        async def kill_after_some(out):
            if len(out.outputs[0].token_ids) >= 30 and not getattr(kill_after_some, "done", 0):
                kill_after_some.done = 1
                ray.kill(client.decode[0])
        final = asyncio.run(collect(client, "m", prompts[0], long, Route(0, 0),
                                    kill_after_some))
        assert final.outputs[0].token_ids == expected
        assert final.spec_accepted_tokens > 0       # both replicas' counts, added up
        # The D that took over (replica 1) kept speculating for the migrated request.
        after = {ld.replica_id: ld.spec_decode["accepted"]
                 for ld in asyncio.run(client.loads()) if ld.role == "decode"}
        assert after[1] > accepted[1]
        wait_all_free(client, 5.0)
    finally:
        shutdown(client)
