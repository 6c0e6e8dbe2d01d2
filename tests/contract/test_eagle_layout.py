"""An EAGLE head trained here loads in vLLM's EAGLE model: names, shapes, bias and input order read from the wheel.

The facts come from the pinned vLLM's ``model_executor/models/llama_eagle.py`` and ``llama.py`` (parsed, never
imported): which checkpoint names its ``load_weights`` accepts (``model.`` prefix, q/k/v and gate/up stacking),
which parameters the draft model has (layer 0 without input norm, fc without bias), and the order of the
``torch.cat`` feeding ``fc``. The exported head must match all of them.
"""

from __future__ import annotations

import ast
import json
import re

import torch
import torch.nn.functional as F
from specrl.runtime.engine.proposers.eagle import EagleHead, load_for_vllm_folder, save_for_vllm
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.contract.vllm_source import Source

EAGLE = "vllm.model_executor.models.llama_eagle"
LLAMA = "vllm.model_executor.models.llama"


def _init_assignments(cls: ast.ClassDef) -> dict[str, ast.Call]:
    """``self.x = Ctor(...)`` in ``__init__`` -> {x: the call} (the module tree vLLM builds)."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    out = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out[t.attr] = node.value
    return out


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


class VLLMEagleLayout:
    """What vLLM's EagleLlamaForCausalLM expects of a checkpoint, read from its source."""

    def __init__(self, src: Source) -> None:
        model = src.cls(EAGLE, "LlamaModel").node
        causal = src.cls(EAGLE, "EagleLlamaForCausalLM").node
        layer = src.cls(EAGLE, "LlamaDecoderLayer").node
        base_layer = src.cls(LLAMA, "LlamaDecoderLayer").node
        attrs = _init_assignments(model)
        # checkpoint names: load_weights' transform prefixes everything but lm_head with "model."
        transform = ast.unparse(_method(causal, "load_weights"))
        assert "'model.' + name" in transform and "'lm_head' not in name" in transform, transform
        self.prefix = "model."
        # the stacking map of the draft model (hf name part -> vLLM parameter part)
        mapper = next(n.value for n in model.body if isinstance(n, ast.Assign)
                      and ast.unparse(n.targets[0]) == "hf_to_vllm_mapper")
        assert isinstance(mapper, ast.Call), ast.unparse(mapper)
        stacked = next(k.value for k in mapper.keywords if k.arg == "orig_to_new_stacked")
        assert isinstance(stacked, ast.Dict), ast.unparse(stacked)
        assert None not in stacked.keys, "orig_to_new_stacked unpacks another mapping: " + ast.unparse(stacked)
        self.stacked = {ast.literal_eval(k): ast.literal_eval(v)[0] for k, v in zip(stacked.keys, stacked.values)
                        if k is not None}
        # fc: 2H -> H, bias?
        fc = attrs["fc"]
        kw = {k.arg: k.value for k in fc.keywords}
        assert ast.unparse(kw["input_size"]).endswith("hidden_size * 2"), ast.unparse(fc)
        self.fc_bias = ast.literal_eval(kw["bias"])
        # the order of the concatenated inputs of fc in forward
        forward = _method(model, "forward")
        cat = next(n for n in ast.walk(forward) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cat")
        assert isinstance(cat.args[0], (ast.List, ast.Tuple)), ast.unparse(cat)
        names = [ast.unparse(e) for e in cat.args[0].elts]
        sources = {ast.unparse(n.targets[0]): ast.unparse(n.value) for n in ast.walk(forward)
                   if isinstance(n, ast.Assign) and len(n.targets) == 1}
        params = {a.arg for a in forward.args.args}
        self.fc_inputs = ["embedding" if "embed_tokens" in sources.get(n, "") else
                          "hidden" if n in params and n == "hidden_states" else n for n in names]
        # layer i gets disable_input_layernorm = (i == 0), which replaces input_layernorm with Identity
        layers_call = ast.unparse(attrs["layers"])
        assert "LlamaDecoderLayer(vllm_config, i == 0" in layers_call, layers_call
        assert "self.input_layernorm = nn.Identity()" in ast.unparse(layer)
        self.layer0_input_norm = False
        # a decoder layer's parameters (vLLM names) from llama.py
        sub = _init_assignments(base_layer)
        attn = _init_assignments(src.cls(LLAMA, "LlamaAttention").node)
        mlp = _init_assignments(src.cls(LLAMA, "LlamaMLP").node)
        self.layer_params = {f"self_attn.{p}" for p in attn if p in ("qkv_proj", "o_proj")} | \
            {f"mlp.{p}" for p in mlp if p in ("gate_up_proj", "down_proj")} | \
            {p for p in sub if p.endswith("layernorm")}
        assert {"self_attn", "mlp"} <= set(sub)
        self.optional = {"embed_tokens"}  # absent -> vLLM shares the target's (llm_base_proposer)
        self.architectures = set(re.findall(r"'(\w+)': \('llama_eagle'", src.text("vllm.model_executor.models.registry")))
        text = src.text(LLAMA)
        self.config_keys_read = set(re.findall(r"getattr\(config, '(\w+)'", text)) | \
            set(re.findall(r"hasattr\(config, '(\w+)'", text)) | set(re.findall(r"\bconfig\.(\w+)", text))

    def vllm_name(self, checkpoint_name: str) -> str:
        name = checkpoint_name if "lm_head" in checkpoint_name else self.prefix + checkpoint_name
        for hf, ours in self.stacked.items():
            name = name.replace(hf, ours)
        return name

    def parameters(self) -> set[str]:
        """The draft model's parameters a checkpoint must fill (weights only; layer 0)."""
        out = {f"{self.prefix}fc.weight"}
        if self.fc_bias:
            out.add(f"{self.prefix}fc.bias")
        for p in self.layer_params:
            if p == "input_layernorm" and not self.layer0_input_norm:
                continue
            out.add(f"{self.prefix}layers.0.{p}.weight")
        return out


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_exported_head_has_exactly_vllms_parameters(src: Source, tmp_path) -> None:
    layout = VLLMEagleLayout(src)
    assert layout.fc_inputs == ["embedding", "hidden"] and layout.fc_bias is False
    head = EagleHead.from_target(tiny_llama())
    save_for_vllm(head, str(tmp_path))
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    mapped = {layout.vllm_name(n) for n in state}
    # vLLM's loader silently ignores unexpected `.bias` tensors: a bias it does not have would be lost, so none
    assert not [n for n in state if n.endswith(".bias")], sorted(state)
    assert mapped == layout.parameters(), (sorted(mapped), sorted(layout.parameters()))
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    assert shapes["fc.weight"] == (32, 64)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "Eagle" + config["architectures"][0] in layout.architectures
    written = {"qkv_bias", "attention_bias", "mlp_bias", "hidden_size", "intermediate_size", "rms_norm_eps",
               "num_attention_heads", "num_key_value_heads", "hidden_act"}
    assert written <= layout.config_keys_read, written - layout.config_keys_read  # vLLM's Llama reads them all
    assert config["num_hidden_layers"] == 1


def test_head_computes_what_vllms_eagle_computes(src: Source, tmp_path) -> None:
    """fc over cat(...) in vLLM's parsed order, then the layer with no input norm == our head's forward."""
    layout = VLLMEagleLayout(src)
    target = tiny_llama()
    head = EagleHead.from_target(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a "trained" head: no symmetric identity init to hide the order
    save_for_vllm(head, str(tmp_path))
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    feats = torch.randn(2, 5, 32)
    toks = torch.randint(0, 64, (2, 5))
    embed = target.model.embed_tokens.weight
    parts = {"embedding": F.embedding(toks, embed), "hidden": feats}
    x = F.linear(torch.cat([parts[p] for p in layout.fc_inputs], dim=-1), state["fc.weight"])
    ref = LlamaForCausalLM(target.config).model.layers[0]  # a plain HF layer loaded by the exported names
    ref.input_layernorm = torch.nn.Identity()
    ref.load_state_dict({n.removeprefix("layers.0."): t for n, t in state.items() if n.startswith("layers.0.")})
    pos = torch.arange(5).unsqueeze(0).expand(2, 5)
    cos, sin = head.rotary_emb(x, pos)
    mask = torch.full((5, 5), float("-inf")).triu(1).view(1, 1, 5, 5)
    out = ref(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    with torch.no_grad():
        ours = head(feats, toks, embed)
    torch.testing.assert_close(ours, out)
    # and the export round-trips
    back = load_for_vllm_folder(str(tmp_path), target)
    with torch.no_grad():
        torch.testing.assert_close(back(feats, toks, embed), ours)


def test_qwen2_biases_survive_export(src: Source, tmp_path) -> None:
    """vLLM's Llama layer has q/k/v biases only when the config says qkv_bias (else they are dropped silently)."""
    torch.manual_seed(0)
    target = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2))
    head = EagleHead.from_target(target)
    save_for_vllm(head, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["qkv_bias"] is True and config["attention_bias"] is False
    layer = ast.unparse(src.cls(LLAMA, "LlamaDecoderLayer").node)
    # vLLM: bias_o_proj = attention_bias; qkv bias = config.qkv_bias when present
    assert "bias_o_proj = attention_bias" in layer and "attention_bias = config.qkv_bias" in layer
