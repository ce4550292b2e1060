"""The random checkpoints' tokenizer: byte-level encoding that round-trips, and a name for every id a model samples."""

from swaprl.checkpoints import QWEN_TOKENIZER_SIZE, hf_config, write_tokenizer


def test_tokenizer_names_every_id_and_keeps_the_special_ids(tmp_path):
    from transformers import AutoTokenizer

    ids = write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == QWEN_TOKENIZER_SIZE
    # A random-weight model samples from its whole vocabulary: an unnamed id would make detokenizing it slow.
    tokens = tok.convert_ids_to_tokens(list(range(QWEN_TOKENIZER_SIZE)))
    assert None not in tokens and len(set(tokens)) == QWEN_TOKENIZER_SIZE
    config = hf_config("tiny")
    assert ids["<|im_end|>"] == config.eos_token_id == tok.eos_token_id
    assert ids["<|endoftext|>"] == config.bos_token_id == tok.pad_token_id
    text = "hello <|im_start|>wörld<|im_end|>"
    encoded = tok.encode(text)
    assert tok.decode(encoded) == text
    assert max(encoded) <= 258  # fillers are never produced by encoding: prompts stay one token per byte
    assert tok.decode([259, 260]) == "aaab"


def test_tokenizer_fits_a_small_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, 512)
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 512
