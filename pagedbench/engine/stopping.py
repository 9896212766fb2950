"""When a sequence stops after a new token: EOS, a stop token, a stop string, or its length."""

from pagedbench.engine.sequence import Sequence


def stop_check(
    seq: Sequence, token: int, new_text: str, eos_token_ids: list[int], max_model_len: int
) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) if `seq` stops now, else None. A stop string found in the new
    text cuts `seq.output_text` before it (after it with include_stop_str_in_output)."""
    p = seq.params
    if seq.num_output_tokens < p.min_tokens:  # nothing but the length stops it before min_tokens
        return ("length", None) if seq.num_tokens >= max_model_len else None
    if not p.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in p.stop_token_ids:
        return "stop", token
    if p.stop and new_text:
        # Only the new text and the longest stop string's worth before it can complete a match.
        start = max(0, len(seq.output_text) - len(new_text) - max(map(len, p.stop)) + 1)
        hits = [(i, s) for s in p.stop if (i := seq.output_text.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            seq.output_text = seq.output_text[: i + len(s) if p.include_stop_str_in_output else i]
            return "stop", s
    if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= max_model_len:
        return "length", None
    return None
