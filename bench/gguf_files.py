"""GGUF files for the benchmarks, made from the embedded default model (nothing is downloaded).

    f32_gguf(src, out)           the same model with every tensor dequantized to F32: llama.cpp's
                                 tensor names, order and q/k layout, and the file's metadata and
                                 tokenizer, so llama.cpp loads it
    requantized_gguf(src, kind)  that F32 file through llama.cpp's own quantizer
                                 (llama_cpp.llama_model_quantize), e.g. "Q4_K_M"; cached under
                                 $FLOTILLA_CACHE_DIR/bench/

SmolLM2's rows of 576 are not whole 256-weight K blocks, so llama.cpp's Q4_K_M of it keeps Q4_K
and Q6_K for the rows of 1536 (ffn_down) and falls back to Q5_0 / Q8_0 for the others.
"""
from __future__ import annotations

import os
from pathlib import Path

LLAMA_FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q4_0": 2}  # llama.h llama_ftype
_SKIP_FIELDS = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version")


def f32_gguf(src: Path, out: Path) -> Path:
    """Write `src` with all tensors in F32 (metadata copied, general.file_type = ALL_F32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith(_SKIP_FIELDS):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:  # same names, same order, q/k rows still in llama.cpp's permutation
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def requantized_gguf(src: Path, kind: str = "Q4_K_M", cache: Path | None = None) -> Path:
    """`src` requantized by llama.cpp to `kind` (made once, then cached)."""
    import llama_cpp

    from flotilla.envs import cache_dir

    directory = cache or cache_dir() / "bench"
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{src.stem}.{kind}.gguf"
    if out.is_file():
        return out
    f32 = f32_gguf(src, directory / f"{src.stem}.F32.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[kind]
    params.nthread = 2
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params)
    f32.unlink()
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({kind}) failed with code {rc}")
    os.replace(tmp, out)
    return out
