"""Build the tiny multi-turn agent model shipped in ``recipes/cpu/tiny_agent_model/`` (re-runnable).

    python recipes/cpu/make_tiny_agent_model.py [--out recipes/cpu/tiny_agent_model] [--seed 0]

What it is: a random-init Qwen2 (hidden 64, 2 layers, 4 query / 2 KV heads, 2048 positions; ~0.1M
parameters) over a character tokenizer (printable ASCII + newline, one id per character) with the
ChatML special tokens (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>``) and a
ChatML chat template that renders tool schemas into the system block and tool results as ``tool``
messages. ``<|im_end|>`` is the EOS. It exists to exercise the whole agent pipeline on a CPU -- the
multi-turn loop's template glue, loss masks and step ids, the environments, the ADCA judge path --
not to play well: an untrained policy rarely solves anything. Its ``<|im_end|>`` embedding is scaled
up so turns end within a few dozen tokens (a random model otherwise rarely samples the stop token).
Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library here.
"""

from __future__ import annotations

import argparse
import os

import torch

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]

# ChatML. Tools (when given) are listed in the system block; every message is
# <|im_start|>role\ncontent<|im_end|>\n, and the generation prompt opens an assistant message. The
# rendering of a conversation prefix is a prefix of the rendering of the whole conversation, which the
# agent loop's incremental rendering relies on.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ 'Tools:\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (m['role'] == 'system' and loop.first) -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


def build(out: str, seed: int = 0) -> str:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[eos] *= 4.0  # turns end: the stop token's logit stands out
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_agent_model"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(f"wrote {build(a.out, a.seed)}")


if __name__ == "__main__":
    main()
