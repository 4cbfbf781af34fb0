"""Timed ``generate`` of a transformers-style model (PyTorch eager, or Optimum's ORTModel).

Standard library only at import time: ``optimum_worker.py`` imports this file inside the Optimum
virtual environment, where this project's packages are not installed.

A LogitsProcessor stamps the time each step's logits are ready: the first stamp ends the prefill
(time to first token), consecutive stamps give the per-token latencies. ``min_new_tokens`` equal
to ``max_new_tokens`` forces exactly ``new_tokens`` tokens (EOS is masked), as ``ignore_eos=True``
does in this project's runtime, so every row generates the same number of tokens.
"""

from __future__ import annotations

import resource
import time


def timed_generate(model, tokenizer, prompts: list[str], new_tokens: int, torch) -> dict:
    """Generate greedily; return prefill seconds, token timestamps and step latencies."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    start = time.perf_counter()  # from prompt strings in hand, as for the runtime rows
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, num_beams=1,
                             logits_processor=LogitsProcessorList([Stamp()]),
                             pad_token_id=tokenizer.pad_token_id)
    prompt_tokens = int(enc["input_ids"].shape[1])
    return timing_record(start, stamps, int(out.shape[1]) - prompt_tokens, prompt_tokens)


def timing_record(start: float, stamps: list[float], generated: int, prompt_tokens: int) -> dict:
    """Prefill, decode and per-token figures from the first-token and later token timestamps."""
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"prefill_s": stamps[0] - start, "decode_s": stamps[-1] - stamps[0],
            "step_s": steps, "generated_tokens": generated, "prompt_tokens": prompt_tokens}


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    VmHWM belongs to the process's own address space, so it starts afresh at exec; ru_maxrss does
    not on Linux (a child starts with its parent's peak at fork), and is the fallback only.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
