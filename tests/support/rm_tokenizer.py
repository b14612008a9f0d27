"""A reward model's own tokenizer for tests: character-level like the tiny policy's, but another
vocabulary order, a BOS that its post-processor adds, and a chat template with role tags, so a
re-tokenised RM input differs from the actor's ids in every way verl's re-tokenisation handles."""

import os

CHARS = list("\n:AUS=*-+9876543210")  # ids 3.. in this order; the tiny policy's '0' is 2, here it is 21
SPECIAL = ["<pad>", "<s>", "</s>"]
VOCAB = {s: i for i, s in enumerate(SPECIAL + CHARS)}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}")


def make_rm_tokenizer(out_dir: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(dict(VOCAB), unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": []})
    fast.chat_template = TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def by_hand(messages: list[dict], response: str) -> list[int]:
    """The RM ids of a conversation, written out from the template's definition (not through jinja or
    the tokenizer): BOS, then 'U:' prompt '\\n' 'A:' response '\\n', one id per character."""
    text = "".join(f"{m['role'][0].upper()}:{m['content']}\n" for m in messages) + f"A:{response}\n"
    return [VOCAB["<s>"]] + [VOCAB[c] for c in text]


PROMPTS, ANSWERS = ["12+34=", "7*8=", "99-1="], ["46", "56", "9"]
TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes", "cpu", "tiny_model")


def generated(tok, prompts, answers):
    """A batch as the rollout makes it: the actor's ids of each prompt and answer (+ EOS), raw_prompt meta."""
    import torch

    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    p = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts]
    r = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    p_ids, p_mask = pad_left(p, max(map(len, p)), tok.pad_token_id)
    r_ids, r_mask = pad_right(r, max(map(len, r)), tok.pad_token_id, torch.long)
    return RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask,
                                    meta={"raw_prompt": [[{"role": "user", "content": x}] for x in prompts]})
