"""Grammar-constrained decoding in the engine: a tiny random model (the bundled model's
tokenizer, random weights) under a JSON schema emits only schema-valid JSON and stops when the
grammar ends, colocated (with and without async scheduling) and disaggregated over NIXL (the
grammar crosses from P to D with the first token: D's output equals colocated), and a request
whose decode replica dies mid-stream goes on under its grammar on another."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import jsonschema
import pytest
import torch

from tests.support.engine_clients import collect
from pd_cluster import LLM, EngineConfig, SamplingParams
from pd_cluster.structured import GrammarSpec
from router.routing import Route

ray = pytest.importorskip("ray")
from actors.engine_actor import EngineActor  # noqa: E402
from router.disagg_client import DisaggregatedClient  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["ok", "n", "tag", "name"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green", "blue"]},
                         "name": {"type": "string", "maxLength": 6}}}
# Long enough to migrate mid-way: exactly 24 small integers.
LIST_SCHEMA = {"type": "array", "minItems": 24, "maxItems": 24,
               "items": {"type": "integer", "minimum": 0, "maximum": 9}}
PROMPTS = [list(range(5, 40)), [7, 8, 9], list(range(300, 320)), [42] * 17]


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory, default_model_dir):
    """A 2-layer random Llama over the bundled model's tokenizer (a grammar needs one)."""
    import transformers

    path = str(tmp_path_factory.mktemp("tiny_tok"))
    for name in os.listdir(default_model_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "vocab.json",
                                                     "merges.txt", "generation_config.json"):
            shutil.copy(os.path.join(default_model_dir, name), path)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2)
    torch.manual_seed(23)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def params(schema, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 96,
                             "grammar": GrammarSpec.json_schema(schema), **kw})


def assert_valid(text: str, finish_reason, schema) -> None:
    assert finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def colocated(tiny_tok):
    llm = LLM(tiny_tok, block_size=16, num_kv_blocks=64)
    return [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids)
            for o in llm.generate(PROMPTS, params(SCHEMA))]


@pytest.mark.slow
def test_a_random_model_under_a_schema_emits_only_valid_json_and_stops(colocated):
    for text, reason, _ in colocated:
        assert_valid(text, reason, SCHEMA)


@pytest.mark.slow
def test_sampled_and_async_scheduled_requests_stay_valid(tiny_tok):
    llm = LLM(tiny_tok, block_size=16, num_kv_blocks=64, async_scheduling=True)
    outs = llm.generate(PROMPTS * 2, [params(SCHEMA, temperature=1.0, seed=i)
                                      for i in range(len(PROMPTS) * 2)])
    for o in outs:
        assert_valid(o.outputs[0].text, o.outputs[0].finish_reason, SCHEMA)
    plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16))
    with pytest.raises(ValueError):   # the control: unconstrained, it is not JSON
        json.loads(plain[0].outputs[0].text)


def start(model_dir, num_d=1):
    cfg = EngineConfig(model=model_dir, block_size=16, num_kv_blocks=64)
    p = [EngineActor.options(num_cpus=0).remote(cfg, "prefill", 0, "nixl", 30.0)]
    d = [EngineActor.options(num_cpus=0).remote(cfg, "decode", i, "nixl", 30.0)
         for i in range(num_d)]
    client = DisaggregatedClient.over(p, d)
    asyncio.run(client.wait_ready(120))
    return client


def shutdown(client):
    for a in client.prefill + client.decode:
        ray.kill(a)


@pytest.fixture(scope="module")
def grammar_pd(ray_cluster, tiny_tok):
    """P and two D over nixl, for both disaggregated tests (each engine actor takes seconds of
    CPU to start): the second D is where a stream goes on once the last test kills D0."""
    client = start(tiny_tok, num_d=2)
    yield client
    shutdown(client)


def test_disaggregated_output_is_valid_and_equals_colocated(grammar_pd, colocated):
    client = grammar_pd

    async def go():
        return await asyncio.gather(*[collect(client, f"s{i}", p, params(SCHEMA),
                                              Route(0, 0)) for i, p in enumerate(PROMPTS)])
    outs = asyncio.run(go())
    for o, (text, reason, ids) in zip(outs, colocated):
        assert_valid(o.outputs[0].text, o.outputs[0].finish_reason, SCHEMA)
        assert o.outputs[0].token_ids == ids


def test_grammar_survives_a_decode_replica_dying_mid_stream(grammar_pd, tiny_tok):
    client = grammar_pd
    prompt = list(range(10, 50))
    expected = LLM(tiny_tok, block_size=16, num_kv_blocks=64).generate(
        [prompt], params(LIST_SCHEMA))[0].outputs[0]
    assert_valid(expected.text, expected.finish_reason, LIST_SCHEMA)

    async def kill_after_some(out):
        if len(out.outputs[0].token_ids) == 12:
            ray.kill(client.decode[0])
    final = asyncio.run(collect(client, "m", prompt, params(LIST_SCHEMA), Route(0, 0),
                                kill_after_some)).outputs[0]
    assert_valid(final.text, final.finish_reason, LIST_SCHEMA)
    assert final.token_ids == expected.token_ids
