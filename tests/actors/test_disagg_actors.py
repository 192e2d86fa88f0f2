"""Disaggregated prefill/decode with real Ray actors: output equal to colocated and HF for
each CPU transport, overlap of transfer and compute, and each failure ending as specified
with every KV block free afterwards."""
from __future__ import annotations

import asyncio

import pytest

from tests.support.engine_clients import collect, prefilled_tokens, prefilling
from tests.support.hf_reference import hf_greedy
from pd_cluster import LLM, SamplingParams
from pd_cluster.tokenizer import load_tokenizer
from router.routing import Route
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_until_async

ray = pytest.importorskip("ray")
from actors.decode_side import DecodeHost  # noqa: E402
from actors.handoff import PushHandoff, PushSender  # noqa: E402
from actors.kv_push import QUARANTINE_MARGIN_S  # noqa: E402
from actors.prefill_side import PrefillHost  # noqa: E402
from router.errors import EngineUnavailable  # noqa: E402
from transfer.base import TransferError  # noqa: E402
from tests.support.disagg import GREEDY, all_free, load_of, run_all, shutdown, start, wait_all_free

pytestmark = pytest.mark.usefixtures("ray_cluster")


class FailingSend(PushSender):
    """P's part of a push whose writes fail once P has prefilled the prompt (as they do when
    D is unreachable): P aborts them and reports the failure."""

    async def send(self, request_id, prompt_ids, destination, prefill, salt=None):
        async def prefill_then_fail():
            await prefill()
            raise TransferError(f"{request_id}: the KV writes failed")
        return await super().send(request_id, prompt_ids, destination, prefill_then_fail)


class FailingPush(PushHandoff):
    sender_type = FailingSend


# Blocks a P may have written stay quarantined on D until P says DRAINED (a message after
# the stream ended) or, with no P to say it, for the transport lease plus a margin: the tests
# that wait that out use a short transport lease (the product's is LEASE_S).
DRAINED_WITHIN_S = 5.0
SHORT_TRANSFER_LEASE_S = 3.0
QUARANTINE_S = SHORT_TRANSFER_LEASE_S + QUARANTINE_MARGIN_S


async def _all_free_now(client) -> bool:
    return all_free(await client.loads())


async def _prefilling(actor) -> bool:
    return prefilling(await actor.load.remote())


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def nixl_pd(tiny):
    """One nixl deployment for the module's tests that need no other settings (each engine
    actor takes seconds of CPU to start): 2 P, 3 D, prefills in chunks of 16 tokens so that a
    drain can catch P1 mid-prefill. The tests that retire or kill its replicas run last,
    in this order: the drain (P1), a killed decoder past the migration bound (D2), a killed
    decoder (D0), then every decoder."""
    client = start(tiny, "nixl", num_p=2, num_d=3, max_num_batched_tokens=16)
    yield client
    shutdown(client)


@pytest.fixture
def pd(request, tiny):
    """A P/D deployment over the transport in request.param: nixl's is the module's."""
    if request.param == "nixl":
        yield request.getfixturevalue("nixl_pd")
        return
    client = start(tiny, request.param)
    yield client
    shutdown(client)


@pytest.fixture(scope="module")
def default_pd(default_model_dir):
    """The default model in 2 P (prefills in 128-token chunks, so that a kill can land
    mid-prefill) and a D, with a short transport lease (no P is left to say DRAINED once
    both are killed): for the overlap test, then the test that kills both P."""
    client = start(default_model_dir, "nixl", num_p=2, max_num_batched_tokens=128,
                   transfer_lease_s=SHORT_TRANSFER_LEASE_S)
    yield client
    shutdown(client)


@pytest.fixture(scope="module")
def failing_pd(tiny):
    """P and D whose KV writes fail once P has prefilled (the handoff is installed in the
    actors): for each prefill failure policy in turn."""
    client = start(tiny, "nixl", handoff=FailingPush())
    yield client
    shutdown(client)


def shared_prefix_prompts(n):
    base = list(range(3, 60))
    return [base[: 20 + (i % 5) * 8] + [100 + i, 200 + i] for i in range(n)]


@pytest.mark.parametrize("pd", ["nixl", "ucx", "ray"], indirect=True)
def test_disaggregated_equals_colocated_equals_hf(pd, tiny):
    client = pd
    prompts = [list(range(5, 70)), [7, 8, 9], list(range(5, 40)) + [1, 2]]
    hf = hf_greedy(tiny, prompts, GREEDY.max_tokens)
    colocated = [o.outputs[0].token_ids for o in LLM(tiny).generate(prompts, GREEDY)]
    disagg = run_all(client, prompts)
    # Conditional disaggregation: the route leaves prefill to D.
    on_d = run_all(client, prompts, routes={i: Route(0, None) for i in range(3)})
    assert disagg == colocated == hf == on_d
    wait_all_free(client, DRAINED_WITHIN_S)
    # The actor is what its sides use of it.
    assert ray.get(client.prefill[0].__ray_call__.remote(
        lambda actor: isinstance(actor, PrefillHost)))
    assert ray.get(client.decode[0].__ray_call__.remote(
        lambda actor: isinstance(actor, DecodeHost)))


def test_32_concurrent_requests_with_shared_prefixes_complete(nixl_pd, tiny):
    client = nixl_pd
    prompts = shared_prefix_prompts(32)
    expected = [o.outputs[0].token_ids for o in LLM(tiny).generate(prompts, GREEDY)]
    hits_before = sum(ld.prefix_hits for ld in asyncio.run(client.loads()))
    routes = {i: Route(i % 2, 0) for i in range(32)}
    assert run_all(client, prompts, routes=routes) == expected
    loads = asyncio.run(client.loads())
    assert sum(ld.prefix_hits for ld in loads) > hits_before
    wait_all_free(client, DRAINED_WITHIN_S)


def test_abort_mid_stream_frees_blocks_on_both_sides(nixl_pd):
    client = nixl_pd
    params = SamplingParams(temperature=0, max_tokens=440, ignore_eos=True)

    def computed_on_d() -> int:
        return sum(kind["sum_tokens"] for kind in load_of(client.decode[0]).steps.values())
    before = computed_on_d()

    async def go():
        streams = [client.generate(f"a{i}", list(range(5, 40 + i)), params, Route(0, 0))
                   for i in range(4)]
        for s in streams:
            await s.__anext__()
        for s in streams:
            await s.aclose()
        # The aborts reach P and D after the streams closed: wait for them, loop running.
        try:
            await wait_until_async(lambda: _all_free_now(client), 10, 0.1)
        except TimeoutError:
            pass            # the assertion says what is left
    asyncio.run(go())
    wait_all_free(client, DRAINED_WITHIN_S)
    # Freed because they were aborted, not because they ran out: D computed fewer tokens
    # than the 4 x 439 the requests asked of it (none, when the aborts beat its first step).
    assert computed_on_d() - before < 4 * (params.max_tokens - 1)


def test_draining_a_prefill_replica_mid_prefill_fails_no_request(nixl_pd, tiny):
    """Drain P1 while it prefills (chunked, 16 tokens a step): its prefills finish and their
    KV reaches D, nothing fails or falls back, and only then is P1 stopped and RETIRED."""
    client = nixl_pd
    prompts = [list(range(5, 5 + 150 + 7 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny).generate(prompts, params)]
    p1 = client.prefill[1]
    on_d_before = prefilled_tokens(load_of(client.decode[0]))

    async def go():
        streams = [asyncio.ensure_future(collect(client, f"dr{i}", p, params,
                                                 Route(0, i % 2)))
                   for i, p in enumerate(prompts)]
        await wait_until_async(lambda: _prefilling(p1), 60, 0.02)
        membership = await client.fleet.drain("prefill", 1, 60)
        return await asyncio.gather(*streams), membership
    outs, membership = asyncio.run(go())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert prefilled_tokens(load_of(client.decode[0])) == on_d_before    # no fallback to D
    states = {(m.role, m.replica_id): str(m.state) for m in membership.members}
    assert states[("prefill", 1)] == "retired" and states[("prefill", 0)] == "ready"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(p1.load.remote(), timeout=30)
    client.update(membership)
    assert ("prefill", 1) not in client.available()
    wait_all_free(client, DRAINED_WITHIN_S)


def test_request_past_its_migration_bound_fails_clearly_though_a_decoder_is_free(nixl_pd):
    client = nixl_pd
    client.max_migrations = 0           # limits.max_migrations: the first loss ends it
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def kill_after_some(out):
        if len(out.outputs[0].token_ids) == 10:
            ray.kill(client.decode[2])
    try:
        with pytest.raises(EngineUnavailable, match=r"after 0 migration\(s\), the most "
                                                    r"limits.max_migrations allows \(0\)"):
            asyncio.run(collect(client, "m", list(range(10, 40)), params, Route(2, 0),
                                kill_after_some))
    finally:
        client.max_migrations = 3
    assert {("decode", 0), ("decode", 1)} <= client.available()
    wait_all_free(client, DRAINED_WITHIN_S)


def test_killed_decoder_mid_stream_continues_on_another(nixl_pd, tiny):
    client = nixl_pd
    prompt = list(range(10, 50))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    expected = LLM(tiny).generate([prompt], params)[0].outputs[0].token_ids

    async def kill_after_some(out):
        if len(out.outputs[0].token_ids) == 20:
            ray.kill(client.decode[0])
    final = asyncio.run(collect(client, "k", prompt, params, Route(0, 0), kill_after_some))
    assert final.outputs[0].token_ids == expected
    assert final.outputs[0].finish_reason == "length"
    wait_all_free(client, DRAINED_WITHIN_S)


def test_killed_decoder_with_no_spare_fails_clearly(nixl_pd):
    client = nixl_pd

    async def kill_every_decoder(out):
        for d in client.decode:
            ray.kill(d)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with pytest.raises(EngineUnavailable, match="no live decode replica"):
        asyncio.run(collect(client, "k2", [5, 6, 7], params, Route(1, 0), kill_every_decoder))
    loads = asyncio.run(client.loads())
    assert all(ld.kv_blocks_used == 0 for ld in loads)  # the prefill side holds nothing


@pytest.mark.slow      # the default model in P, D, the colocated engine and HF
def test_default_model_disaggregated_equals_colocated_and_overlaps(default_pd,
                                                                   default_model_dir):
    client = default_pd
    prompt = list(range(100, 700))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    colocated = LLM(default_model_dir).generate([prompt], params)[0].outputs[0].token_ids
    assert colocated == hf_greedy(default_model_dir, [prompt], 8)[0]
    assert run_all(client, [prompt], params) == [colocated]
    marks = ray.get(client.prefill[0].timeline.remote())
    computed = {layer: t for what, layer, t in marks if what == "computed"}
    posted = {layer: t for what, layer, t in marks if what == "posted"}
    # Transfer of layer i starts before layer i + 1's compute ends (in the prompt's last
    # chunk: the marks of the later chunks overwrite the earlier ones').
    assert all(posted[i] < computed[i + 1] for i in range(len(computed) - 1))
    # The text too, when the first token (P's) splits a character that D's next tokens
    # complete, or that stays unfinished as the request ends with that token: " 東" is
    # a space and 東's first byte, then its other two bytes; pushed up, these tokens come
    # first whatever the model says (" 東 東", " �" alone).
    split_character = load_tokenizer(default_model_dir).encode(" 東")
    assert len(split_character) == 3
    for max_tokens in (1, 6):
        split = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                               logit_bias={t: 100.0 for t in split_character})
        want = LLM(default_model_dir).generate([[100, 200]], split)[0].outputs[0]
        got = asyncio.run(collect(client, f"t{max_tokens}", [100, 200], split,
                                  Route(0, 0))).outputs[0]
        assert (got.text, got.token_ids) == (want.text, want.token_ids)
    wait_all_free(client, DRAINED_WITHIN_S)


@pytest.mark.slow      # the default model in two P, D and the colocated engine
def test_killed_prefillers_mid_prefill_fall_back_to_another_then_to_the_decoder(
        default_pd, default_model_dir):
    """P0 dies mid-prefill: P1 takes the prompt over; P1 dies mid-prefill too: D prefills it
    itself. Each kill waits until that P has computed a chunk of the prompt and has more to
    go (1000 tokens in 128-token chunks); D's own step counters show it computed the prompt.
    The prompt shares no block with the overlap test's (D must hold none of it cached)."""
    client = default_pd
    prompt = list(range(1000, 2000))
    params = SamplingParams(temperature=0, max_tokens=4)
    expected = LLM(default_model_dir).generate([prompt], params)[0].outputs[0].token_ids
    on_d_before = prefilled_tokens(load_of(client.decode[0]))

    async def go():
        task = asyncio.create_task(collect(client, "p", prompt, params, Route(0, 0)))
        for p in client.prefill:            # P0 first (the route's), then the fallback P1
            await wait_until_async(lambda p=p: _prefilling(p), 120, 0.02)
            ray.kill(p)
        return await task
    final = asyncio.run(go())
    assert final.outputs[0].token_ids == expected
    assert client.dead >= {("prefill", 0), ("prefill", 1)}
    # D's own prefill of the whole prompt.
    assert prefilled_tokens(load_of(client.decode[0])) - on_d_before == len(prompt)
    wait_all_free(client, QUARANTINE_S + 5)   # no P left to say DRAINED


@pytest.mark.parametrize("recompute", [True, False])
def test_failed_transfer_follows_the_policy(failing_pd, tiny, recompute):
    client = failing_pd
    client.recompute = recompute     # the client's policy; the actors are the same
    # A prompt of its own per policy: no prefix of it cached on P or D.
    prompt = list(range(10, 60)) if recompute else list(range(110, 160))
    expected = LLM(tiny).generate([prompt], GREEDY)[0].outputs[0].token_ids
    on_p, on_d = (prefilled_tokens(load_of(a)) for a in (client.prefill[0], client.decode[0]))
    if recompute:
        assert run_all(client, [prompt]) == [expected]
    else:
        with pytest.raises(EngineUnavailable, match="the KV writes failed"):
            run_all(client, [prompt])
    assert prefilled_tokens(load_of(client.prefill[0])) - on_p == len(prompt)
    # recompute: D prefilled the prompt itself after P's transfer failed; fail: it did not.
    assert prefilled_tokens(load_of(client.decode[0])) - on_d == \
        (len(prompt) if recompute else 0)
    wait_all_free(client, DRAINED_WITHIN_S)


def test_unclaimed_reservation_expires(tiny):
    client = start(tiny, "nixl", lease_s=1.0, transfer_lease_s=SHORT_TRANSFER_LEASE_S)
    try:
        dest = ray.get(client.decode[0].reserve.remote("orphan", [5, 6, 7, 8], GREEDY))
        assert dest is not None and dest.block_ids
        used = asyncio.run(client.loads())[1].kv_blocks_used
        assert used > 0
        wait_all_free(client, 1 + QUARANTINE_S + 5)   # lease, then quarantine: no P says DRAINED
    finally:
        shutdown(client)
