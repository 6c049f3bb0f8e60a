#!/usr/bin/env python3
"""Offline generation with evenkv as the attention backend of vLLM or SGLang.

    pip install "evenkv[vllm]"      # or "evenkv[sglang]": the engine plugin comes with it
    python examples/offline_generate.py MODEL_DIR --engine vllm
    python examples/offline_generate.py MODEL_DIR --engine sglang --prompt "The capital of France is"

MODEL_DIR is a Hugging Face checkpoint (a local folder or a hub name). Without a tokenizer
in it, the prompts are random token ids. Decoding is greedy. The same backend is one flag
on the servers: ``vllm serve MODEL --attention-backend CUSTOM`` and
``python -m sglang.launch_server --model-path MODEL --attention-backend evenkv``.
"""

import argparse
import os
import random
import time


def prompts_for(model: str, texts: list[str], count: int) -> tuple[list, bool]:
    """(prompts, has_tokenizer): the texts if the model has a tokenizer, else random token ids."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(model)
        return texts, True
    except (OSError, ValueError):
        vocab = AutoConfig.from_pretrained(model).vocab_size
        rng = random.Random(0)
        return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 200))] for _ in range(count)], False


def generate_vllm(model: str, prompts: list, tokenized: bool, max_tokens: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    # "CUSTOM" is the slot evenkv's vLLM plugin registers itself in (entry point vllm.general_plugins).
    llm = LLM(model=model, attention_backend="CUSTOM", skip_tokenizer_init=not tokenized, dtype="bfloat16",
              gpu_memory_utilization=0.5, max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=tokenized)
    inputs = prompts if tokenized else [{"prompt_token_ids": p} for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params)]


def generate_sglang(model: str, prompts: list, tokenized: bool, max_tokens: int) -> list[list[int]]:
    import sglang

    engine = sglang.Engine(model_path=model, attention_backend="evenkv", skip_tokenizer_init=not tokenized,
                           dtype="bfloat16", mem_fraction_static=0.5)
    try:
        params = {"temperature": 0.0, "max_new_tokens": max_tokens}
        if tokenized:
            outs = engine.generate(prompt=prompts, sampling_params=params)
        else:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
        return [list(o["output_ids"]) for o in outs]
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="Hugging Face checkpoint (folder or hub name)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three examples")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    texts = args.prompt or ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    prompts, tokenized = prompts_for(args.model, texts, len(texts))
    generate = generate_vllm if args.engine == "vllm" else generate_sglang
    t0 = time.perf_counter()
    outputs = generate(args.model, prompts, tokenized, args.max_tokens)
    seconds = time.perf_counter() - t0
    if tokenized:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        for prompt, ids in zip(prompts, outputs):
            print(f"{prompt!r} -> {tok.decode(ids)!r}")
    else:
        for prompt, ids in zip(prompts, outputs):
            print(f"{len(prompt)} prompt tokens -> {ids}")
    tokens = sum(len(o) for o in outputs)
    print(f"{args.engine} + evenkv: {tokens} tokens in {seconds:.1f} s (engine start-up included)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
