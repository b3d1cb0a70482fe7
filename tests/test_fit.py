"""``%gpu fit``: the memory estimate against the published arithmetic, exact parameter counts,
verdicts, and the magic against the test machine's (replayed) H200."""

from __future__ import annotations

import json

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from gpumagic.gpu import fit
from gpumagic.errors import ConfigError

GIB = 1 << 30

# Published shapes (the models' config.json fields).
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                 max_position_embeddings=4096, tie_word_embeddings=False)


def test_parse_count_reads_suffixes_and_scientific_notation():
    assert fit.parse_count("7B") == 7_000_000_000
    assert fit.parse_count("350M") == 350_000_000
    assert fit.parse_count("1.5e9") == 1_500_000_000
    assert fit.parse_count("125k") == 125_000
    assert fit.parse_count("7b") == fit.parse_count("7_000_000_000") == fit.parse_count("7G")
    for bad in ("7X", "seven", "", "0", "-3B"):
        with pytest.raises(ValueError):
            fit.parse_count(bad)


def test_7b_bf16_adamw_training_is_16_bytes_per_parameter_plus_activations():
    """ZeRO (Rajbhandari et al. 2020, 3.1): mixed-precision Adam holds 2 + 2 + 12 = 16 B/param."""
    P = 7_000_000_000
    est = fit.estimate(fit.load_model("7B"), dtype="bf16", train=True, optimizer="adamw", batch=1, seq=512)
    assert est.part("weights") == 2 * P
    assert est.part("gradients") == 2 * P
    assert est.part("optimizer states") == 12 * P
    published = 16 * P  # 112 GB
    assert abs(est.total - published) / published < 0.10, est.total / 1e9
    assert est.total > published  # activations and the CUDA context come on top


def test_7b_bf16_inference_is_2_bytes_per_parameter_plus_kv_cache():
    """Weights at 2 B/param; the KV cache is 2 L b s n_kv d_head x 2 B (Pope et al. 2022)."""
    P = 7_000_000_000
    shape = fit.load_model("7B")
    est = fit.estimate(shape, dtype="bf16", train=False, batch=1, seq=2048)
    assert est.part("weights") == 2 * P
    kv = 2 * shape.layers * 1 * 2048 * shape.kv_heads * shape.head_dim * 2
    assert est.part("KV cache") == kv
    assert abs(est.total - (2 * P + kv)) / (2 * P + kv) < 0.10, est.total / 1e9
    assert abs(est.total - 2 * P) / (2 * P) < 0.15  # the weights are most of it
    # The same with the real LLaMA-2-7B shape from its config.json
    llama = fit.shape_from_config(LLAMA2_7B)
    est = fit.estimate(llama, dtype="bf16", train=False, batch=1, seq=2048)
    arithmetic = 2 * llama.params + 2 * 32 * 2048 * 4096 * 2
    assert abs(est.total - arithmetic) / arithmetic < 0.10


# Counts from Hugging Face transformers 5.24.0 (sum of p.numel() over model.parameters() of
# AutoModelForCausalLM / AutoModel built from each config, shared weights counted once).
SMALL_CONFIGS = [
    (dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=3, num_attention_heads=8,
          num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, tie_word_embeddings=False), 258240),
    (dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
          vocab_size=500, tie_word_embeddings=True, attention_bias=True, mlp_bias=True), 132464),
    (dict(model_type="mistral", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
          num_key_value_heads=4, vocab_size=777, max_position_embeddings=512), 185792),
    (dict(model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
          num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True), 146432),
    (dict(model_type="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=32, vocab_size=1000, tie_word_embeddings=False), 239040),
    (dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=1000, n_positions=128), 222272),
    (dict(model_type="bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
          vocab_size=1000, max_position_embeddings=128, type_vocab_size=2), 176576),
    (dict(model_type="roberta", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
          vocab_size=1000, max_position_embeddings=130, type_vocab_size=1), 176640),
    # published models: LLaMA-2-7B, Qwen2-0.5B, GPT-2 (124M), BERT-base (with its pooler)
    (LLAMA2_7B, 6_738_415_616),
    (dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
          num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True),
     494_032_768),
    (dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024), 124_439_808),
    (dict(model_type="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
          vocab_size=30522, max_position_embeddings=512, type_vocab_size=2), 109_482_240),
]


@pytest.mark.parametrize("cfg, count", SMALL_CONFIGS,
                         ids=[f"{c['model_type']}-{n}" for c, n in SMALL_CONFIGS])
def test_config_json_gives_the_exact_parameter_count(tmp_path, cfg, count):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    shape = fit.load_model(str(path))
    assert shape.params == count
    assert shape.exact
    assert fit.load_model(str(tmp_path)).params == count  # the model's folder works too


def test_counts_match_transformers_when_it_is_installed():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    for cfg, count in SMALL_CONFIGS[:8]:
        hf = transformers.AutoConfig.for_model(**cfg)
        cls = transformers.AutoModel if cfg["model_type"] in ("bert", "roberta") else transformers.AutoModelForCausalLM
        model = cls.from_config(hf)
        assert sum(p.numel() for p in model.parameters()) == count == fit.shape_from_config(cfg).params


def test_activations_follow_korthikanti_34sbh_plus_5as2b_per_layer():
    """Korthikanti et al. 2022, 4.1: s b h (34 + 5 a s / h) bytes per layer (16-bit, dropout,
    a 4h MLP, attention matrices stored)."""
    shape = fit.shape_from_config(dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                                       n_positions=1024))
    s, b, h, a = 1024, 4, 768, 12
    assert fit.layer_activation_bytes(shape, s, b, 2, flash_attention=False) == s * b * h * 34 + 5 * a * s * s * b
    # memory-efficient attention drops the a s^2 b terms; no dropout drops the 1-byte masks
    assert fit.layer_activation_bytes(shape, s, b, 2, flash_attention=True) == s * b * h * 34
    no_drop = fit.with_shape(shape, dropout=False, attn_dropout=False)
    assert fit.layer_activation_bytes(no_drop, s, b, 2, flash_attention=True) == s * b * h * 32


def test_checkpointing_keeps_only_layer_inputs_plus_one_layer():
    shape = fit.shape_from_config(LLAMA2_7B)
    full = fit.estimate(shape, batch=4, seq=2048)
    ckpt = fit.estimate(shape, batch=4, seq=2048, checkpointing=True)
    t = 4 * 2048
    layer = fit.layer_activation_bytes(shape, 2048, 4, 2)
    outside = 2 * t * 4096 * 2 + t * 32000 * 6
    assert full.part("activations") == 32 * layer + outside
    assert ckpt.part("activations") == 32 * 2 * t * 4096 + layer + outside
    assert ckpt.total < full.total


def test_lora_keeps_frozen_weights_without_gradients_or_optimizer_states():
    shape = fit.shape_from_config(LLAMA2_7B)
    est = fit.estimate(shape, lora=16, batch=1, seq=512)
    adapters = 32 * sum(16 * (a + b) for a, b in shape.linear_shapes())
    assert est.trainable == adapters
    assert est.part("weights") == 2 * shape.params + 4 * adapters
    assert est.part("gradients") == 4 * adapters
    assert est.part("optimizer states") == 8 * adapters
    sgd = fit.estimate(shape, optimizer="sgd", batch=1, seq=512)
    assert sgd.part("optimizer states") == 8 * shape.params  # fp32 master + momentum
    fp32 = fit.estimate(shape, dtype="fp32", batch=1, seq=512)
    assert fp32.part("weights") + fp32.part("gradients") + fp32.part("optimizer states") == 16 * shape.params


def test_verdicts_and_what_to_change_first():
    assert fit.verdict(80, 100) == "fits"
    assert fit.verdict(90, 100) == "tight"
    assert fit.verdict(101, 100) == "does not fit"
    est = fit.estimate(fit.load_model("350M"), dtype="fp32", batch=16, seq=1024)
    label, size = fit.card("4090")
    report = fit.check(est, fit.Target(label, size, size))
    assert report.verdict == "does not fit"
    assert report.first.change.startswith("bf16 instead of fp32")  # precision is tried first
    assert report.first.verdict == "fits"
    changes = [s.change for s in report.suggestions]
    assert any(c.startswith("micro-batch 8 instead of 16") for c in changes)
    assert any(c.startswith("gradient checkpointing") for c in changes)
    text = fit.report_text(report)
    assert "an estimate" in text and "DOES NOT FIT" in text and "change first: bf16" in text
    assert "H200 141 GB" in text  # the card table


def test_cards_and_sizes():
    assert fit.card("H200") == ("H200 141 GB", 143771 << 20)
    assert fit.card("a100-40")[1] == 40 << 30 and fit.card("A100")[1] == 80 << 30
    assert fit.card("RTX 4090")[0] == "RTX 4090 24 GB"
    assert fit.card_or_size("24GB") == ("24 GB card", 24 << 30)
    with pytest.raises(ValueError, match="known: t4"):
        fit.card("Voodoo2")


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no file"):
        fit.load_model(str(tmp_path / "nosuch.json"))
    with pytest.raises(ConfigError) as e:
        fit.load_model("meta-llama/Llama-2-7b-hf")
    assert "`%gpu fit 7B`" in e.value.hint
    (tmp_path / "moe.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}), encoding="utf-8")
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        fit.load_model(str(tmp_path / "moe.json"))
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match="as JSON"):
        fit.load_model(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="--dtype"):
        fit.estimate(fit.load_model("1B"), dtype="int4")


def _run(ip, line):
    with capture_output() as cap:
        ip.run_line_magic("gpu", line)
    return cap.stdout + "".join(o.data.get("text/plain", "") + "\n" for o in cap.outputs)  # each on lines of its own


def test_fit_magic_compares_with_the_connected_gpu(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    out = _run(ip, "fit 7B --infer")
    # h200-idle: nvidia-smi's memory.total and memory.used of the recorded H200
    assert "against NVIDIA H200 on testgpu (GPU0)" in out
    assert "-> FITS" in out and "an estimate" in out
    out = _run(ip, "fit 70B --train")
    assert "-> DOES NOT FIT" in out and "change first:" in out


def test_fit_magic_with_a_card_and_bad_arguments(ip, tmp_path):
    out = _run(ip, "fit 7B --card 4090 --batch 8")
    assert "against RTX 4090 24 GB" in out and "DOES NOT FIT" in out
    out = _run(ip, "fit 7B --infer")
    assert "no machine connected: compared with the card table only" in out
    with pytest.raises(UsageError, match="not both"):
        ip.run_line_magic("gpu", "fit 7B --train --infer")
    with pytest.raises(UsageError, match="int4"):
        ip.run_line_magic("gpu", "fit 7B --dtype int4")
    with pytest.raises(UsageError, match="no file"):
        ip.run_line_magic("gpu", f"fit {tmp_path}/nosuch/config.json")
    with pytest.raises(UsageError, match="Voodoo"):
        ip.run_line_magic("gpu", "fit 7B --card Voodoo")
