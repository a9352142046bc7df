"""`quantize --rotate`: orthogonal rotations folded into the weights before quantizing (QuaRot/SpinQuant's
weight-only part), so the checkpoint stays a plain Llama GPTQ-layout one that needs nothing at load time.

A rotation spreads each linear's outlier input channels over all channels, so a group's range is set
by typical weights, not by a few large ones. With x the residual stream and Q (hidden x hidden) and
R (head_dim x head_dim) orthogonal, the model computes the same function with:

    R1  residual stream x -> x Q. First every RMSNorm weight g is folded into the linears that read
        its output (W -> W diag(g)) and set to ones: an RMSNorm without a weight commutes with Q
        (rms(x Q) = rms(x)). Then
            embed -> embed Q                       (rows are residual vectors)
            q/k/v, gate/up, lm_head: W -> W Q      (they read the residual: input side)
            o_proj, down_proj:       W -> Qᵀ W     (they write it: output side; bias b -> b Q)
        Residual channels that the norms suppress in many layers (massive activations) are left out
        of Q (Q is the identity on them) and their norm weights stay in the norms (outlier_channels).
        A tied lm_head becomes untied (embed Q ≠ diag(g) embed Q): the checkpoint gains an fp16
        lm_head, counted in the bits per weight of the report. With --rotate-tied-head it stays
        tied instead: an RMSNorm without a weight commutes with Q, so the logits n(x) diag(g) embedᵀ
        are n(x Q) M (embed Q)ᵀ with M = Qᵀ diag(g) Q (hidden x hidden, symmetric): the final norm's
        weight becomes ones and M is stored as `model.norm_matrix.weight` (fp16, as every other float
        tensor of the checkpoint: the runtime computes in fp16/bf16 on a GPU anyway), applied after
        the norm (models/llama.NormMatrix). A flotilla-only checkpoint: other readers ignore M.
    R2  each attention head's values v_h -> v_h R: v_proj's rows of each KV head W -> Rᵀ W (bias
        b -> b R), o_proj's columns of every query head W -> W R (one R for all heads, so a KV head
        and its GQA query group agree). Attention mixes values linearly, so this is exact. R2 alone
        (--rotate-scope r2) leaves the residual stream, the norms and a tied lm_head as they are.

RotatedSource wraps a weight source and serves the rotated tensors (fp32) under the same names;
everything downstream (calibration activations, --sensitive, AWQ, GPTQ) sees the rotated model.
"""
from __future__ import annotations

import dataclasses
import re
import sys

import torch

from flotilla.errors import FlotillaError
from flotilla.models.config import ModelConfig
from flotilla.models.weights import EMBED, HEAD, NORM_MATRIX

from .hadamard import hadamard, rotation

NORM = "model.norm.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_READS = {  # layer tensor -> the norm whose output it reads
    "self_attn.q_proj.weight": "input_layernorm", "self_attn.k_proj.weight": "input_layernorm",
    "self_attn.v_proj.weight": "input_layernorm",
    "mlp.gate_proj.weight": "post_attention_layernorm", "mlp.up_proj.weight": "post_attention_layernorm",
}
_WRITES = ("self_attn.o_proj", "mlp.down_proj")
_WRITE_WEIGHTS, _WRITE_BIASES = tuple(f"{p}.weight" for p in _WRITES), tuple(f"{p}.bias" for p in _WRITES)


SUPPRESSED = 0.1  # a norm weight below this fraction of its norm's median suppresses its channel
SUPPRESSING_SHARE = 0.1  # a channel suppressed by this share of the norms (2 at least) carries outliers


def _norm_names(cfg: ModelConfig) -> list[str]:
    layers = [f"model.layers.{i}.{n}.weight" for i in range(cfg.num_hidden_layers)
              for n in ("input_layernorm", "post_attention_layernorm")]
    return layers + [NORM]


def outlier_channels(source, cfg: ModelConfig, kind: str) -> list[int]:
    """The residual channels left out of R1: those the model's RMSNorms suppress (weight near 0) in
    many layers, where its massive activations live (SmolLM2-135M: 247 and 507). Folded into the
    weights and rotated, such a channel's norm weight no longer scales the weights' rounding error,
    which the channel's activations (the whole of the RMS-normed vector at an attention-sink token)
    then multiply. For a Hadamard R1 the set grows by the next most suppressed channels until the
    rest has a Hadamard order (576 - 4 = 572 = 571 + 1, Paley I)."""
    counts, relative = torch.zeros(cfg.hidden_size), torch.zeros(cfg.hidden_size)
    for name in _norm_names(cfg):
        g = source.get(name).float().abs()
        counts += (g < SUPPRESSED * g.median()).float()
        relative += g / g.median()
    order = sorted(range(cfg.hidden_size), key=lambda c: (-float(counts[c]), float(relative[c])))
    need = max(2.0, SUPPRESSING_SHARE * len(_norm_names(cfg)))
    k = int((counts >= need).sum())
    if k and kind == "hadamard":
        k = next((n for n in range(k, k + 9) if hadamard(cfg.hidden_size - n) is not None), k)
    return sorted(order[:k])


@dataclasses.dataclass(frozen=True)
class Rotation:
    """The orthogonal matrices of one model (fp32): q (hidden, identity on the `kept` channels; or
    None: R2 only), r (head_dim, or None: R1 only)."""

    q: torch.Tensor | None
    r: torch.Tensor | None
    kept: tuple[int, ...]  # residual channels R1 leaves alone (their norm weights stay in the norms)
    description: str  # recorded in quantization_config.flotilla_rotation

    @classmethod
    def build(cls, source, kind: str, scope: str, seed: int, keep_outliers: bool = True) -> "Rotation":
        cfg = source.config
        q, r, kept, parts = None, None, (), []
        if "r1" in scope:
            kept = tuple(outlier_channels(source, cfg, kind)) if keep_outliers else ()
            rest = [c for c in range(cfg.hidden_size) if c not in set(kept)]
            block, name = rotation(len(rest), kind, seed)
            q = torch.eye(cfg.hidden_size, dtype=torch.float64)
            q[torch.tensor(rest)[:, None], torch.tensor(rest)[None, :]] = block  # identity on the kept channels
            parts.append(f"r1 {name}" + (f" (channels {', '.join(map(str, kept))} kept)" if kept else ""))
        if "r2" in scope:
            r, name = rotation(cfg.head_dim, kind, seed + 1)
            parts.append(f"r2 {name}")
        return cls(None if q is None else q.float(), None if r is None else r.float(), kept,
                   ", ".join(parts + [f"seed {seed}"]))


class RotatedSource:
    """A weight source whose tensors are those of the rotated model (module docstring), in fp32;
    with R1, `config` is the source's with tie_word_embeddings off and `lm_head.weight` always present,
    or, `tied_head` (and a tied source), with final_norm_matrix on and `model.norm_matrix.weight` present."""

    def __init__(self, source, rot: Rotation, tied_head: bool = False):
        self.source, self.rot = source, rot
        self.path, self.opened_files = source.path, getattr(source, "opened_files", [])
        r1_ties = rot.q is not None and source.config.tie_word_embeddings  # R1 on a tied head
        self.untied_head = r1_ties and not tied_head  # the checkpoint gains an lm_head
        self.norm_matrix = r1_ties and tied_head  # the checkpoint gains model.norm_matrix.weight
        self.config = (dataclasses.replace(source.config, final_norm_matrix=True) if self.norm_matrix
                       else dataclasses.replace(source.config, tie_word_embeddings=False) if rot.q is not None
                       else source.config)
        self._kept = torch.zeros(source.config.hidden_size, dtype=torch.bool)
        self._kept[list(rot.kept)] = True

    def release(self) -> None:
        self.source.release()

    def names(self) -> list[str]:
        names = self.source.names()
        extra = [HEAD] * (self.untied_head and HEAD not in names) + [NORM_MATRIX] * self.norm_matrix
        return names + extra

    def get(self, name: str) -> torch.Tensor:
        q = self.rot.q
        if q is None:
            return self._r2_only(name)
        if name == EMBED:
            return self._f32(EMBED) @ q
        if name == HEAD:
            head = EMBED if self.untied_head else HEAD
            return (self._f32(head) * self._folded(NORM)) @ q
        if name == NORM:
            return torch.ones(self.config.hidden_size) if self.norm_matrix else self._left(NORM)
        if name == NORM_MATRIX and self.norm_matrix:
            return (q.T * self._f32(NORM)) @ q  # Qᵀ diag(g) Q [hidden, hidden]
        m = _LAYER.match(name)
        if m is None:
            return self.source.get(name)
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest.endswith("layernorm.weight"):
            return self._left(name)
        if rest in _READS:
            w = (self._f32(name) * self._folded(prefix + _READS[rest] + ".weight")) @ q
            return self._heads_out(w) if rest.startswith("self_attn.v_proj") else w
        if rest == "self_attn.v_proj.bias":
            return self._heads_out(self._f32(name))
        if rest == "self_attn.o_proj.weight":
            return q.T @ self._heads_in(self._f32(name))
        if rest in _WRITE_WEIGHTS:
            return q.T @ self._f32(name)
        if rest in _WRITE_BIASES:
            return self._f32(name) @ q
        return self.source.get(name)  # q/k/gate/up biases: their outputs are not rotated

    def _r2_only(self, name: str) -> torch.Tensor:
        if name.endswith(("self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            return self._heads_out(self._f32(name))
        if name.endswith("self_attn.o_proj.weight"):
            return self._heads_in(self._f32(name))
        return self.source.get(name)

    def _folded(self, norm: str) -> torch.Tensor:
        """The part of a norm's weight g folded into its readers: g, and on the kept channels the
        median |g| (so their weight columns have the scale of the others in their groups)."""
        g = self._f32(norm)
        return torch.where(self._kept, g.abs().median(), g)

    def _left(self, norm: str) -> torch.Tensor:
        """What stays in the norm: g / median |g| on the kept channels, 1 elsewhere (commutes with Q)."""
        g = self._f32(norm)
        return torch.where(self._kept, g / g.abs().median(), 1.0)

    def _f32(self, name: str) -> torch.Tensor:
        return self.source.get(name).float()

    def _heads_out(self, w: torch.Tensor) -> torch.Tensor:
        """R2 on v_proj's output rows: each KV head's [head_dim, in] block -> Rᵀ block (a bias [out]
        as one column)."""
        if self.rot.r is None:
            return w
        d, cols = self.rot.r.shape[0], w.reshape(w.shape[0], -1)
        return (self.rot.r.T @ cols.reshape(-1, d, cols.shape[1])).reshape(w.shape)  # [heads, d, in]

    def _heads_in(self, w: torch.Tensor) -> torch.Tensor:
        """R2 on o_proj's input columns: each query head's [out, head_dim] block -> block R."""
        if self.rot.r is None:
            return w
        d = self.rot.r.shape[0]
        return (w.reshape(w.shape[0], -1, d) @ self.rot.r).reshape(w.shape)  # [out, heads, d]


def check_tied_head(cfg: ModelConfig, where: str) -> None:
    """--rotate-tied-head is for a model whose lm_head is its embedding."""
    if not cfg.tie_word_embeddings:
        raise FlotillaError(f"{where}: --rotate-tied-head keeps a tied lm_head tied, but this model's lm_head is "
                            "its own tensor (tie_word_embeddings is false) and R1 rotates it as it is; drop the flag")


def rotated(source, kind: str, scope: str, seed: int, keep_outliers: bool = True,
            tied_head: bool = False, head_bits: int | None = None) -> RotatedSource:
    """`source` rotated (--rotate KIND --rotate-scope SCOPE [--rotate-tied-head]); says on stderr what was used
    (`head_bits`: --lm-head-bits, the untied head's width as written)."""
    if source.config.sandwich_norms:
        raise FlotillaError("--rotate: Gemma 2 and 3 norm the attention's and the MLP's outputs before the residual "
                            "adds, which a rotation of the residual stream does not pass through; quantize it without "
                            "--rotate")
    rot = Rotation.build(source, kind, scope, seed, keep_outliers)
    out = RotatedSource(source, rot, tied_head)
    note = f"rotation: {rot.description}"
    if kind == "hadamard" and "random" in rot.description:
        note += " (no Hadamard matrix of that order is built here: a random orthogonal one instead)"
    if out.untied_head:
        head = f"a {head_bits}-bit" if head_bits else "an fp16"
        note += f"; the tied lm_head is untied ({head} lm_head is written; --rotate-tied-head keeps it tied)"
    elif out.norm_matrix and head_bits:
        note += (f"; the final norm's weight becomes a hidden x hidden matrix, and a {head_bits}-bit lm_head is "
                 "written apart (--lm-head-bits)")
    elif out.norm_matrix:
        note += "; the lm_head stays tied (the final norm's weight becomes a hidden x hidden matrix)"
    print(note, file=sys.stderr)
    return out
