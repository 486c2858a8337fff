"""Shared fixtures: tiny random-config models of every supported architecture (seconds, no files)."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def tiny_config(arch: str):
    """A tiny random config of architecture ``arch``."""
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**TINY)
    if arch == "qwen2":
        return tf.Qwen2Config(**TINY)
    if arch == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=16)
    if arch == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=None)
    if arch == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 4},
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
        return cfg
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**TINY, "num_key_value_heads": 4},
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            rope_interleave=False,
        )
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "deepseek_v3"]


def tiny_model(arch: str, dtype: torch.dtype = torch.float32):
    """A tiny random model (seeded) in eval mode with SDPA attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def far_quote_stream() -> tuple[torch.Tensor, torch.Tensor]:
    """A 400-id prompt (seeded) with a key said once at slots 300-305, and a 5-id question ending in the key:
    what ``quote`` rebuilds a far passage for."""
    torch.manual_seed(3)
    prompt = torch.randint(3, 140, (1, 400))
    key = torch.arange(150, 156).view(1, -1)
    prompt[:, 300:306] = key
    question = torch.cat([torch.randint(3, 140, (1, 5)), key], dim=1)
    return prompt, question


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")
