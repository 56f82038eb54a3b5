"""A self-contained character-level tokenizer with a chat template, for tiny test targets (no download)."""
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size=64):
    """Ids 0-3 are <unk>, <pad>, <|im_start|>, <|im_end|> (eos); then single characters, most common first,
    up to vocab_size. Characters outside the vocabulary become <unk>."""
    chars = list(" \n" + string.ascii_lowercase + string.digits + string.ascii_uppercase + string.punctuation)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars[: vocab_size - len(SPECIALS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(SPECIALS)  # matched whole, before the per-character split
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
