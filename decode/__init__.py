"""Generation: prefill + one compiled `lax.while_loop` decode, sampling, beam search, streaming."""

from .generate import GenerateOutput, generate, stream
from .loop import DecodeState, StopReason, decode_loop
from .sampling import SamplingParams, filter_logits, sample
from .tracing import trace_count

__all__ = [
    "DecodeState", "GenerateOutput", "SamplingParams", "StopReason", "decode_loop",
    "filter_logits", "generate", "sample", "stream", "trace_count",
]
