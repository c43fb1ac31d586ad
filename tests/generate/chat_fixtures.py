"""A tiny byte-level tokenizer with a ChatML template, for chat tests on a random model."""
from __future__ import annotations

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_chat_tokenizer():
    """259 tokens, one character each: "\\n", printable ASCII, 160 CJK characters, and three
    specials. Decoding and re-encoding any token sequence gives it back (no byte fragments
    or merges), so a random model's replies re-render to exactly the tokens generated."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)] + [chr(0x4E00 + i) for i in range(160)]
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: i + len(SPECIALS) for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=CHATML)
