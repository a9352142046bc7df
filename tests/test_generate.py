"""Greedy generation against transformers' generate on the real test model."""
from __future__ import annotations

import torch

from flotilla.runtime.loader import load_model
from flotilla.runtime.sampling import SamplingParams
from flotilla.runtime.simple import generate_tokens


def test_greedy_64_tokens_equal_transformers(smollm2_gguf):
    """The default `runtime chat` path (the GGUF's own blocks through flotilla's kernels) against
    transformers, which dequantizes the same file to fp32."""
    from transformers import AutoModelForCausalLM

    lm = load_model(smollm2_gguf)
    # a prompt whose answer runs past 64 tokens: min_new_tokens below masks EOS on transformers' side
    story = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": story}])
    ours = list(generate_tokens(lm.model, prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)))

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert ours == out[0, len(prompt):].tolist()
    assert lm.tokenizer.decode(ours).strip() and not set(ours) & set(lm.tokenizer.eos_token_ids)


def test_seeded_sampling_is_reproducible(smollm2_gguf):
    lm = load_model(smollm2_gguf)
    prompt = lm.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = list(generate_tokens(lm.model, prompt, params))
    b = list(generate_tokens(lm.model, prompt, params))
    c = list(generate_tokens(lm.model, prompt, SamplingParams(**{**params.__dict__, "seed": 8})))
    assert a == b and a != c
