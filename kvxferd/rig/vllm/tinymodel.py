"""A tiny Llama-family checkpoint whose tokens depend on its KV cache, written from a seed.

vLLM's ``load_format="dummy"`` draws every weight from U(-1e-3, 1e-3). With
those weights attention cannot move the residual stream in bfloat16, so each
greedy token depends only on the current token and a P/D test that compares
tokens would pass with any KV bytes at all. This module writes a real
checkpoint (``config.json`` + ``model.safetensors``) with the scale a trained
model starts from instead::

    linear and embedding weights  N(0, 0.02)      norms  1
    attention output ~ 0.02 * sqrt(hidden) * |v|  >>  residual ~ 0.02

so every layer's attention (and so every K and V byte of the context) moves
the next token. vLLM loads it with its real loader (``load_format="auto"``).
No tokenizer is written: prompts are token ids (``skip_tokenizer_init``).

Run it to try the connector by hand::

    python -m kvxferd.rig.vllm.tinymodel /tmp/tiny [--sliding-window 64 | --mla]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

# 8 query heads over 4 KV heads (GQA), head_dim 64: every TP size up to 4 splits whole KV heads.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
}
INIT_STD = 0.02  # what HF's LlamaPreTrainedModel._init_weights uses (initializer_range)


def sliding_window(config: dict, window: int) -> dict:
    """``config`` as a Mistral with sliding-window attention on every layer (vLLM: one sliding-window group)."""
    return {**config, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama/Mistral checkpoint and its shape (HF names, as vLLM's loader expects)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_out, hidden), p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden), p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    return shapes


def write_tiny_model(directory: str | pathlib.Path, config: dict = TINY_LLAMA, *, seed: int = 0) -> str:
    """Write ``config.json`` and ``model.safetensors`` (weights drawn from ``seed``) into ``directory``.

    The same ``config`` and ``seed`` give the same bytes, so separate engines
    (and separate test runs) load one model. Returns the directory as a string.
    """
    from safetensors.torch import save_file  # a vLLM dependency: this module runs where vLLM is installed

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in tensor_shapes(config).items():
        if len(shape) == 1:  # RMSNorm scales
            weights[name] = torch.ones(shape, dtype=dtype)
        else:
            weights[name] = (torch.randn(shape, generator=generator) * INIT_STD).to(dtype)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return str(directory)


# DeepSeek-V2 with multi-head latent attention: the KV cache holds one latent per token
# (kv_lora_rank + qk_rope_head_dim = 576 elements, no heads). Two dense layers (first_k_dense_replace:
# the experts are declared but never built).
TINY_MLA = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=4,
                num_experts_per_tok=2, first_k_dense_replace=2, kv_lora_rank=512, q_lora_rank=None,
                qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64, max_position_embeddings=2048,
                initializer_range=INIT_STD, torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2)


def write_tiny_mla_model(directory: str | pathlib.Path, *, seed: int = 0) -> str:
    """A DeepSeek-V2 (MLA) checkpoint with Hugging Face's own initialisation (N(0, 0.02), norms 1) from ``seed``."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # a vLLM dependency

    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**TINY_MLA)).to(torch.bfloat16)
    model.save_pretrained(str(directory), safe_serialization=True)
    return str(directory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvxferd.rig.vllm.tinymodel",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sliding-window", type=int, default=0, help="tokens; 0: full attention (Llama)")
    parser.add_argument("--mla", action="store_true", help="a DeepSeek-V2 with multi-head latent attention instead")
    args = parser.parse_args(argv)
    if args.mla:
        print(write_tiny_mla_model(args.directory, seed=args.seed))
        return
    config = sliding_window(TINY_LLAMA, args.sliding_window) if args.sliding_window else TINY_LLAMA
    print(write_tiny_model(args.directory, config, seed=args.seed))


if __name__ == "__main__":
    main()
