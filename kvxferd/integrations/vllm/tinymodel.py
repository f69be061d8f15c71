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

    python -m kvxferd.integrations.vllm.tinymodel /tmp/tiny [--sliding-window 64]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvxferd.integrations.vllm.tinymodel",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sliding-window", type=int, default=0, help="tokens; 0: full attention (Llama)")
    args = parser.parse_args(argv)
    config = sliding_window(TINY_LLAMA, args.sliding_window) if args.sliding_window else TINY_LLAMA
    print(write_tiny_model(args.directory, config, seed=args.seed))


if __name__ == "__main__":
    main()
