"""A Qwen3.5 (gated DeltaNet) HF folder to time a conversation's prompt reuse on: SmolLM2's
scale (hidden 576, 28 layers: 21 DeltaNet, 7 attention), random layers, SmolLM2's tokenizer and
chat template, its lm_head writing the words of a paragraph in a cycle, so that its answers
re-tokenize as they were sampled (as a real model's mostly do; random tokens would not).

    PYTHONPATH=. .venv/bin/python docs/bench/qwen35_chat_model.py /tmp/q35-chat
    PYTHONPATH=. MODEL=/tmp/q35-chat .venv/bin/python -u docs/bench/prompt_reuse.py 1 3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.source import open_model

PARAGRAPH = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Europe built wooden machines that riders pushed along with their feet."
)


def main(out: Path) -> None:
    tokenizer = open_model(DEFAULT_MODEL).tokenizer()
    config = transformers.Qwen3_5TextConfig(
        hidden_size=576, num_hidden_layers=28, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, intermediate_size=1536,
        max_position_embeddings=4096, vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 7, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    words = sorted(set(tokenizer.encode(PARAGRAPH)))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
        head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
        head.zero_()
        for i, word in enumerate(words):  # each word's row of the head reads the one before it
            e = embedding[word]
            head[words[(i + 1) % len(words)]] += 3 * e / e.norm() ** 2 * 10
        for name, p in model.named_parameters():  # the layers' outputs weaker than that
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.mul_(0.3)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(tokenizer._engine._backend.to_str())
    template = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(template))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
