"""The real models `master.bench.synth` imitates: their published config.json values, and
what their tokenizers need (special tokens at their ids, the chat template, BOS or not).

Data, kept apart from the writer: a new shape to imitate is an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
}

# Published config.json values of each model (the HF hub repos named in the comments).
SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": {
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # meta-llama/Llama-2-13b-hf
    "llama2-13b": {
        **_LLAMA_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # meta-llama/Llama-2-70b-hf
    "llama2-70b": {
        **_LLAMA_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": {
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": {
        **_LLAMA_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # meta-llama/Llama-3.2-1B: tied embeddings and llama3 RoPE scaling.
    "llama3.2-1b": {
        **_LLAMA_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct: the default model's shape, small enough for tests.
    "smollm2-135m": {
        **_LLAMA_COMMON,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Qwen/Qwen3-30B-A3B: a mixture of 128 experts, 8 a token; query and key norms.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # mistralai/Mixtral-8x7B-Instruct-v0.1: a mixture of 8 experts, 2 a token, as wide as the
    # FFN of Mistral 7B; its router renormalises the two weights.
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # openai/gpt-oss-20b, its experts as bf16 values rather than its MXFP4 blocks: 32 experts
    # a layer, 4 a token, sliding-window (128) layers between full ones, YaRN
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 24,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 199998,
        "pad_token_id": 199999,
        "eos_token_id": 200002,
    },
    # Qwen/Qwen3.5-35B-A3B's text model (its published folder is a vision-language one, whose
    # text_config holds these; transformers' Qwen3_5MoeTextConfig defaults to them): 3 gated
    # DeltaNet layers to 1 full-attention one, 256 experts a layer, 8 a token, a shared one
    "qwen3.5-35b-a3b": {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 248044,
        "eos_token_id": 248046,
    },
    # google/gemma-4-E2B-it's text_config, as Gemma4ForCausalLM: 4 local layers to 1 global, the
    # global ones' heads 512 wide, the last 20 layers reading earlier ones' KV with FFNs twice
    # as wide, per-layer input embeddings of 256 a layer
    "gemma4-e2b": {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_hidden_layers": 35,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": None,
        "attention_k_eq_v": False,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
        "hidden_size_per_layer_input": 256,
        "num_kv_shared_layers": 20,
        "use_double_wide_mlp": True,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    # TinyLlama/TinyLlama-1.1B-Chat-v1.0
    "tinyllama-1.1b": {
        **_LLAMA_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


@dataclass(frozen=True)
class TokenizerStyle:
    """The special tokens and chat format of a model family's tokenizer."""

    specials: dict[int, str]
    chat_template: str
    add_bos: bool
    unk: str | None = None


def tokenizer_style(shape: str) -> TokenizerStyle:
    """The tokenizer a model of `shape` ships with, as far as a synthetic one imitates it."""
    if shape.startswith("llama3"):
        return TokenizerStyle(_llama3_specials(), _LLAMA3_TEMPLATE, add_bos=True)
    if shape.startswith("qwen3.5"):  # ChatML, its specials after its BPE tokens
        specials = {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>"}
        return TokenizerStyle(specials, _CHATML_TEMPLATE, add_bos=False)
    if shape.startswith("qwen3"):  # ChatML, its specials after the BPE tokens
        specials = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
        return TokenizerStyle(specials, _CHATML_TEMPLATE, add_bos=False)
    if shape.startswith("gpt-oss"):  # o200k_harmony's specials after its BPE tokens
        specials = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
                    200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}  # fmt: skip
        return TokenizerStyle(specials, _HARMONY_TEMPLATE, add_bos=False)
    if shape.startswith("gemma4"):  # Gemma's <pad>, <eos>, <bos>, <unk> and its turn markers
        specials = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<|turn>",
                    106: "<turn|>"}  # fmt: skip
        return TokenizerStyle(specials, _GEMMA4_TEMPLATE, add_bos=True, unk="<unk>")
    if shape.startswith("smollm2"):
        specials = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}
        return TokenizerStyle(specials, _CHATML_TEMPLATE, add_bos=False)
    # Llama 2, TinyLlama and Mixtral: sentencepiece's <unk>, <s>, </s> at 0, 1, 2.
    specials = {0: "<unk>", 1: "<s>", 2: "</s>"}
    template = _MISTRAL_TEMPLATE if shape.startswith("mixtral") else _LLAMA2_TEMPLATE
    return TokenizerStyle(specials, template, add_bos=True, unk="<unk>")


def _llama3_specials() -> dict[int, str]:
    """Llama 3's 256 special tokens after its 128000 BPE tokens."""
    named = {
        128000: "<|begin_of_text|>",
        128001: "<|end_of_text|>",
        128006: "<|start_header_id|>",
        128007: "<|end_header_id|>",
        128009: "<|eot_id|>",
    }
    specials: dict[int, str] = {}
    reserved = 0
    for token_id in range(128000, 128256):
        if token_id in named:
            specials[token_id] = named[token_id]
        else:
            specials[token_id] = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
    return specials


_LLAMA2_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ message['content'] | trim }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]"
    "{% else %} {{ message['content'] | trim }} {{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

_MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] != 'assistant' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The harmony format's messages without its system preamble, channels or tools: enough for a
# synthetic model's prompts.
_HARMONY_TEMPLATE = (
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

# Gemma 4's turns, without its system turn, thinking channel or tools: enough for a synthetic
# model's prompts (the model's own template is in its files, which no package here holds).
_GEMMA4_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n{{ message['content'] | trim }}<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)

_LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
