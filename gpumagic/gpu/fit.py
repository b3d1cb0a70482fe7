"""Will the model fit on the card?  GPU memory for training or inference, estimated.

Pure arithmetic over a parameter count (``7B``, ``350M``, ``1.5e9``) or a Hugging Face
``config.json``; no I/O beyond reading that file.  :func:`estimate` splits the memory into
weights, gradients, optimizer states, activations (training) or the KV cache (inference),
and an allowance for the CUDA context; :func:`check` compares the total with a GPU's free
memory and says *fits*, *tight* or *does not fit*, with what to change first.

Everything here is an **estimate**: real use also depends on the framework, the allocator's
fragmentation, fused kernels and temporary buffers.  The method and its sources:

Weights, gradients, optimizer states (bytes per parameter ``P``)
    Mixed-precision training with Adam holds 16 bytes per parameter: 16-bit weights (2) and
    gradients (2), plus fp32 master weights, momentum and variance (4 + 4 + 4): Rajbhandari
    et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
    section 3.1 ("2Ψ + 2Ψ + 12Ψ = 16Ψ bytes").  ``--dtype bf16`` / ``fp16`` training is
    counted that way; ``fp32`` training holds 4 (weights) + 4 (gradients) + 8 (Adam's two
    moments) = 16 bytes too.  SGD with momentum keeps one moment instead of two: 12 bytes
    mixed (2 + 2 + 4 master + 4 momentum), 12 in fp32 (4 + 4 + 4).  Inference holds the
    weights alone: 2 bytes per parameter in bf16/fp16, 4 in fp32.
LoRA (``lora`` rank ``r``)
    Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models": a frozen weight
    ``W`` (d_in x d_out) gets trainable ``A`` (d_in x r) and ``B`` (r x d_out), so
    ``r (d_in + d_out)`` trainable parameters per adapted matrix.  Here every linear layer of
    every block is adapted (as QLoRA recommends: Dettmers et al. 2023).  The frozen weights
    take their dtype's bytes and have neither gradients nor optimizer states; the adapters
    are trained in fp32 with the optimizer's bytes (16 for Adam, 12 for SGD).
Activations (training)
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    section 4.1: one transformer layer stores ``s b h (34 + 5 a s / h)`` bytes with 16-bit
    activations (sequence ``s``, micro-batch ``b``, hidden ``h``, ``a`` heads): 11 s b h + 5 a
    s^2 b for attention, 19 s b h for a 4h-wide MLP, 4 s b h for the two layer norms.  The
    terms are kept separately, so that the same count covers other shapes: grouped-query
    attention stores smaller K and V, a gated (SwiGLU) MLP stores four ``s b i`` tensors
    instead of two, models without dropout store no 1-byte masks, and memory-efficient
    attention (PyTorch SDPA, FlashAttention: Dao et al. 2022), the default here, never
    stores the ``a s^2 b`` attention matrices.  Full recomputation (gradient checkpointing
    per layer) keeps only each layer's input, ``2 s b h`` per layer (section 4.1), plus one
    layer's activations while it is recomputed.  The output layer adds its 16-bit logits and
    the fp32 copy the loss is computed on: ``(2 + 4) s b V`` bytes for vocabulary ``V``
    (section 4.3 counts the fp32 ``4 s b V``).
KV cache (inference)
    Two tensors (K and V) per layer, each ``b s n_kv d_head`` values: ``2 L b s n_kv d_head``
    times the dtype's bytes (Pope et al. 2022, "Efficiently Scaling Transformer
    Inference", section 2).  The transient working set of one layer and the last position's
    fp32 logits are added.
CUDA context
    :data:`CONTEXT_BYTES` (0.5 GiB) for the CUDA context, cuBLAS/cuDNN workspaces and the
    allocator's granularity: an allowance, not a measurement; it varies with the driver and
    the libraries loaded.

A bare parameter count has no shape, so one is assumed: a decoder whose hidden size is 128
times its layer count (LLaMA's 4096/32, 5120/40), ``P = 12 L h^2`` (Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", section 2.1, non-embedding parameters), a SwiGLU
MLP 8h/3 wide, 128-wide heads, a 32000-token vocabulary.  The output says so; give the
model's ``config.json`` for its real shape.

Verdicts: *fits* when the total is at most :data:`TIGHT_FRACTION` (85 %) of the free
memory, *tight* up to 100 % (fragmentation and peaks may still run it out), *does not fit*
above.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .._format import format_bytes
from ..errors import ConfigError

GIB = 1 << 30
MIB = 1 << 20
#: CUDA context, library workspaces and allocator granularity: an allowance (bytes).
CONTEXT_BYTES = GIB // 2
#: Share of the free memory up to which an estimate "fits" (above: "tight").
TIGHT_FRACTION = 0.85

#: Bytes per value of each dtype name accepted by ``--dtype``.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Optimizers accepted by ``--optimizer`` (bytes per parameter: see the module docstring).
OPTIMIZERS = ("adamw", "sgd")

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
#: The largest parameter count taken (a thousand times today's largest models): beyond it a
#: count is a typo, and its memory would overflow every table.
MAX_PARAMS = 10**15
_COUNT = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([kmbgt]?)$", re.I)

#: Common cards: name -> (label, memory in MiB as nvidia-smi's ``memory.total`` reports it,
#: or the nominal size in GiB x 1024 where no recording is at hand).
CARDS: dict[str, tuple[str, int]] = {
    "t4": ("Tesla T4 16 GB", 15360),
    "v100": ("V100 32 GB", 32768),
    "v100-16": ("V100 16 GB", 16384),
    "3090": ("RTX 3090 24 GB", 24576),
    "4090": ("RTX 4090 24 GB", 24564),
    "4090d": ("RTX 4090 D 24 GB", 24564),
    "5090": ("RTX 5090 32 GB", 32607),
    "a10": ("A10 24 GB", 24576),
    "l4": ("L4 24 GB", 24576),
    "a6000": ("RTX A6000 48 GB", 49152),
    "l40s": ("L40S 48 GB", 49152),
    "a100-40": ("A100 40 GB", 40960),
    "a100": ("A100 80 GB", 81920),
    "a800": ("A800 80 GB", 81920),
    "h100": ("H100 80 GB", 81559),
    "h800": ("H800 80 GB", 81559),
    "h20": ("H20 96 GB", 98304),
    "h200": ("H200 141 GB", 143771),  # nvidia-smi on an H200 (gpumagic/fake/recordings)
    "b200": ("B200 180 GB", 184320),
}
_CARD_ALIASES = {"a100-80": "a100", "rtx4090": "4090", "rtx3090": "3090", "rtx5090": "5090",
                 "v100-32": "v100", "a100-80g": "a100", "a100-40g": "a100-40"}


# -- the model's shape -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a transformer.

    Attributes
    ----------
    params : int
        Parameter count (all weights, embeddings included).
    layers, hidden, heads, kv_heads, head_dim, intermediate, vocab : int
        Transformer blocks; model width ``h``; attention heads; key/value heads (fewer
        with grouped-query attention); width of one head; MLP width ``i``; vocabulary ``V``.
    gated_mlp : bool
        SwiGLU-style MLP (gate, up, down) instead of two matrices.
    dropout : bool
        The model applies dropout to hidden states (1-byte masks are stored).
    attn_dropout : bool
        Dropout on the attention probabilities.
    causal_lm : bool
        A decoder with an output layer over the vocabulary (logits are counted).
    max_positions : int or None
        Longest sequence the model was built for (the default ``seq``).
    source : str
        Where the shape came from (``config.json (llama)``, ``assumed for 7B parameters``).
    exact : bool
        ``params`` is the exact count for this config (a model family known here).
    """

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True
    dropout: bool = False
    attn_dropout: bool = False
    causal_lm: bool = True
    max_positions: int | None = None
    source: str = ""
    exact: bool = False

    def linear_shapes(self) -> list[tuple[int, int]]:
        """``(d_in, d_out)`` of every linear layer of one block (what LoRA adapts)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = [(h, self.intermediate)] * (2 if self.gated_mlp else 1) + [(self.intermediate, h)]
        return [(h, q), (h, kv), (h, kv), (q, h)] + mlp


def parse_count(text: str) -> int:
    """A parameter count from ``7B``, ``350M``, ``1.5e9``, ``125k``, ``7_000_000_000``.

    Suffixes are decimal (k = 1e3, M = 1e6, B or G = 1e9, T = 1e12), case-insensitive.

    Raises
    ------
    ValueError
        When ``text`` is not such a count (or is not positive, or is over :data:`MAX_PARAMS`).
    """
    t = text.strip().replace("_", "").replace(",", "")
    m = _COUNT.match(t)
    if not m:
        raise ValueError(f"{text!r} is not a parameter count: write it as 7B, 350M or 1.5e9")
    exponent = int(m.group(2) or 0)
    # 10 ** 99999999 would take minutes to compute: past 10**30 no digit can matter
    value = float(m.group(1)) * 10.0 ** max(-30, min(30, exponent)) * _SUFFIX[m.group(3).lower()]
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"{text[:40]!r} is not a positive parameter count: write it as 7B, 350M or 1.5e9")
    if value > MAX_PARAMS:
        raise ValueError(f"{text[:40]!r} is more than {format_count(MAX_PARAMS)} parameters, which no "
                         "model has: write it as 7B, 350M or 1.5e9")
    return int(round(value))


def assumed_shape(params: int) -> ModelShape:
    """A plausible decoder shape for a bare parameter count (see the module docstring).

    ``h = 128 L`` and ``P = 12 L h^2`` give ``h = (128 P / 12)^(1/3)``, rounded to a multiple
    of 128 (the head width), then ``L = round(P / (12 h^2))``.
    """
    hidden = max(128, int(round((128 * params / 12) ** (1 / 3) / 128)) * 128)
    layers = max(1, int(round(params / (12 * hidden * hidden))))
    heads = hidden // 128
    return ModelShape(params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                      head_dim=128, intermediate=int(8 * hidden / 3 / 256 + 0.999) * 256, vocab=32000,
                      gated_mlp=True, max_positions=None, exact=False,
                      source=f"shape assumed: {layers} layers, hidden {hidden}, {heads} heads, "
                             "vocabulary 32000; give the model's config.json for its real shape")


def format_count(n: float) -> str:
    """``6738415616`` -> ``6.74B``; ``124439808`` -> ``124M``."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            v = n / div
            return f"{v:.3g}{suffix}" if v < 100 else f"{v:.0f}{suffix}"
    return str(int(n))


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


#: The largest width, depth, head count or vocabulary a config field may give (2**31 - 1, the
#: frameworks' int32 index); beyond it a field is damaged, and its products overflow.
MAX_FIELD = 2**31 - 1


def _show(v) -> str:
    """``v`` as JSON writes it, cut to about 40 characters (a list or table: its type)."""
    if isinstance(v, str) and len(v) > 40:
        return f"{json.dumps(v[:30])[:-1]}...\" ({len(v)} characters)"
    text = json.dumps(v) if isinstance(v, (int, float, str, bool)) or v is None else type(v).__name__
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} digits)"


def _count(cfg: dict, file: str, *names: str, default=None, minimum: int = 1):
    """The whole number in the first of ``names`` that ``cfg`` gives (or ``default``).

    Raises
    ------
    ConfigError
        Naming the field and the file, for anything but a whole number from ``minimum`` to
        :data:`MAX_FIELD` (a string, NaN, Infinity, zero heads, a bool, a list).
    """
    field = next((n for n in names if cfg.get(n) is not None), None)
    if field is None:
        return default
    v = cfg[field]
    whole = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if not whole or not minimum <= v <= MAX_FIELD:
        raise ConfigError(f"{file}: {field} is {_show(v)}, not a whole number from {minimum} to {MAX_FIELD}",
                          f"fix {field} in {file} (the model's own config.json on the Hub has it "
                          "right), or give its parameter count (e.g. 7B)")
    return int(v)


def _fraction(cfg: dict, file: str, name: str, default: float) -> float:
    """A probability field (a dropout rate) from 0 to 1, or ``default``; ConfigError naming it."""
    v = cfg.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise ConfigError(f"{file}: {name} is {_show(v)}, not a probability from 0 to 1",
                          f"fix {name} in {file}, or give the model's parameter count (e.g. 7B)")
    return float(v)


#: model_type values whose parameter count is exact here (the Hugging Face transformers
#: modeling code of each: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
#: Qwen3ForCausalLM, GPT2LMHeadModel, BertModel/RobertaModel).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
ENCODERS = ("bert", "roberta")


def shape_from_config(cfg: dict, name: str = "config.json") -> ModelShape:
    """The shape and exact parameter count of a Hugging Face ``config.json`` (a dict).

    Field names are those of the transformers configuration classes (``hidden_size`` or
    GPT-2's ``n_embd``, ``num_hidden_layers``/``n_layer``, ``num_attention_heads``/``n_head``,
    ``num_key_value_heads``, ``head_dim``, ``intermediate_size``/``n_inner``,
    ``vocab_size``, ``max_position_embeddings``/``n_positions``, ``type_vocab_size``,
    ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``).  The count is exact for the
    families in :data:`LLAMA_LIKE` (as ``*ForCausalLM``), ``gpt2`` (``GPT2LMHeadModel``,
    tied output layer) and :data:`ENCODERS` (the base model with its pooler), and
    approximate (``exact=False``) for another decoder with the same fields.

    Raises
    ------
    ConfigError
        When a needed field is missing or is not a whole number in range (naming the field
        and the file), when the fields add up to more than :data:`MAX_PARAMS` parameters, or
        for a mixture-of-experts config.
    """
    shape = _shape(cfg, name)
    if shape.params > MAX_PARAMS:
        raise ConfigError(f"{name} describes {format_count(shape.params)} parameters, more than the "
                          f"{format_count(MAX_PARAMS)} of any model: a field is damaged (hidden_size "
                          f"{shape.hidden}, num_hidden_layers {shape.layers}, vocab_size {shape.vocab})",
                          f"fix {name}, or give the model's parameter count (e.g. 7B)")
    return shape


def _shape(cfg: dict, name: str) -> ModelShape:
    mtype = str(cfg.get("model_type", "")).lower()
    if _get(cfg, "num_local_experts", "num_experts", "n_routed_experts"):
        raise ConfigError(f"{name} describes a mixture-of-experts model ({mtype or 'unknown type'}), "
                          "which this estimate does not model",
                          "give its total parameter count instead, e.g. `%gpu fit 47B`")
    h = _count(cfg, name, "hidden_size", "n_embd", "d_model")
    layers = _count(cfg, name, "num_hidden_layers", "n_layer", "num_layers")
    heads = _count(cfg, name, "num_attention_heads", "n_head")
    vocab = _count(cfg, name, "vocab_size")
    missing = [k for k, v in (("hidden_size", h), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
    if missing:
        raise ConfigError(f"{name} has no {', '.join(missing)} (model_type {mtype or 'not given'})",
                          "give the model's own config.json, or its parameter count (e.g. 7B)")
    kv = _count(cfg, name, "num_key_value_heads", default=heads)
    hd = _count(cfg, name, "head_dim", default=max(1, h // heads))
    positions = _count(cfg, name, "max_position_embeddings", "n_positions", "n_ctx")
    q, kvw = heads * hd, kv * hd
    if mtype == "gpt2":
        inner = _count(cfg, name, "n_inner", default=4 * h)
        per_layer = (2 * h + h * 3 * h + 3 * h + h * h + h + 2 * h
                     + h * inner + inner + inner * h + h)
        params = vocab * h + (positions or 0) * h + layers * per_layer + 2 * h
        if cfg.get("tie_word_embeddings") is False:
            params += vocab * h
        drop = _fraction(cfg, name, "resid_pdrop", 0.1) > 0
        return ModelShape(params=params, layers=layers, hidden=h, heads=heads, kv_heads=heads, head_dim=hd,
                          intermediate=inner, vocab=vocab, gated_mlp=False, dropout=drop,
                          attn_dropout=_fraction(cfg, name, "attn_pdrop", 0.1) > 0,
                          causal_lm=True, max_positions=positions, source=f"{name} (gpt2)", exact=True)
    if mtype in ENCODERS:
        inner = _count(cfg, name, "intermediate_size", default=4 * h)
        types = _count(cfg, name, "type_vocab_size", default=2, minimum=0)
        per_layer = 4 * h * h + 4 * h + 2 * h + h * inner + inner + inner * h + h + 2 * h
        params = vocab * h + (positions or 0) * h + types * h + 2 * h + layers * per_layer + h * h + h
        drop = _fraction(cfg, name, "hidden_dropout_prob", 0.1) > 0
        return ModelShape(params=params, layers=layers, hidden=h, heads=heads, kv_heads=heads, head_dim=hd,
                          intermediate=inner, vocab=vocab, gated_mlp=False, dropout=drop,
                          attn_dropout=_fraction(cfg, name, "attention_probs_dropout_prob", 0.1) > 0,
                          causal_lm=False, max_positions=positions, source=f"{name} ({mtype})", exact=True)
    inner = _count(cfg, name, "intermediate_size")
    if inner is None:
        raise ConfigError(f"{name} has no intermediate_size (model_type {mtype or 'not given'})",
                          "give the model's own config.json, or its parameter count (e.g. 7B)")
    if mtype == "qwen2":
        qkv_bias, o_bias = True, False
    elif mtype == "mistral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    attn = h * q + 2 * h * kvw + q * h + (q + 2 * kvw if qkv_bias else 0) + (h if o_bias else 0)
    mlp = 3 * h * inner + (2 * inner + h if mlp_bias else 0)
    norms = 2 * h + (2 * hd if mtype == "qwen3" else 0)
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = vocab * h + layers * (attn + mlp + norms) + h + (0 if tied else vocab * h)
    dropout = _fraction(cfg, name, "attention_dropout", 0.0) > 0
    return ModelShape(params=params, layers=layers, hidden=h, heads=heads, kv_heads=kv, head_dim=hd,
                      intermediate=inner, vocab=vocab, gated_mlp=True, dropout=False, attn_dropout=dropout,
                      causal_lm=True, max_positions=positions, exact=mtype in LLAMA_LIKE,
                      source=f"{name} ({mtype or 'decoder'}{'' if mtype in LLAMA_LIKE else ', LLaMA-like count'})")


def load_model(text: str) -> ModelShape:
    """``MODEL_OR_PARAMS`` of ``%gpu fit``: a parameter count, a ``config.json`` file, or a
    folder holding one (a downloaded model).

    Raises
    ------
    ConfigError
        A path that does not exist or is not JSON, a config without the needed fields, or a
        text that is neither a count nor a path (a Hub model id: download its config.json).
    """
    try:
        return assumed_shape(parse_count(text))
    except ValueError as e:  # a count out of range, unless a file has that name
        count_problem = str(e) if _COUNT.match(text.strip().replace("_", "").replace(",", "")) else ""
    if "\0" in text:
        raise ConfigError(f"{_show(text)} holds a NUL byte (\\0), which no file name can",
                          "give a parameter count (7B, 350M, 1.5e9) or the path of a config.json")
    path = Path(os.path.expanduser(text))
    try:
        if path.is_dir():
            path = path / "config.json"
        is_file = path.is_file()
    except (OSError, ValueError) as e:  # a name too long, a NUL
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"cannot use {_show(text)} as a path: {why}",
                          "give a parameter count (7B, 350M, 1.5e9) or the path of a config.json") from None
    if not is_file and count_problem:
        raise ConfigError(count_problem, "give the model's parameter count (7B, 350M, 1.5e9)")
    if not is_file:
        looks_like_id = "/" in text and not text.startswith((".", "/", "~")) and not path.parent.exists()
        if not looks_like_id:
            raise ConfigError(f"no file {path}",
                              "give a parameter count (7B, 350M, 1.5e9) or the path of a config.json")
        hint = "there is no network lookup: download its config.json (the Hub's Files tab) and give its path"
        count = re.search(r"(\d+(?:\.\d+)?)\s*([bm])\b", text, re.I)
        if count:
            hint += f", or give the count: `%gpu fit {count.group(1)}{count.group(2).upper()}`"
        raise ConfigError(f"{text!r} is not a parameter count or a local config.json", hint)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path} as JSON ({e})",
                          "give a Hugging Face config.json, or a parameter count (7B)") from None
    except RecursionError:
        raise ConfigError(f"cannot read {path} as JSON: it is nested deeper than Python's parser follows",
                          "give a Hugging Face config.json, or a parameter count (7B)") from None
    except ValueError as e:  # an integer of more than 4300 digits (sys.get_int_max_str_digits)
        raise ConfigError(f"cannot read {path} as JSON: a number in it is too long ({str(e).partition(';')[0]})",
                          "give a Hugging Face config.json, or a parameter count (7B)") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} is not a config.json (not a JSON object)",
                          "give a Hugging Face config.json, or a parameter count (7B)")
    if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", "")}
    return shape_from_config(cfg, path.name if path.name != "config.json" else str(path))


# -- the estimate ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One share of the memory: ``name``, ``bytes``, and how it was counted (``how``)."""

    name: str
    bytes: int
    how: str


@dataclass(frozen=True)
class Estimate:
    """GPU memory for one setting (bytes; an estimate, see the module docstring).

    Attributes
    ----------
    shape : ModelShape
    parts : list of Part
        ``weights``, ``gradients``, ``optimizer states``, ``activations`` (training) or
        ``KV cache`` and ``working set`` (inference), ``CUDA context``.
    total : int
        Their sum, bytes.
    dtype, optimizer : str
    train : bool
    batch, seq, lora : int
        Micro-batch, sequence length (tokens), LoRA rank (0: full fine-tuning).
    checkpointing : bool
    trainable : int
        Parameters that get gradients and optimizer states.
    """

    shape: ModelShape
    parts: list
    dtype: str
    train: bool
    optimizer: str
    batch: int
    seq: int
    lora: int
    checkpointing: bool
    trainable: int
    flash_attention: bool = True

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def part(self, name: str) -> int:
        """Bytes of the part called ``name`` (0 when absent)."""
        return sum(p.bytes for p in self.parts if p.name == name)

    @property
    def setting(self) -> str:
        """``bf16 training (AdamW), batch 4 x 2048 tokens, LoRA r=16, checkpointing``."""
        if not self.train:
            return f"{self.dtype} inference, batch {self.batch} x {self.seq} tokens"
        mode = f"{self.dtype} mixed-precision" if self.dtype != "fp32" else "fp32"
        return (f"{mode} training ({'AdamW' if self.optimizer == 'adamw' else 'SGD with momentum'}), "
                f"batch {self.batch} x {self.seq} tokens"
                + (f", LoRA r={self.lora}" if self.lora else "")
                + (", gradient checkpointing" if self.checkpointing else ""))

    def with_(self, **changes) -> "Estimate":
        """The estimate for the same model with some settings changed."""
        kw = dict(dtype=self.dtype, train=self.train, optimizer=self.optimizer, batch=self.batch,
                  seq=self.seq, lora=self.lora, checkpointing=self.checkpointing,
                  flash_attention=self.flash_attention)
        kw.update(changes)
        return estimate(self.shape, **kw)


def layer_activation_bytes(shape: ModelShape, seq: int, batch: int, act_bytes: int = 2, *,
                           flash_attention: bool = True, lora: int = 0) -> int:
    """Bytes one transformer layer stores for the backward pass (Korthikanti et al. 2022, 4.1).

    With ``act_bytes=2``, ``flash_attention=False``, dropout on, a 4h-wide two-matrix MLP and
    as many KV heads as heads, this is exactly ``s b h (34 + 5 a s / h)``.
    """
    t = seq * batch
    e, h, i = act_bytes, shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attn = e * t * (h + h + q + 2 * kv + q)  # norm input, QKV input, Q K V, attention output
    if not flash_attention:  # softmax output (+ dropout mask and output) per head: a s^2 b
        attn += batch * shape.heads * seq * seq * (e + ((1 + e) if shape.attn_dropout else 0))
    mlp = e * t * (h + h) + e * t * i * (4 if shape.gated_mlp else 2)  # norm input, MLP input, MLP inner
    masks = 2 * t * h if shape.dropout else 0  # 1-byte masks after attention and after the MLP
    adapters = 4 * t * lora * len(shape.linear_shapes()) if lora else 0  # x A for each adapter (fp32)
    return attn + mlp + masks + adapters


def estimate(shape: ModelShape, *, dtype: str = "bf16", train: bool = True, optimizer: str = "adamw",
             batch: int = 1, seq: int | None = None, lora: int = 0, checkpointing: bool = False,
             flash_attention: bool = True) -> Estimate:
    """Estimate GPU memory for training or inference (see the module docstring).

    Parameters
    ----------
    shape : ModelShape
    dtype : {"bf16", "fp16", "fp32"}
        Weights and activations (training in bf16/fp16 is mixed precision).
    train : bool
        Training (default) or inference.
    optimizer : {"adamw", "sgd"}
    batch : int
        Micro-batch (sequences per step on this GPU).
    seq : int, optional
        Tokens per sequence (default: the model's ``max_positions``, at most 2048).
    lora : int
        LoRA rank (0: full fine-tuning).
    checkpointing : bool
        Gradient (activation) checkpointing, one checkpoint per layer.
    flash_attention : bool
        Memory-efficient attention (no ``a s^2 b`` matrices stored); True by default.

    Returns
    -------
    Estimate

    Raises
    ------
    ValueError
        For an unknown dtype or optimizer, or a batch, sequence or rank below what is possible.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if seq is None:
        seq = min(shape.max_positions or 2048, 2048)
    if batch < 1 or seq < 1:
        raise ValueError("--batch and --seq take whole numbers >= 1 (e.g. --batch 8 --seq 2048)")
    if lora < 0:
        raise ValueError("--lora takes a rank >= 1 (e.g. --lora 16)")
    if lora and not train:
        lora = 0  # an adapter does not change inference memory measurably
    e = DTYPE_BYTES[dtype]
    P = shape.params
    parts = []
    if not train:
        parts.append(Part("weights", P * e, f"{e} B/param ({dtype})"))
        kv = 2 * shape.layers * batch * seq * shape.kv_heads * shape.head_dim * e
        parts.append(Part("KV cache", kv, f"2 x {shape.layers} layers x {batch} x {seq} tokens x "
                                          f"{shape.kv_heads * shape.head_dim} ({shape.kv_heads} KV heads) x {e} B"))
        work = layer_activation_bytes(shape, seq, batch, e, flash_attention=flash_attention) + 4 * batch * shape.vocab
        parts.append(Part("working set", work, "one layer's activations + last-token fp32 logits"))
        parts.append(Part("CUDA context", CONTEXT_BYTES, "allowance: context, library workspaces"))
        return Estimate(shape, parts, dtype, False, optimizer, batch, seq, 0, False, 0, flash_attention)
    moments = 2 if optimizer == "adamw" else 1
    what = "Adam m and v" if optimizer == "adamw" else "momentum"
    if lora:
        adapters = shape.layers * sum(lora * (a + b) for a, b in shape.linear_shapes())
        parts.append(Part("weights", P * e + adapters * 4,
                          f"frozen {e} B/param ({dtype}) + {format_count(adapters)} LoRA params in fp32"))
        parts.append(Part("gradients", adapters * 4, "fp32, LoRA params only"))
        parts.append(Part("optimizer states", adapters * 4 * moments, f"{4 * moments} B/LoRA param: {what} (fp32)"))
        trainable = adapters
    elif dtype == "fp32":
        parts.append(Part("weights", P * 4, "4 B/param (fp32)"))
        parts.append(Part("gradients", P * 4, "4 B/param (fp32)"))
        parts.append(Part("optimizer states", P * 4 * moments, f"{4 * moments} B/param: {what} (fp32)"))
        trainable = P
    else:
        parts.append(Part("weights", P * 2, f"2 B/param ({dtype})"))
        parts.append(Part("gradients", P * 2, f"2 B/param ({dtype})"))
        parts.append(Part("optimizer states", P * 4 * (1 + moments),
                          f"{4 * (1 + moments)} B/param: fp32 master weights, {what}"))
        trainable = P
    layer = layer_activation_bytes(shape, seq, batch, e, flash_attention=flash_attention, lora=lora)
    t = seq * batch
    if checkpointing:
        acts = shape.layers * e * t * shape.hidden + layer
        how = f"checkpointed: {shape.layers} layer inputs + one layer recomputed"
    else:
        acts = shape.layers * layer
        how = f"{shape.layers} layers x {format_bytes(layer)} (Korthikanti et al. 2022)"
    outside = e * t * shape.hidden * 2  # final norm input, output-layer input
    if shape.causal_lm:
        outside += t * shape.vocab * (e + 4)  # logits and their fp32 copy for the loss
    parts.append(Part("activations", acts + outside, how))
    parts.append(Part("CUDA context", CONTEXT_BYTES, "allowance: context, library workspaces"))
    return Estimate(shape, parts, dtype, True, optimizer, batch, seq, lora, checkpointing, trainable,
                    flash_attention)


# -- the comparison ----------------------------------------------------------------------------


def card(name: str) -> tuple[str, int]:
    """``(label, bytes)`` of a card in :data:`CARDS` (``4090``, ``A100``, ``a100-40``, ``H200``...).

    Raises
    ------
    ValueError
        Naming the known cards.
    """
    key = re.sub(r"[\s_]+", "-", name.strip().lower()).replace("rtx-", "").replace("nvidia-", "")
    key = key.replace("gb", "").rstrip("-")
    key = _CARD_ALIASES.get(key, key)
    if key not in CARDS and key.replace("-", "") in CARDS:
        key = key.replace("-", "")
    if key not in CARDS:
        raise ValueError(f"--card {name!r} is not in the table; known: {', '.join(CARDS)} "
                         "(or give memory in GB: --card 24GB)")
    label, mib = CARDS[key]
    return label, mib * MIB


def card_or_size(text: str) -> tuple[str, int]:
    """A card name from :data:`CARDS` or a size (``24GB``, ``80G``: GiB, as cards are sold)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(gib|gb|g)\s*", text, re.I)
    if m:
        return f"{m.group(1)} GB card", int(float(m.group(1)) * GIB)
    return card(text)


@dataclass(frozen=True)
class Target:
    """What the estimate is compared with: ``label`` and ``free`` bytes (``total`` bytes of the
    card; ``used`` bytes already taken, e.g. by another process)."""

    label: str
    free: int
    total: int
    used: int = 0


def target_from_status(status) -> Target | None:
    """The connected machine's GPU with the most free memory, from a
    :class:`gpumagic.gpu.GpuStatus` (nvidia-smi's ``memory.total`` and ``memory.used``, MiB).

    ``None`` when nvidia-smi did not answer or no GPU reported both values.
    """
    from .smi import known

    if not getattr(status, "ok", False):
        return None
    best = None
    for g in status.gpus:
        if not (known(g.memory_total_mib) and known(g.memory_used_mib)):
            continue
        free = (g.memory_total_mib - g.memory_used_mib) * MIB
        if best is None or free > best.free:
            name = g.name if known(g.name) else "GPU"
            best = Target(f"{name} on {status.host or 'the machine'} ({g.label})", free,
                          g.memory_total_mib * MIB, g.memory_used_mib * MIB)
    return best


def verdict(total: int, free: int) -> str:
    """``fits`` (total at most :data:`TIGHT_FRACTION` of ``free``), ``tight`` (up to all of
    it) or ``does not fit``."""
    if total <= free * TIGHT_FRACTION:
        return "fits"
    if total <= free:
        return "tight"
    return "does not fit"


@dataclass(frozen=True)
class Suggestion:
    """A change (``"micro-batch 4 instead of 8"``) and the estimate after it: ``total`` bytes
    and its :func:`verdict`."""

    change: str
    total: int
    verdict: str


@dataclass(frozen=True)
class FitReport:
    """An estimate compared with a target: the verdict, what to change first, and the card
    table (label, memory bytes, verdict for each of :data:`CARDS`)."""

    estimate: Estimate
    target: Target | None
    verdict: str | None
    suggestions: list = field(default_factory=list)
    cards: list = field(default_factory=list)

    @property
    def first(self) -> Suggestion | None:
        """The change to make first: the first suggestion that fits, else the first one."""
        ok = [s for s in self.suggestions if s.verdict == "fits"]
        return ok[0] if ok else (self.suggestions[0] if self.suggestions else None)


def suggestions(est: Estimate, free: int) -> list[Suggestion]:
    """Changes, in the order to try them, each with the estimate after it: lower precision
    (fp32 -> bf16), a smaller micro-batch (the same effective batch with gradient
    accumulation), gradient checkpointing, LoRA.  Where one alone does not fit but the ones
    so far together do, that combination follows; the last entry is all of them together.
    Only changes that lower the total are listed."""
    steps: list[tuple[str, dict]] = []
    if est.dtype == "fp32":
        steps.append(("bf16 instead of fp32 (mixed precision: torch.autocast(dtype=torch.bfloat16))"
                      if est.train else "load the weights in bf16 (torch_dtype=torch.bfloat16)", {"dtype": "bf16"}))
    if est.batch > 1:
        b = est.batch
        while b > 1 and est.with_(batch=b).total > free * TIGHT_FRACTION:
            b //= 2
        steps.append((f"micro-batch {b} instead of {est.batch}"
                      + (f" (accumulate gradients over {-(-est.batch // b)} steps for the same effective batch)"
                         if est.train else ""), {"batch": b}))
    if est.train and not est.checkpointing:
        steps.append(("gradient checkpointing (model.gradient_checkpointing_enable(); about a third more compute)",
                      {"checkpointing": True}))
    if est.train and not est.lora:
        steps.append(("LoRA rank 16 instead of full fine-tuning (only the adapters get gradients and "
                      "optimizer states)", {"lora": 16}))
    out: list[Suggestion] = []
    so_far: dict = {}
    names: list[str] = []
    for change, kw in steps:
        single = est.with_(**kw)
        if single.total < est.total:
            out.append(Suggestion(change, single.total, verdict(single.total, free)))
        so_far.update(kw)
        names.append(change.split(" (")[0])
        if len(names) > 1 and len(names) < len(steps) and out and out[-1].verdict != "fits":
            both = est.with_(**so_far)
            if verdict(both.total, free) == "fits":
                out.append(Suggestion(" and ".join(names), both.total, "fits"))
    if len(steps) > 1:
        combined = est.with_(**so_far)
        if combined.total < min((s.total for s in out), default=est.total):
            out.append(Suggestion("all of the above together", combined.total, verdict(combined.total, free)))
    return out


def card_table(est: Estimate) -> list[tuple[str, int, str]]:
    """``(label, memory bytes, verdict)`` for every card in :data:`CARDS`, by memory, counting
    the whole card as free."""
    rows = [(label, mib * MIB, verdict(est.total, mib * MIB)) for label, mib in CARDS.values()]
    return sorted(rows, key=lambda r: (r[1], r[0]))


def check(est: Estimate, target: Target | None) -> FitReport:
    """Compare ``est`` with ``target`` (or only with the card table when ``None``)."""
    if target is None:
        return FitReport(est, None, None, [], card_table(est))
    v = verdict(est.total, target.free)
    sugg = suggestions(est, target.free) if v != "fits" else []
    return FitReport(est, target, v, sugg, card_table(est))


# -- rendering (text and HTML) -----------------------------------------------------------------


def _smallest_fitting(report: FitReport) -> str:
    fitting = [label for label, _, v in report.cards if v == "fits"]
    return fitting[0] if fitting else ""


def report_text(report: FitReport) -> str:
    """The report as plain text (what ``%gpu fit`` prints without HTML)."""
    est, s = report.estimate, report.estimate.shape
    lines = [f"GPU memory estimate for {format_count(s.params)} parameters ({_origin(s)})",
             f"  {est.setting}"]
    width = max(len(p.name) for p in est.parts)
    for p in est.parts:
        lines.append(f"  {p.name.ljust(width)}  {format_bytes(p.bytes):>10}  {p.how}")
    lines.append(f"  {'total'.ljust(width)}  {format_bytes(est.total):>10}  an estimate: real use varies with "
                 "the framework and allocator")
    if report.target is not None:
        t = report.target
        lines.append(f"against {t.label}: {format_bytes(t.free)} free of {format_bytes(t.total)} "
                     f"-> {report.verdict.upper()} ({est.total / t.free:.0%} of the free memory)"
                     if t.free > 0 else f"against {t.label}: no memory free -> DOES NOT FIT")
        first = report.first
        if first is not None:
            lines.append(f"change first: {first.change} -> {format_bytes(first.total)} ({first.verdict})")
            for sg in report.suggestions:
                if sg is not first:
                    lines.append(f"  or: {sg.change} -> {format_bytes(sg.total)} ({sg.verdict})")
        if report.verdict != "fits":
            bigger = _smallest_fitting(report)
            if bigger:
                lines.append(f"  or a bigger card: {bigger} fits as it is")
    lines.append("cards, whole memory free:")
    for v in ("fits", "tight", "does not fit"):
        names = [label for label, _, verdict_ in report.cards if verdict_ == v]
        if names:
            lines.append(f"  {v + ':':13} {', '.join(names)}")
    return "\n".join(lines)


def _origin(shape: ModelShape) -> str:
    if shape.source.startswith("shape assumed"):
        return shape.source
    return f"{'exact' if shape.exact else 'approximate'} count from {shape.source}"


def report_html(report: FitReport) -> str:
    """The report as an HTML fragment (a table of parts, the verdict, the card table)."""
    from html import escape

    est, s = report.estimate, report.estimate.shape
    colour = {"fits": "#1a7f37", "tight": "#9a6700", "does not fit": "#cf222e"}
    rows = "".join(f"<tr><td>{escape(p.name)}</td><td style='text-align:right'>{format_bytes(p.bytes)}</td>"
                   f"<td>{escape(p.how)}</td></tr>" for p in est.parts)
    rows += (f"<tr style='font-weight:bold'><td>total</td><td style='text-align:right'>{format_bytes(est.total)}"
             "</td><td>an estimate</td></tr>")
    head = (f"<b>GPU memory estimate</b> for {format_count(s.params)} parameters "
            f"({escape(_origin(s))})<br>{escape(est.setting)}")
    out = [f"<div>{head}<table>{rows}</table>"]
    if report.target is not None:
        t = report.target
        out.append(f"<p>against {escape(t.label)}: {format_bytes(t.free)} free of {format_bytes(t.total)} &rarr; "
                   f"<b style='color:{colour[report.verdict]}'>{escape(report.verdict)}</b></p>")
        if report.first is not None:
            items = "".join(f"<li>{escape(sg.change)} &rarr; {format_bytes(sg.total)} ({escape(sg.verdict)})</li>"
                            for sg in report.suggestions)
            out.append(f"<p>change first: {escape(report.first.change)}</p><ul>{items}</ul>")
    cards = "".join(f"<td style='color:{colour[v]}'>{escape(label)}<br>{escape(v)}</td>"
                    for label, _, v in report.cards)
    out.append(f"<table><tr>{cards}</tr></table></div>")
    return "".join(out)


def with_shape(shape: ModelShape, **changes) -> ModelShape:
    """``shape`` with fields replaced (tests and what-ifs)."""
    return replace(shape, **changes)
