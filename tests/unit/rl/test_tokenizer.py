import pytest
from specrl.runtime.rl.task import SyntheticTask
from specrl.runtime.rl.tokenizer import CharTokenizer


def test_round_trip_task_text_and_specials():
    tok = CharTokenizer()
    for p in SyntheticTask(50, seed=3):
        assert p.solution is not None
        text = p.prompt + p.solution
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special=False) == "<s>" + text + "</s>"
    assert tok.vocab_size == len(tok) == 100
    assert {tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id} == {0, 1, 2, 3}


def test_unknown_characters_and_bad_ids():
    tok = CharTokenizer()
    assert tok.encode("é") == [tok.unk_id]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_saved_files_load_with_transformers(tmp_path):
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    tok.save_pretrained(tmp_path)
    assert CharTokenizer.from_pretrained(tmp_path).id_to_token == tok.id_to_token
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = "Q:7+5*3-2=?\nHow many apples? #### 42"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text, add_bos=True, add_eos=True), skip_special_tokens=True) == text
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (tok.eos_id, tok.bos_id, tok.pad_id)


def test_refuses_foreign_vocabulary(tmp_path):
    (tmp_path / "specrl_tokenizer.json").write_text('{"type": "specrl-char", "tokens": ["a"]}')
    with pytest.raises(ValueError, match="vocabulary differs"):
        CharTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        CharTokenizer.from_pretrained(tmp_path / "nowhere")
