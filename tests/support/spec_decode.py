"""Models that speculation accepts much of, and the greedy settings of the speculative decoding
tests."""
from pd_cluster import SamplingParams
from tests.support.tiny_models import make_tiny_model

NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def loopy_model(family: str, root: str) -> str:
    """A tiny random model whose greedy output falls into loops (small initial weights make
    the next token mostly a function of the last one), so n-gram drafts get accepted."""
    return make_tiny_model(family, root, initializer_range=0.02)
