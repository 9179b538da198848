"""Trained indexer checkpoints: one safetensors file of per-layer :class:`IndexerProjections`.

Tensor names follow DSA's checkpoint layout,
``model.layers.{i}.self_attn.indexer.{wq_b,wk,weights_proj}.weight`` and
``...indexer.k_norm.{weight,bias}``, stored in bf16 (what a served DSA model holds) and
loaded as fp32. The file's metadata (``__metadata__["topology_kv_indexer"]``, one JSON
object) records what the weights are valid for: the served model's GGUF sha256, the
training text's sha256, the projection shape, the layers, the training steps per layer
and the command that made the file.

One shape serves every layer (DSA's checkpoints, format ``topology_kv_indexer/1``) unless
the metadata's ``layer_shapes`` gives some layers another one (format
``topology_kv_indexer/2``, written only then): a layer's shape is
:meth:`IndexerCheckpointInfo.shape_of`. Every shape of a file reads the same layer input
(``hidden_size``, ``q_input_size``).

Loading refuses, with an error naming the file and what differs: another model (sha256),
a layer the caller needs that the file lacks, a shape the caller expects that differs,
or a tensor whose shape disagrees with the recorded one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections, IndexerProjectionShape

FORMAT = "topology_kv_indexer/1"  # one shape for every layer
FORMAT_LAYER_SHAPES = "topology_kv_indexer/2"  # plus ``layer_shapes``: some layers with another shape
METADATA_KEY = "topology_kv_indexer"
STORED_DTYPE = torch.bfloat16
# A checkpoint of this project's shapes is a few MB; anything far larger is not one.
MAX_CHECKPOINT_BYTES = 1 << 30
_PARAMS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def tensor_name(layer: int, param: str) -> str:
    """DSA's name of one indexer tensor: ``model.layers.{layer}.self_attn.indexer.{param}``."""
    return f"model.layers.{layer}.self_attn.indexer.{param}"


@dataclasses.dataclass(frozen=True)
class IndexerCheckpointInfo:
    """What a checkpoint's weights are valid for, and how they were made.

    model_sha256 : sha256 of the served model's GGUF file
    text_sha256 : sha256 of the training text
    shape : the projection shape of every layer not in ``layer_shapes``
    layers : the decoder layers that have an indexer (ascending)
    steps : layer -> optimizer steps its weights took (retries included)
    command : the command line that trained the file
    extra : anything else the trainer records (windows, held-out recall, seconds)
    layer_shapes : layer -> its shape, for the layers whose shape is not ``shape`` (each a
        layer of ``layers``, each shape reading the same input widths as ``shape``)
    """

    model_sha256: str
    text_sha256: str
    shape: IndexerProjectionShape
    layers: Tuple[int, ...]
    steps: Mapping[int, int]
    command: str
    extra: Mapping[str, object] = dataclasses.field(default_factory=dict)
    layer_shapes: Mapping[int, IndexerProjectionShape] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("model_sha256", "text_sha256"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
                raise ValueError(f"{name}: expected 64 lowercase hex digits (a sha256), got {str(value)[:80]!r}")
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or min(self.layers) < 0:
            raise ValueError(f"layers: expected distinct ascending layer ids >= 0, got {list(self.layers)}")
        for layer, shape in self.layer_shapes.items():
            if layer not in self.layers:
                raise ValueError(f"layer_shapes: layer {layer} is not one of the file's layers {list(self.layers)}")
            if not isinstance(shape, IndexerProjectionShape):
                raise ValueError(f"layer_shapes[{layer}]: expected an IndexerProjectionShape, got {type(shape).__name__}")
            if shape == self.shape:
                raise ValueError(f"layer_shapes[{layer}]: the file's shape itself; list only the layers that differ")
            widths = (shape.hidden_size, shape.q_input_size)
            if widths != (self.shape.hidden_size, self.shape.q_input_size):
                raise ValueError(f"layer_shapes[{layer}]: reads inputs of {widths[0]} / {widths[1]} (hidden_size / "
                                 f"q_input_size), expected the file's {self.shape.hidden_size} / {self.shape.q_input_size}")

    def shape_of(self, layer: int) -> IndexerProjectionShape:
        """The projection shape of ``layer`` (a layer of :attr:`layers`)."""
        if layer not in self.layers:
            raise ValueError(f"layer: expected one of the file's layers {list(self.layers)}, got {layer}")
        return self.layer_shapes.get(layer, self.shape)

    def to_json(self) -> Dict[str, object]:
        out = {
            "format": FORMAT_LAYER_SHAPES if self.layer_shapes else FORMAT,
            "model_sha256": self.model_sha256,
            "text_sha256": self.text_sha256,
            "shape": self.shape.to_json(),
            "layers": list(self.layers),
            "steps": {str(k): int(v) for k, v in self.steps.items()},
            "command": self.command,
            "extra": dict(self.extra),
        }
        if self.layer_shapes:
            out["layer_shapes"] = {str(k): v.to_json() for k, v in sorted(self.layer_shapes.items())}
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, object], source: str) -> "IndexerCheckpointInfo":
        fmt = raw.get("format")
        if fmt not in (FORMAT, FORMAT_LAYER_SHAPES):
            raise ValueError(f"{source}: format: expected {FORMAT!r} or {FORMAT_LAYER_SHAPES!r}, got {fmt!r}")
        if (fmt == FORMAT_LAYER_SHAPES) != bool(raw.get("layer_shapes")):
            raise ValueError(f"{source}: format: {fmt!r} with{'' if raw.get('layer_shapes') else 'out'} layer_shapes "
                             f"(expected {FORMAT_LAYER_SHAPES!r} exactly when some layer has its own shape)")
        try:
            return cls(
                model_sha256=raw["model_sha256"],
                text_sha256=raw["text_sha256"],
                shape=IndexerProjectionShape(**raw["shape"]),
                layers=tuple(int(x) for x in raw["layers"]),
                steps={int(k): int(v) for k, v in raw["steps"].items()},
                command=str(raw["command"]),
                extra=dict(raw.get("extra", {})),
                layer_shapes={int(k): IndexerProjectionShape(**v) for k, v in (raw.get("layer_shapes") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{source}: metadata: {exc}") from None


def save_indexer_checkpoint(path: Path, projections: Mapping[int, IndexerProjections],
                            info: IndexerCheckpointInfo) -> None:
    """Write ``projections`` (layer -> module, every layer of ``info.layers``) to ``path``."""
    from safetensors.torch import save_file

    if sorted(projections) != list(info.layers):
        raise ValueError(f"projections: expected layers {list(info.layers)}, got {sorted(projections)}")
    tensors = {}
    for layer, module in projections.items():
        if module.shape != info.shape_of(layer):
            raise ValueError(f"projections[{layer}].shape: expected {info.shape_of(layer)}, got {module.shape}")
        state = module.state_dict()
        for param in _PARAMS:
            tensors[tensor_name(layer, param)] = state[param].detach().to(STORED_DTYPE).contiguous()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(info.to_json(), sort_keys=True)})
    os.chmod(tmp, 0o644)  # a shared artifact: readable by every user, as a checked-in file is
    os.replace(tmp, path)


def _check_regular_file(path: Path) -> None:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"indexer checkpoint {path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"indexer checkpoint {path}: expected a regular file")
    if st.st_size > MAX_CHECKPOINT_BYTES:
        raise ValueError(f"indexer checkpoint {path}: {st.st_size} bytes, more than the {MAX_CHECKPOINT_BYTES} cap")


def read_checkpoint_info(path: Path, model_sha256: Optional[str] = None) -> IndexerCheckpointInfo:
    """The metadata of the checkpoint at ``path`` (reads the header only).

    model_sha256 : when given, the file must have been trained for the model with this GGUF
        sha256 (ValueError otherwise)
    """
    from safetensors import safe_open

    path = Path(path)
    _check_regular_file(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise ValueError(f"indexer checkpoint {path}: not a safetensors file ({exc})") from None
    if METADATA_KEY not in meta:
        raise ValueError(f"indexer checkpoint {path}: no {METADATA_KEY!r} metadata (not a trained-indexer file)")
    try:
        raw = json.loads(meta[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise ValueError(f"indexer checkpoint {path}: metadata is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"indexer checkpoint {path}: metadata: expected a JSON object")
    info = IndexerCheckpointInfo.from_json(raw, str(path))
    if model_sha256 is not None and info.model_sha256 != model_sha256:
        raise ValueError(f"indexer checkpoint {path}: trained for the model with sha256 {info.model_sha256}, "
                         f"not this one ({model_sha256}); train one for it")
    return info


def load_indexer_checkpoint(
    path: Path,
    *,
    model_sha256: Optional[str],
    layers: Optional[Iterable[int]] = None,
    shape: Optional[IndexerProjectionShape] = None,
) -> Tuple[Dict[int, IndexerProjections], IndexerCheckpointInfo]:
    """Load the layers' fp32 projections from ``path``.

    model_sha256 : the served model's GGUF sha256; the file must have been trained for it
        (None skips the check: tests with random models only)
    layers : the layers the caller needs (None: every layer in the file)
    shape : the projection shape the caller expects of every layer it needs, or None
    """
    from safetensors import safe_open

    path = Path(path)
    info = read_checkpoint_info(path, model_sha256)
    wanted = list(info.layers) if layers is None else sorted(set(int(x) for x in layers))
    missing = [x for x in wanted if x not in info.layers]
    if missing:
        raise ValueError(f"indexer checkpoint {path}: no indexer for layers {missing} (the file has {list(info.layers)})")
    if shape is not None:
        other = [x for x in wanted if info.shape_of(x) != shape]
        if other:
            raise ValueError(f"indexer checkpoint {path}: layers {other} have shape {info.shape_of(other[0])}"
                             f"{'' if len(other) == 1 else ' (the first)'}, expected {shape}")
    out: Dict[int, IndexerProjections] = {}
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for layer in wanted:
            module = IndexerProjections(info.shape_of(layer))
            expected = {k: v.shape for k, v in module.state_dict().items()}
            state = {}
            for param in _PARAMS:
                name = tensor_name(layer, param)
                if name not in names:
                    raise ValueError(f"indexer checkpoint {path}: tensor {name} is missing")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[param]):
                    raise ValueError(f"indexer checkpoint {path}: {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(expected[param])} for {info.shape_of(layer)}")
                state[param] = tensor.to(torch.float32)
            module.load_state_dict(state)
            out[layer] = module.eval().requires_grad_(False)
    return out, info


def round_to_stored_dtype_(module: IndexerProjections) -> IndexerProjections:
    """Round ``module``'s parameters to the stored dtype in place (what a load gives back)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(STORED_DTYPE).to(p.dtype))
    return module
