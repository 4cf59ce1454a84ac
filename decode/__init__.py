"""Generation: prefill + one compiled `lax.while_loop` decode, sampling, beam search, streaming."""

from decode.generate import GenerateOutput, generate, stream, trace_count
from decode.loop import DecodeState, StopReason, decode_loop
from decode.sampling import SamplingParams, filter_logits, sample

__all__ = [
    "DecodeState", "GenerateOutput", "SamplingParams", "StopReason", "decode_loop",
    "filter_logits", "generate", "sample", "stream", "trace_count",
]
