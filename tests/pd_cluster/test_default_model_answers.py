"""Acceptance 3 of the engine core: the bundled default model knows the capital of France."""
import pytest

from pd_cluster import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM()  # no model given: the default model


@pytest.mark.slow
def test_default_model_continues_capital_of_france_with_paris(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert out[0].outputs[0].text.strip().startswith("Paris")


@pytest.mark.slow
def test_chat_uses_the_chat_template_and_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_stop_string_truncates_output_and_reports_stop(llm):
    params = SamplingParams(temperature=0, max_tokens=16, stop=["France"])
    text = llm.generate("The capital of France is Paris. The capital of", params)[0].outputs[0]
    full = llm.generate("The capital of France is Paris. The capital of",
                        SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert "France" in full
    assert text.text == full[:full.index("France")]
    assert text.finish_reason == "stop"


@pytest.mark.slow
def test_eos_ends_generation_unless_ignored(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    stopped = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 64
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert forced[0].outputs[0].finish_reason == "length"
    assert len(forced[0].outputs[0].token_ids) == 64


def test_logprobs_are_returned_for_each_token_with_top_n(llm):
    out = llm.generate("The capital of France is",
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) in (3, 4)
        assert lp[token] == max(lp.values())  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())


@pytest.mark.slow
def test_streamed_deltas_add_up_to_the_final_text(llm):
    engine = llm.engine
    rid = engine.add_request("Write a haiku about the sea: 🌊", SamplingParams(
        temperature=0, max_tokens=24))
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.delta_text)
            final = out
    assert final.request_id == rid and final.finished
    assert "".join(deltas) == final.outputs[0].text
    assert "\ufffd" not in final.outputs[0].text
