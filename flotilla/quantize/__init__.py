"""Offline quantization: a model in, an INT4/INT8 GPTQ-layout checkpoint out (RTN or GPTQ).

Imports flotilla.models and flotilla.kernels only; never the runtime or the server.
"""
from .options import QuantizeOptions
from .report import QuantizeReport


def quantize_model(src, out, options: QuantizeOptions, progress: bool = True, on_layer=None) -> QuantizeReport:
    """Quantize the model at `src` into a checkpoint at `out`; see flotilla.quantize.pipeline."""
    from .pipeline import quantize_model as run

    return run(src, out, options, progress, on_layer)


__all__ = ["QuantizeOptions", "QuantizeReport", "quantize_model"]
