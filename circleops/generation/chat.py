"""A multi-turn conversation on the prefill/decode graphs, the KV cache kept between turns.

    from circleops.generation.chat import Chat
    chat = Chat(Generator("out/"), tokenizer)        # tokenizer with a chat template
    reply = chat.turn("Hi! Who are you?")             # reply.text, reply.tokens, reply.fed
    reply = chat.turn("Tell me more.")                # only this turn's tokens are fed

Each turn renders the whole conversation with the tokenizer's chat template and feeds the
cache only the tokens after the longest prefix it already holds (normally: the end of the
previous reply, the new user message and the assistant header). If the template renders
the history differently from what was generated (a reply re-tokenized another way), the
cache rolls back to the common prefix: its later slots are rewritten before any query
sees them. A reply ends at the template's end-of-turn token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from circleops.inputs.chat_template import template_budget
from circleops.generation.core import GenerationLimitError
from circleops.generation.generator import Generator
from circleops.generation.tokenizers import check_text_fits, tokenizing

# end-of-turn markers of common chat templates (ChatML, Llama 3, Gemma, Phi-3, plain text)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class CacheFullError(GenerationLimitError):
    """The conversation no longer fits the KV cache."""


@dataclass
class Reply:
    text: str
    tokens: list[int]  # generated ids, the end-of-turn token included when it stopped there
    fed: int  # tokens fed to the cache for this turn (the new message and its template)
    ended: bool  # stopped at an end-of-turn token
    cache_full: bool  # stopped because the cache had no slot left
    seconds_to_first_token: float = 0.0
    decode_seconds: float = 0.0


def end_of_turn_ids(tokenizer: Any, extra: Sequence[int] = ()) -> list[int]:
    """The ids a reply stops at: the tokenizer's eos, ``extra`` (the manifest's eos ids) and
    the end-of-turn markers in its vocabulary."""
    vocab = tokenizer.get_vocab()
    ids = {int(i) for i in extra}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(ids)


@dataclass
class Chat:
    generator: Generator
    tokenizer: Any  # a transformers tokenizer with a chat template
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise GenerationLimitError("this model's tokenizer has no chat template, so it cannot chat; use "
                                       "`circleops generate DIR --prompt ...` instead.")
        self.stop_ids = end_of_turn_ids(self.tokenizer, self.generator.manifest.eos_token_ids)
        if self.system:
            check_text_fits(self.tokenizer, self.system, self.generator.manifest.max_cache_len, "the system message")
        self.reset()

    def reset(self) -> None:
        """A new conversation (the cache is emptied)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.generator.reset()

    def _render(self) -> list[int]:
        with tokenizing(getattr(self.tokenizer, "name_or_path", "the model")), template_budget(self.tokenizer):
            # a model's template is someone else's program, its tokenizer.json someone else's data
            ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def turn(self, text: str, max_new_tokens: int = 256, *, on_token: Callable[[int], None] | None = None,
             sampler: Any = None) -> Reply:
        """Add the user's ``text``, generate the reply (at most ``max_new_tokens``, fewer when
        the cache runs out); raises CacheFullError, leaving the conversation as it was, when
        the new message itself does not fit."""
        gen = self.generator
        capacity = gen.manifest.max_cache_len
        check_text_fits(self.tokenizer, text, capacity, "this message", error=CacheFullError)
        self.messages.append({"role": "user", "content": text})
        ids = self._render()
        cached = gen.history
        common = 0
        for a, b in zip(ids, cached):
            if a != b:
                break
            common += 1
        if len(ids) + 1 > capacity:
            self.messages.pop()
            raise CacheFullError(
                f"the KV cache is full: the conversation with this message is {len(ids)} tokens and the cache "
                f"holds {capacity}, with room for a reply needed. Type /reset to start a new conversation, or "
                f"convert again with a larger --max-cache-len.")
        del gen.history[common:]  # roll back to what the cache holds of this rendering
        room = capacity - len(ids)
        budget = min(max_new_tokens, room)
        result = gen.generate(ids[common:], budget, keep_cache=True, stop_ids=self.stop_ids,
                              on_token=on_token, sampler=sampler)
        body = [t for t in result.tokens if t not in self.stop_ids]
        reply_text = self.tokenizer.decode(body, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply_text})
        return Reply(text=reply_text, tokens=result.tokens, fed=len(ids) - common, ended=result.stopped_at_eos,
                     cache_full=not result.stopped_at_eos and budget == room and len(result.tokens) == room,
                     seconds_to_first_token=result.prefill_seconds, decode_seconds=result.decode_seconds)
