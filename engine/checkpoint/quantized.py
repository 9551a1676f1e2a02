"""INT4 safetensors checkpoints: compressed-tensors `pack-quantized` and GPTQ / AutoRound, repacked to W4.

config.json's `quantization_config` names the method. Which modules are INT4 is read from the
tensors themselves: a module with `weight_packed` (compressed-tensors) or `qweight` (GPTQ) is INT4,
one with a plain `weight` stays 16-bit. So ignore lists, AutoRound's `extra_config` and GPTQModel's
`dynamic` rules all come out as the file has them, whatever the config spells.

    compressed-tensors  weight_packed int32 [N, K/8] (input 8j + i in bits 4i, stored level + 8),
                        weight_scale [N, K/g], weight_shape [2] = (N, K)
    GPTQ / AutoRound    qweight int32 [K/8, N] (same nibble order along K), scales [K/g, N],
                        qzeros int32 [K/g, N/8] (8 for symmetric; the v1 format stores zero - 1),
                        g_idx [K] (k // g when desc_act is off)

Both become the engine's W4 layout (engine/quant/w4.py) once, at load: the packed words as they are
(compressed-tensors) or transposed (GPTQ), the scales rounded to bf16 and repeated per 128 inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint, SafetensorsFile
from duet.engine.errors import CheckpointError
from duet.engine.quant.w4 import GROUP, NIBBLES, W4Weight, repack_scales, unpack_levels

INT4_ROUTES = ("w4a16", "w4a8", "bf16")  # the natural route first
PACKED_DTYPES = ("I32", "U32")


def read_quantization(model_dir: Path, ckpt: SafetensorsCheckpoint) -> Int4Modules | None:
    """The INT4 modules of a checkpoint whose config.json has a quantization_config; None if it has none."""
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).replace("_", "-")
    packing = str(quant.get("packing_format", quant.get("checkpoint_format", "gptq")))
    if method == "compressed-tensors":
        _check_compressed_tensors(quant, config_path)
        return CompressedTensors(ckpt)
    if method in ("gptq", "auto-round") and "gptq" in packing:
        _check_gptq(quant, config_path)
        return GPTQ(ckpt, v1_zeros=packing != "gptq_v2")
    raise CheckpointError(config_path, f"quantization {method!r} ({packing}) is not supported; duet reads "
                                       "compressed-tensors pack-quantized, GPTQ and AutoRound auto_gptq INT4")


def _check_compressed_tensors(quant: dict, path: Path) -> None:
    if quant.get("format") != "pack-quantized":
        raise CheckpointError(path, f"compressed-tensors format {quant.get('format')!r} is not supported; "
                                    "duet reads pack-quantized INT4")
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 4 or not weights.get("symmetric", False) or weights.get("type", "int") != "int":
            raise CheckpointError(path, f"config group {name} is not symmetric 4-bit int weights; duet reads symmetric INT4")


def _check_gptq(quant: dict, path: Path) -> None:
    if quant.get("bits") != 4 or not quant.get("sym", True):
        raise CheckpointError(path, "GPTQ weights must be symmetric 4-bit (bits 4, sym true) for duet")
    if quant.get("desc_act"):
        raise CheckpointError(path, "GPTQ with desc_act (act-order) is not supported; use a desc_act false checkpoint")


class Int4Modules:
    """INT4 weights of a checkpoint by the name the model asks for (`...q_proj.weight`)."""

    description = "INT4"
    routes = INT4_ROUTES
    suffixes: tuple[str, ...] = ()

    def __init__(self, ckpt: SafetensorsCheckpoint):
        self.ckpt = ckpt
        self.files: dict[str, SafetensorsFile] = {n: f for f in ckpt.files for n in f.tensors}
        marker = self.suffixes[0]
        self.modules = {n[: -len(marker)] for n in self.files if n.endswith(marker)}

    def __contains__(self, name: str) -> bool:
        return name.endswith(".weight") and name[: -len(".weight")] in self.modules

    def nbytes(self, name: str) -> int:
        module = name[: -len(".weight")]
        return sum(self.files[module + s].tensors[module + s].nbytes for s in self.suffixes if module + s in self.files)

    def _tensor(self, module: str, suffix: str):
        name = module + suffix
        if name not in self.files:
            raise CheckpointError(self.ckpt.model_dir, f"tensor {name} is missing; the INT4 checkpoint is incomplete")
        return self.files[name].tensors[name]

    def _raw(self, module: str, suffix: str) -> np.ndarray:
        return np.array(self.files[module + suffix].raw(module + suffix))

    def _bad(self, module: str, suffix: str, problem: str) -> CheckpointError:
        return CheckpointError(self.files[module + suffix].path, f"tensor {module + suffix} {problem}")


class CompressedTensors(Int4Modules):
    description = "INT4 compressed-tensors"
    suffixes = (".weight_packed", ".weight_scale", ".weight_shape")

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        module = name[: -len(".weight")]
        packed, scale = self._tensor(module, ".weight_packed"), self._tensor(module, ".weight_scale")
        if packed.dtype not in PACKED_DTYPES or len(packed.shape) != 2:
            raise self._bad(module, ".weight_packed", f"is {packed.dtype} {list(packed.shape)}; expected int32 [N, K/8]")
        N, K = packed.shape[0], packed.shape[1] * NIBBLES
        if (N, K) != shape:
            raise self._bad(module, ".weight_packed", f"holds a [{N}, {K}] weight, the config implies {list(shape)}")
        stated = tuple(int(v) for v in self._raw(module, ".weight_shape").reshape(-1))
        if stated != (N, K):
            raise self._bad(module, ".weight_shape", f"says {list(stated)} but weight_packed holds [{N}, {K}]")
        groups = _groups(scale.shape, 1)
        _check_scales(self, module, ".weight_scale", scale.shape, (N, groups), groups, K)

    def read(self, name: str) -> W4Weight:
        module = name[: -len(".weight")]
        packed = self._raw(module, ".weight_packed").view(np.uint32)
        scales = self.files[module + ".weight_scale"].read_f32(module + ".weight_scale")
        K = packed.shape[1] * NIBBLES
        return W4Weight(packed, repack_scales(scales, K // scales.shape[1], K))


class GPTQ(Int4Modules):
    description = "INT4 GPTQ"
    suffixes = (".qweight", ".scales", ".qzeros", ".g_idx")

    def __init__(self, ckpt: SafetensorsCheckpoint, v1_zeros: bool):
        super().__init__(ckpt)
        self.stored_zero = 7 if v1_zeros else 8  # symmetric zero point 8; the v1 format stores zero - 1

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        module = name[: -len(".weight")]
        qweight, scales = self._tensor(module, ".qweight"), self._tensor(module, ".scales")
        if qweight.dtype not in PACKED_DTYPES or len(qweight.shape) != 2:
            raise self._bad(module, ".qweight", f"is {qweight.dtype} {list(qweight.shape)}; expected int32 [K/8, N]")
        K, N = qweight.shape[0] * NIBBLES, qweight.shape[1]
        if (N, K) != shape:
            raise self._bad(module, ".qweight", f"holds a [{N}, {K}] weight, the config implies {list(shape)}")
        groups = _groups(scales.shape, 0)
        _check_scales(self, module, ".scales", scales.shape, (groups, N), groups, K)
        zeros = self._raw(module, ".qzeros")
        if zeros.shape != (groups, N // NIBBLES) or np.any(unpack_levels(zeros.view(np.uint32)) != self.stored_zero - 8):
            raise self._bad(module, ".qzeros", f"is not the symmetric zero point {self.stored_zero} [{groups}, {N // 8}]; "
                                               "duet reads symmetric GPTQ only")
        if module + ".g_idx" in self.files:
            g_idx = self._raw(module, ".g_idx").reshape(-1)
            if not np.array_equal(g_idx, np.arange(K) // (K // groups)):
                raise self._bad(module, ".g_idx", "reorders inputs (act-order); duet reads desc_act false GPTQ only")

    def read(self, name: str) -> W4Weight:
        module = name[: -len(".weight")]
        packed = np.ascontiguousarray(self._raw(module, ".qweight").view(np.uint32).T)  # [N, K/8]
        scales = self.files[module + ".scales"].read_f32(module + ".scales").T  # [N, K/g]
        K = packed.shape[1] * NIBBLES
        return W4Weight(packed, repack_scales(scales, K // scales.shape[1], K))


def _groups(shape: tuple[int, ...], axis: int) -> int:
    return shape[axis] if len(shape) == 2 else -1


def _check_scales(modules: Int4Modules, module: str, suffix: str, shape: tuple[int, ...],
                  expected: tuple[int, int], groups: int, K: int) -> None:
    """Scales must be [N, K/g] (or [K/g, N]) with g a multiple of 128: one W4 scale per 128 inputs."""
    if shape != expected or groups < 1 or K % groups or (K // groups) % GROUP:
        raise modules._bad(module, suffix, f"has shape {list(shape)}, which does not match its {K}-input weights "
                                           f"in groups of a multiple of {GROUP}: the scales do not match the weights")
