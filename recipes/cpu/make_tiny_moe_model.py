"""Build recipes/cpu/tiny_moe_model: a random Qwen3-MoE twin of the tiny model (the same character
tokenizer), 2 layers of 4 experts (top-2, renormalised), for the CPU twin of the Qwen3-30B-A3B recipe.
Deterministic (seed 0); the router is drawn far from uniform so routing has no near-ties.

    python recipes/cpu/make_tiny_moe_model.py [OUT_DIR]
"""

import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main(out: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    base = json.loads((HERE / "tiny_model" / "config.json").read_text())
    cfg = Qwen3MoeConfig(vocab_size=base["vocab_size"], hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=base["max_position_embeddings"], tie_word_embeddings=True,
                         eos_token_id=base.get("eos_token_id"), bos_token_id=base.get("bos_token_id"),
                         pad_token_id=base.get("pad_token_id"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(HERE / "tiny_model" / f, out / f)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "tiny_moe_model")
