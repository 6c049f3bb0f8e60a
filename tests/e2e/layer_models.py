#!/usr/bin/env python3
"""Tiny random checkpoints whose attention layers have what a served model adds to plain
attention (GPU machine; tests/e2e/vllm.sh and sglang.sh use them):

    python tests/e2e/layer_models.py gpt-oss OUT    gpt-oss-20b's attention: 64 q / 8 kv heads,
        head dim 64, sinks, 128-token sliding window on every other layer (4 layers, 4 experts)
    python tests/e2e/layer_models.py window QWEN3_DIR OUT    a copy of a Qwen3 checkpoint whose
        every layer has a 128-token sliding window (Mistral-style; HF and vLLM both apply it)
    python tests/e2e/layer_models.py mellum OUT    128-token sliding-window layers alternating with
        full ones (16 q / 4 kv heads, head dim 128, 4 layers, dense MLPs): a Mellum checkpoint, an
        architecture SGLang serves on its hybrid SWA pool by default and that lists no attention
        backends (gpt-oss's list refuses plugins)

Weights are random bf16 (initializer range 0.05); no tokenizer (prompts are token ids).
"""

import json
import shutil
import sys
from pathlib import Path

WINDOW = 128


def gpt_oss(out: Path) -> None:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    layers = 4
    cfg = GptOssConfig(vocab_size=8192, hidden_size=512, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=8192,
                       layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                       initializer_range=0.05, tie_word_embeddings=False)
    cfg.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # sinks of either sign matter
    model.save_pretrained(out)


def mellum(out: Path) -> None:
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    layers = 4
    cfg = MellumConfig(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, sliding_window=WINDOW,
                       max_position_embeddings=8192,
                       layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                       mlp_layer_types=["dense"] * layers, initializer_range=0.05, tie_word_embeddings=False)
    cfg.architectures = ["MellumForCausalLM"]
    torch.manual_seed(0)
    MellumForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)


def windowed(src: Path, out: Path) -> None:
    shutil.copytree(src, out, dirs_exist_ok=True)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
               layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    path.write_text(json.dumps(cfg, indent=2))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "gpt-oss":
        gpt_oss(Path(sys.argv[2]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "mellum":
        mellum(Path(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "window":
        windowed(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(__doc__)
