"""Quantize a model into a flotilla/GPTQ checkpoint, one decoder layer at a time.

    check the source and the options (nothing is written before all checks pass)
    calibration tokens (all but RTN): from --calib, or sampled from the model itself (unrotated)
    --rotate: from here on the source serves the rotated model's tensors (rotate.py)
    --sensitive N: one pass through the float model measuring each linear's INT4 error; the N
                   worst stay at 8 bits (with --keep's choice: quantization_config.dynamic)
    embeddings -> fp16 into the checkpoint; hidden states = embed(tokens), fp32
    for each layer: load it alone in fp32, AWQ-scale it (awq, awq+gptq), quantize its linears
                    (true-sequential: the calibration hidden states go through the layer once, each
                    linear quantized before the stage after it runs, ending as the next layer's
                    inputs), write it, free it
    final norm (+ lm_head when untied, + its matrix with --rotate-tied-head) -> fp16; tokenizer and
                    generation config; commit

Peak memory is one layer's fp32 weights, the calibration hidden states and the shard being
filled (at most --shard-size of quantized tensors), never the whole model in fp32; sampling
calibration text from the model comes first and holds the model in bf16 (fp16 on CUDA) meanwhile.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from flotilla.errors import FlotillaError
from flotilla.models.checkpoint import CheckpointWriter, TOKENIZER_FILES
from flotilla.models.config import ModelConfig, QuantConfig
from flotilla.models.fused_names import unwrapped
from flotilla.models.gguf_source import GGUFSource
from flotilla.models.llama import CausalLM, DecoderLayer
from flotilla.models.sources import open_source
from flotilla.models.tokenizer import load_tokenizer
from flotilla.models.weights import EMBED, HEAD, NORM_MATRIX, load_layer, required_tensor_names
from flotilla.progress import progress_bar

from .activations import CalibrationActivations
from .calibration import generate_tokens, tokens_from_file
from .layer import LayerResult, layer_tensors, quantize_layer
from .head import check_head, head_dynamic, head_tensors
from .mixed import dynamic_entries, keep_choice, measure_errors, most_sensitive, units
from .options import QuantizeOptions
from .rotate import check_tied_head, rotated
from .report import QuantizeReport, linear_storage, peak_gpu_bytes, peak_rss_bytes, source_bytes

NORM = "model.norm.weight"
FP16_MAX = torch.finfo(torch.float16).max


def quantize_model(src: str | Path, out: str | Path, options: QuantizeOptions, progress: bool = True,
                   on_layer: Callable[[int, DecoderLayer, LayerResult], None] | None = None,
                   on_checked: Callable[[Path], None] | None = None) -> QuantizeReport:
    """Quantize `src` into a checkpoint at `out`. `on_layer(index, layer, result)` is called after
    each layer is quantized (tests use it to see the in-memory result); `on_checked(out)` once the
    source, the options and `out` have passed their checks, before anything slow (the CLI says
    there where a defaulted OUT goes)."""
    start = time.perf_counter()
    src = Path(src).expanduser()
    source = open_source(src, native_gguf=False)  # a GGUF is read dequantized to fp32
    if isinstance(unwrapped(source), GGUFSource) and source.quantized_types():
        print(f"note: {src.name} is already quantized ({', '.join(source.quantized_types())}); quantize dequantizes "
              "it to fp32 and requantizes it, so the result carries both roundings (runtime runs the GGUF as it is)",
              file=sys.stderr)
    cfg = source.config
    check_model(cfg, options, str(src))
    check_tensors(source, cfg)
    out = CheckpointWriter.check_target(out, options.force, src)
    CheckpointWriter.check_space(out, checkpoint_bytes(cfg, options), options.shard_size)  # before any work
    note = _partial_group_note(cfg, options.group_size)
    if note:
        print(note, file=sys.stderr)
    device = resolve_device(options.device)
    tokenizer = _try_tokenizer(src, cfg)

    chosen = keep_choice(cfg, options.keep) if options.keep else {}  # before anything slow: a bad pattern fails at once
    if on_checked is not None:
        on_checked(out)
    tokens, calib_from = None, "none"
    if options.needs_calibration:
        if options.calib_file is not None:
            tokens = tokens_from_file(Path(options.calib_file), tokenizer, cfg.vocab_size, options.calib_samples,
                                      options.calib_seq_len, options.seed)
            calib_from = str(options.calib_file)
        else:
            tokens = generate_tokens(source, options.calib_samples, options.calib_seq_len, options.seed, device,
                                     progress)
            calib_from = "model-generated"
    untied_head = norm_matrix = False
    if options.rotate:
        source = rotated(source, options.rotate, options.rotate_scope, options.seed,
                         keep_outliers=not options.rotate_all, tied_head=options.rotate_tied_head,
                         head_bits=options.lm_head_bits)
        cfg, untied_head, norm_matrix = source.config, source.untied_head, source.norm_matrix

    if options.sensitive:
        acts = _activations(source, tokens, cfg, device)
        errors = measure_errors(source, cfg, acts, options, progress)
        del acts
        chosen.update({u: 8 for u in most_sensitive(errors, options.sensitive, chosen)})
    head_bits = options.lm_head_bits
    quant = QuantConfig(bits=options.bits, group_size=options.group_size, sym=options.sym,
                        desc_act=options.act_order, damp_percent=options.damp_percent, method=options.method,
                        dynamic=(head_dynamic(head_bits, options.bits) if head_bits else ()) + dynamic_entries(chosen),
                        lm_head=head_bits is not None, rotation=source.rot.description if options.rotate else "")
    out_cfg = dataclasses.replace(cfg, quant=quant, torch_dtype="float16",  # a quantized head is its own tensor
                                  tie_word_embeddings=cfg.tie_word_embeddings and head_bits is None)
    damp_raised, linear_bytes = 0, 0
    with CheckpointWriter(out, out_cfg, options.shard_size, options.force,
                          size_hint=checkpoint_bytes(cfg, options)) as writer:
        writer.add_layer("embed", {EMBED: _fp16(EMBED, source.get(EMBED))})
        acts = _activations(source, tokens, cfg, device) if options.uses_activations else None
        # the float model's stream: its own copy of the same starting states (no second embedding read)
        fp_acts = CalibrationActivations(acts.hidden.clone(), cfg) if options.fp_targets else None
        bar = progress_bar(range(cfg.num_hidden_layers), desc=f"quantize {options.label}", unit="layer", disable=not progress)
        for i in bar:
            layer = load_layer(source, i, device, torch.float32)
            _check_finite(layer, i, src)
            try:
                result = quantize_layer(layer, i, options, quant, acts, advance=i + 1 < cfg.num_hidden_layers,
                                        fp_acts=fp_acts)
            except ValueError as e:  # degenerate weights or calibration data
                raise FlotillaError(f"{src}: layer {i}: {e}") from None
            damp_raised += result.damp_raised
            if on_layer is not None:
                on_layer(i, layer, result)
            tensors = layer_tensors(layer, i, result.weights)
            linear_bytes += linear_storage(tensors)
            writer.add_layer(str(i), tensors)
            del layer, result
            source.release()
        head = _head_tensors(source, cfg, options, device)
        if untied_head or norm_matrix:  # stored only because of the rotation: counted as the linears' cost
            linear_bytes += sum(t.numel() * t.element_size() for n, t in head.items()
                                if (n.startswith("lm_head.") and untied_head) or n == NORM_MATRIX)
        writer.add_layer("head", head)
        _write_tokenizer(writer, src, tokenizer, cfg)
        writer.commit()
    return QuantizeReport(
        out=out, label=options.label, parameters=parameter_count(cfg), source_bytes=source_bytes(src),
        out_bytes=writer.total_bytes, shards=len(list(out.glob("model-*.safetensors"))),
        seconds=time.perf_counter() - start, peak_rss=peak_rss_bytes(), peak_gpu=peak_gpu_bytes(device),
        calib_tokens=0 if tokens is None else tokens.numel(), calib_from=calib_from, damp_raised=damp_raised,
        bits_per_weight=8 * linear_bytes / sum(u.weights for u in units(cfg)), untied_head=untied_head,
        norm_matrix=norm_matrix, head_bits=options.lm_head_bits,
        kept=tuple(f"{u.label}:{b}" for u, b in sorted(chosen.items(), key=lambda c: (c[0].layer, c[0].merged))))


def _activations(source, tokens: torch.Tensor, cfg: ModelConfig, device: torch.device) -> CalibrationActivations:
    """The calibration hidden states entering layer 0: embed(tokens) in fp32 [N, L, hidden] (Gemma's times
    sqrt(hidden), rounded to the table's dtype first, as CausalLM.embed computes it)."""
    embed = source.get(EMBED)  # in the source's dtype: no fp32 copy of the whole table
    x = F.embedding(tokens, embed)
    if cfg.embed_scale is not None:
        x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
    return CalibrationActivations(x.to(device=device, dtype=torch.float32), cfg)


def check_model(cfg: ModelConfig, options: QuantizeOptions, where: str) -> None:
    """Raise unless every linear of the model can be quantized with these options."""
    if cfg.quant is not None:
        raise FlotillaError(f"{where}: already quantized (quantization_config bits={cfg.quant.bits}); "
                            "quantize needs an unquantized model")
    if options.needs_calibration and options.calib_seq_len > cfg.max_model_len:
        raise FlotillaError(f"--calib-seq-len {options.calib_seq_len} is longer than the model's context "
                            f"({cfg.max_model_len} tokens); pass at most that (default {QuantizeOptions.calib_seq_len})")
    if options.lm_head_bits is not None:
        check_head(cfg, options.lm_head_bits, where)
    if options.rotate_tied_head:
        check_tied_head(cfg, where)
    per_word = 32 // options.bits
    linears = [  # (projections, in_features, out sizes)
        ("q/k/v_proj and gate/up_proj", cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.intermediate_size]),
        ("o_proj", cfg.q_size, [cfg.hidden_size]),
        ("down_proj", cfg.intermediate_size, [cfg.hidden_size]),
    ]
    for name, in_f, outs in linears:  # a group size that does not divide in_f leaves a partial last group
        bad = [n for n in [in_f, *outs] if n % per_word]
        if bad:
            raise FlotillaError(f"{where}: {name} has a dimension of {bad[0]}, not a multiple of {per_word}, "
                                f"which {options.bits}-bit GPTQ packing needs")


def check_tensors(source, cfg: ModelConfig) -> None:
    missing = [n for n in required_tensor_names(cfg) if n not in set(source.names())]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FlotillaError(f"{source.path}: tensor {missing[0]!r} is missing{more}")


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlotillaError(f"--device {name}: no CUDA GPU is available")
    return device


def parameter_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.tie_weights()
    return sum(p.numel() for p in model.parameters())


def checkpoint_bytes(cfg: ModelConfig, options: QuantizeOptions) -> int:
    """About the bytes of the checkpoint's shards: the linears' codes at --bits with a fp16 scale and a
    zero per group and output, every other parameter in fp16 (linears --keep holds wider, and a
    quantized lm_head, make it a little off)."""
    linear = sum(u.weights for u in units(cfg))
    group = options.group_size if options.group_size > 0 else cfg.hidden_size
    per_weight = options.bits / 8 + (2 + options.bits / 8) / group
    return int(linear * per_weight + 2 * (parameter_count(cfg) - linear))


def _partial_group_note(cfg: ModelConfig, group_size: int) -> str | None:
    """Where the group size leaves a short last group on some linear's input: which, and what divides
    them all (vLLM's GPTQ kernels refuse such checkpoints; flotilla and transformers run them)."""
    widths = sorted({cfg.hidden_size, cfg.q_size, cfg.intermediate_size})
    short = [w for w in widths if group_size > 0 and w % group_size]
    if not short:
        return None
    fits = [g for g in (128, 64, 32) if all(w % g == 0 for w in widths)]
    hint = f"--group-size {fits[0]} divides every input" if fits else "--group-size -1 (per channel) loads there"
    what = ("is wider than" if all(group_size > w for w in short) else "leaves a short last group on")
    return (f"note: group size {group_size} {what} the {', '.join(map(str, short))}-wide inputs; flotilla and "
            f"transformers run it, vLLM refuses it ({hint})")


def _try_tokenizer(src: Path, cfg: ModelConfig):
    try:
        return load_tokenizer(src, cfg.eos_token_ids)
    except FlotillaError as e:  # a weights-only source: quantizing still works, calibration text cannot
        print(f"warning: no tokenizer with {src.name} ({e}); the checkpoint is written without one, and "
              f"`runtime` needs it: copy the model's tokenizer.json and tokenizer_config.json into the output",
              file=sys.stderr)
        return None


def _head_tensors(source, cfg: ModelConfig, options: QuantizeOptions, device: torch.device) -> dict[str, torch.Tensor]:
    """The final norm (and its matrix: --rotate-tied-head), and the lm_head: fp16 when untied, or
    quantized (--lm-head-bits, tied or not)."""
    tensors = {NORM: _fp16(NORM, source.get(NORM))}
    if cfg.final_norm_matrix:
        tensors[NORM_MATRIX] = _fp16(NORM_MATRIX, source.get(NORM_MATRIX))
    if options.lm_head_bits is not None:
        tensors.update(head_tensors(source.get(EMBED if cfg.tie_word_embeddings else HEAD), options.lm_head_bits,
                                    options.group_size, options.sym, device))
    elif not cfg.tie_word_embeddings:
        tensors[HEAD] = _fp16(HEAD, source.get(HEAD))
    return tensors


def _check_finite(layer: DecoderLayer, index: int, src: Path) -> None:
    """A layer's weights hold no NaN or infinity (a corrupt or badly converted source would be quantized into
    a checkpoint that generates nothing)."""
    for name, p in layer.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise FlotillaError(f"{src}: layer {index}'s {name} holds NaN or infinite values (a corrupt or badly "
                                "converted source); quantize will not copy them into a checkpoint")


def _fp16(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise FlotillaError(f"tensor {name!r} holds NaN or infinite values (a corrupt or badly converted source); "
                            "quantize will not copy them into a checkpoint")
    if t.dtype != torch.float16 and t.numel() and max(-float(t.min()), float(t.max())) > FP16_MAX:
        raise FlotillaError(f"tensor {name!r} has values beyond fp16's range; it cannot be stored in fp16")
    return t.to(torch.float16)


def _write_tokenizer(writer: CheckpointWriter, src: Path, tokenizer, cfg: ModelConfig) -> None:
    if src.is_dir():
        writer.copy_files(src, TOKENIZER_FILES + ("tokenizer.model",))
    elif tokenizer is not None:
        writer.save_tokenizer(tokenizer)
    if not (src.is_dir() and (src / "generation_config.json").is_file()):
        eos = list(cfg.eos_token_ids)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
        writer.write_file("generation_config.json", json.dumps(gen, indent=2))
