"""Generation: prefill + one compiled `lax.while_loop` decode, sampling, streaming, constrained
output; beam search."""

from .constraints import (
    AllowedTokens,
    Choice,
    JsonSchema,
    Regex,
    StartsWith,
    TokenAutomaton,
    compile_constraint,
)
from .generate import GenerateOutput, beam_search, beam_search_chunks, generate, prefill, stream
from .loop import DecodeState, StopReason, decode_loop
from .processors import LogitBias, LogitProcessor, ProcessorState, forbid_tokens
from .prompt_state import PromptState
from .sampling import SamplingParams, filter_logits, sample
from .settings import GREEDY, Sampling
from .speculative import SpeculationStats, Speculative
from .tracing import trace_count

__all__ = [
    "GREEDY", "AllowedTokens", "Choice", "DecodeState", "GenerateOutput", "JsonSchema", "LogitBias",
    "LogitProcessor", "ProcessorState", "PromptState", "Regex", "Sampling", "SamplingParams",
    "SpeculationStats", "Speculative", "StartsWith", "StopReason", "TokenAutomaton", "beam_search",
    "beam_search_chunks", "compile_constraint", "decode_loop", "filter_logits", "forbid_tokens",
    "generate", "prefill", "sample", "stream", "trace_count",
]
