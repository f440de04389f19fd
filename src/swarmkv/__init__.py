"""swarmkv: an inference engine for local agent swarms that stores a shared prompt prefix's KV once."""

from swarmkv.engine.llm import LLM, RequestOutput
from swarmkv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
