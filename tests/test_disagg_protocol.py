"""The P/D protocol's parts that need no engine actor: the first token's one trip to the caller
(actors/messages.py): P's delta of it, then D's stream after it, add up to what a colocated
engine streams, token by token and character by character, wherever the first token splits a
character."""
from __future__ import annotations

import pytest

from actors.messages import StreamAccumulator, StreamDelta, after_first_token, first_token_text
from pd_cluster.output_processor import OutputProcessor
from pd_cluster.outputs import RequestOutput
from pd_cluster.request import FinishReason, Request, RequestStatus
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.scheduler import ScheduledRequest, SchedulerOutput
from pd_cluster.tokenizer import Tokenizer
from test_tokenizer import MULTILINGUAL, tokenizer  # noqa: F401 (the default model's: a fixture)


# -- the first token's one trip --------------------------------------------------------------
class _Sampler:
    def forget(self, request_id: str) -> None:
        pass


def engine_outputs(tokenizer: Tokenizer, prompt: list[int], tokens: list[int]
                   ) -> list[RequestOutput]:
    """An engine's outputs of a request that samples `tokens`, one a step, the last one ending
    it (the output processor's: a colocated engine's, and D's once it resumed from the first
    token, which it reports as a step of its own)."""
    processor, req = OutputProcessor(tokenizer), Request("r", prompt, SamplingParams())
    processor.add(req)
    outs = []
    for i, token in enumerate(tokens):
        req.append_token(token, None)
        ended = []
        if i == len(tokens) - 1:
            req.finish(RequestStatus.FINISHED, FinishReason.LENGTH)
            ended = [req]
        step = SchedulerOutput([ScheduledRequest(req, 1, samples=True)])
        outs += processor.process(step, ended, None, _Sampler())
    return outs


def disaggregated(tokenizer: Tokenizer, prompt: list[int], tokens: list[int]
                  ) -> list[StreamDelta]:
    """The caller's deltas: P's first token (its output of it is finished: it only prefills),
    then D's stream after it."""
    p_out = engine_outputs(tokenizer, prompt, tokens[:1])[0]
    d_first, *d_rest = engine_outputs(tokenizer, prompt, tokens)
    d_first = after_first_token(d_first)
    return ([StreamDelta.first_token(p_out)]
            + [StreamDelta.of(o) for o in ([d_first] if d_first else []) + d_rest])


def final(deltas: list[StreamDelta]) -> RequestOutput:
    acc = StreamAccumulator("r", [])
    outs = [acc.add(d) for d in deltas]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    return outs[-1]


@pytest.mark.parametrize("num_tokens", [1, 4])   # 1: the request ends at its first token
def test_the_first_token_travels_once_and_the_text_equals_colocated_at_every_split(
        tokenizer, num_tokens):
    ids = tokenizer.encode(MULTILINGUAL)
    held = 0
    for k in range(1, len(ids) - num_tokens):
        prompt, tokens = ids[:k], ids[k:k + num_tokens]
        colocated = [StreamDelta.of(o) for o in engine_outputs(tokenizer, prompt, tokens)]
        deltas = disaggregated(tokenizer, prompt, tokens)
        assert [d.token_ids for d in deltas] == [[t] for t in tokens] + (
            [[]] if num_tokens == 1 else []), k          # every token once, in order
        assert not deltas[0].finished and deltas[0].finish_reason is None
        got, want = final(deltas), final(colocated)
        assert (got.outputs[0].text, got.outputs[0].token_ids) == (
            want.outputs[0].text, want.outputs[0].token_ids), k
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
        # What the caller has after the first token is what a colocated stream shows then.
        assert deltas[0].text == colocated[0].text or num_tokens == 1, k
        held += bool(first_token_text(engine_outputs(tokenizer, prompt, tokens[:1])[0]
                                      .delta_text)[1])
    assert held > 0    # some first tokens did split a character (their text held back)


def test_an_unfinished_character_is_held_back_and_only_that():
    assert first_token_text("Hi") == ("Hi", "")
    assert first_token_text(" \ufffd") == ("", " \ufffd")
    assert first_token_text("") == ("", "")
    assert first_token_text("\ufffda") == ("\ufffda", "")
