"""pd-cluster engine core: no Ray import here."""
from pd_cluster.config import EngineConfig
from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch models; import it lazily so `import pd_cluster` stays light.
    if name == "LLM":
        from pd_cluster.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
