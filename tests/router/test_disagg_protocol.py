"""The P/D protocol's parts that need no engine actor: an attempt's stages and their only legal
moves (router/disagg_attempt.py), and the first token's one trip to the caller (actors/
messages.py): P's delta of it, then D's stream after it, add up to what a colocated engine
streams, token by token and character by character, wherever the first token splits a
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
from router.disagg_attempt import TRANSITIONS, Attempt, Stage
from tests.support.texts import MULTILINGUAL

S = Stage


# -- an attempt's stages -------------------------------------------------------------------
@pytest.mark.parametrize("path", [
    [S.PREFILLING, S.HANDED_OFF, S.DECODING, S.FINISHED],                 # the usual one
    [S.PREFILLING, S.PREFILLING, S.HANDED_OFF, S.DECODING, S.FINISHED],   # P died: another P
    [S.PREFILLING, S.LOCAL_PREFILL, S.DECODING, S.FINISHED],  # no room on D, P failed
    [S.PREFILLING, S.HANDED_OFF, S.LOCAL_PREFILL, S.DECODING, S.FINISHED],  # KV did not land
    [S.LOCAL_PREFILL, S.DECODING, S.FINISHED],                            # the route's choice
    [S.PREFILLING, S.HANDED_OFF, S.DECODING, S.MIGRATED],                 # D died
    [S.PREFILLING, S.FAILED], [S.HANDED_OFF, S.ABORTED], [S.LOCAL_PREFILL, S.MIGRATED],
])
def test_the_real_paths_are_legal(path):
    attempt = Attempt("r", 0, None, path[0])
    for stage in path[1:]:
        attempt.move_to(stage)
    assert attempt.stage is path[-1]


@pytest.mark.parametrize("start, to", [
    (S.PREFILLING, S.DECODING), (S.PREFILLING, S.FINISHED), (S.HANDED_OFF, S.PREFILLING),
    (S.HANDED_OFF, S.FINISHED), (S.LOCAL_PREFILL, S.HANDED_OFF), (S.DECODING, S.LOCAL_PREFILL),
    (S.DECODING, S.DECODING), (S.FINISHED, S.FAILED), (S.MIGRATED, S.DECODING),
    (S.ABORTED, S.FINISHED), (S.FAILED, S.ABORTED),
])
def test_illegal_moves_are_refused_and_change_nothing(start, to):
    attempt = Attempt("r#2", 1, None, start)
    with pytest.raises(RuntimeError, match=f"attempt r#2: illegal transition {start.name}"):
        attempt.move_to(to)
    assert attempt.stage is start


def test_every_stage_before_the_end_can_end_early_and_the_ends_are_final():
    assert set(TRANSITIONS) == set(Stage)
    ends = {S.FINISHED, S.MIGRATED, S.FAILED, S.ABORTED}
    assert {s for s in Stage if s.ended} == ends
    for stage in set(Stage) - ends:
        assert {S.MIGRATED, S.FAILED, S.ABORTED} <= TRANSITIONS[stage]
    assert S.FINISHED in TRANSITIONS[S.DECODING]


def test_an_attempt_starts_where_its_route_says_under_its_own_id():
    first = Attempt.start("req", 0, 1, "d1", 0)
    assert (first.id, first.stage, first.p_id, first.first_sent) == ("req", S.PREFILLING, 0,
                                                                     False)
    again = Attempt.start("req", 2, 0, "d0", None)
    assert (again.id, again.stage, again.d_id) == ("req#2", S.LOCAL_PREFILL, 0)


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
