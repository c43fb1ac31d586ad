"""circleops chat: multi-turn on the graphs, the KV cache kept between turns (only the new
turn's tokens are fed), replies equal transformers' greedy continuation of the whole
rendered conversation, stop at the end-of-turn token, a clear message when the cache is full."""
from __future__ import annotations

import io
import sys

import pytest
import torch

from chat_fixtures import tiny_chat_tokenizer
from circleops.generation.chat import CacheFullError, Chat
from circleops.cli import main
from circleops.generation.generator import Generator
from circleops.recipes.llm import convert_graphs
from families import BY_NAME
from generate_fixtures import one_torch_thread

VOCAB, PREFILL, CACHE = 259, 16, 160


def _model(**kw):
    return BY_NAME["llama"].build(vocab_size=VOCAB, max_position_embeddings=512, **kw)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def chat_dir(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("chat")
    convert_graphs(_model(), out, target="onert", prefill_len=PREFILL, max_cache_len=CACHE, tokenizer=tokenizer)
    return out


def _hf_reply(model, tokenizer, messages, new, stop):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    with torch.no_grad(), one_torch_thread():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=stop,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_turns_keep_the_cache_and_match_transformers(chat_dir, tokenizer):
    model = _model()
    chat = Chat(Generator(chat_dir), tokenizer)
    fed = []
    for text in ["hello there", "and again?", "third"]:
        before = chat.generator.position
        want = _hf_reply(model, tokenizer, chat.messages + [{"role": "user", "content": text}], 10, chat.stop_ids)
        reply = chat.turn(text, 10)
        assert reply.tokens == want
        rendered = len(tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True,
                                                     tokenize=True)["input_ids"])
        assert reply.fed == rendered - before  # the new turn only
        fed.append((reply.fed, rendered))
    assert fed[-1][0] < fed[-1][1] / 2  # no re-prefill of the history


def test_reply_stops_at_end_of_turn(tokenizer, tmp_path):
    model = _model()
    with torch.no_grad():
        model.lm_head.weight[2] = model.lm_head.weight[2] + 50 * model.model.norm.weight.sign()  # <|im_end|> wins
    convert_graphs(model, tmp_path, target="circle", prefill_len=PREFILL, max_cache_len=CACHE, tokenizer=tokenizer)
    chat = Chat(Generator(tmp_path), tokenizer)
    reply = chat.turn("hi", 20)
    assert reply.ended and reply.tokens[-1] == 2 and len(reply.tokens) < 20
    assert reply.tokens == _hf_reply(model, tokenizer, [{"role": "user", "content": "hi"}], 20, chat.stop_ids)


def test_full_cache_is_said_clearly(chat_dir, tokenizer):
    chat = Chat(Generator(chat_dir), tokenizer)
    chat.turn("short", 4)
    with pytest.raises(CacheFullError, match="KV cache is full"):
        chat.turn("x" * CACHE, 4)
    assert chat.messages[-1]["role"] == "assistant"  # the refused message is not kept
    reply = chat.turn("y" * (CACHE - 60), 200)  # fits, but its reply runs out of slots
    assert reply.cache_full and chat.generator.position <= CACHE


def test_cli_chat_from_stdin(chat_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nagain\n/reset\n" + "z" * CACHE + "\n/image a.png\nhi\n"))
    code = main(["chat", str(chat_dir), "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(out.rstrip("\n").split("\n")) == 3  # three replies (the over-long message gets none)
    assert "new conversation" in err and "KV cache is full" in err and "Type /reset" in err
    assert "/image: this directory holds a text model (no vision graph)" in err  # a text model takes no image
    assert err.count("new tokens fed") == 3


def test_cli_sampling_flags(chat_dir, capsys):
    args = ["generate", str(chat_dir), "--prompt", "hi", "--max-new-tokens", "8", "--sample", "--seed", "3",
            "--temperature", "1.5"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert main(args) == 0
    second = capsys.readouterr()
    assert first.out == second.out and "sampling: temperature 1.5" in first.err
    assert main(["generate", str(chat_dir), "--prompt", "hi", "--top-k", "5"]) == 2
    assert "add --sample" in capsys.readouterr().err
