import pytest

from llmft.metrics.flops import PEAK_BF16_TFLOPS, flops_per_token, mfu, peak_flops
from llmft.plan.shape import ModelShape

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=320,
)
SEQ = 32

# Hand count for TINY (head_dim 16, so k/v project to 2 kv heads x 16 = 32 features):
#   q 64*64 = 4096, k 64*32 = 2048, v 64*32 = 2048, o 64*64 = 4096  -> attention 12288
#   gate, up, down 3 * 64*128                                        -> mlp 24576
#   one layer 36864, two layers 73728; LM head 320*64 = 20480        -> N = 94208
#   attention scores + weighted sum, fwd + bwd: 12 * L * h * T = 12 * 2 * 64 * 32 = 49152
N = 94208
ATTENTION = 49152
FULL = 6 * N + ATTENTION  # 614400
LORA = 4 * N + ATTENTION  # 425984


def test_hand_count():
    shape = ModelShape.from_config(TINY)
    assert flops_per_token(shape, SEQ, peft=False) == FULL == 614400
    assert flops_per_token(shape, SEQ, peft=True) == LORA == 425984
    # Adapters are trained in full: 6 FLOPs per parameter per token.
    assert flops_per_token(shape, SEQ, peft=True, adapter_params=1000) == LORA + 6000


def test_tied_head_still_costs_a_matmul():
    tied = ModelShape.from_config({**TINY, "tie_word_embeddings": True})
    assert flops_per_token(tied, SEQ, peft=False) == FULL


def test_matches_torch_flop_counter():
    """torch's FlopCounterMode counts every matmul of a real forward + backward (eager attention,
    so the score matmuls are plain bmm): it must equal seq_len x our per-token number."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attn_implementation="eager"))
    x = torch.randint(0, TINY["vocab_size"], (1, SEQ))
    shape = ModelShape.from_config(TINY)

    def counted() -> int:
        with FlopCounterMode(display=False) as fc:
            model(input_ids=x, labels=x).loss.backward()
        return fc.get_total_flops()

    assert counted() == SEQ * flops_per_token(shape, SEQ, peft=False)
    # Frozen weights (as under LoRA): no weight gradients, but the input gradients still flow
    # (the embedding stays trainable so that backward runs through every layer).
    model.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)
    assert counted() == SEQ * flops_per_token(shape, SEQ, peft=True)


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A10G", 70),
        ("NVIDIA A10", 125),
        ("NVIDIA L4", 121),
        ("NVIDIA L40S", 362),
        ("NVIDIA GeForce RTX 4090", 165),
        ("NVIDIA GeForce RTX 3090", 71),
        ("Tesla V100-SXM2-16GB", 125),
        ("AMD Instinct MI300X", 1307),
    ],
)
def test_peak_by_device_name(name, tflops):
    assert peak_flops(name, None) == tflops * 1e12


def test_peak_unknown_and_override():
    assert peak_flops("Some Future GPU", None) is None
    assert peak_flops(None, None) is None
    assert peak_flops("NVIDIA H100 80GB HBM3", 500.0) == 500e12
    with pytest.raises(ValueError):
        peak_flops(None, 0.0)
    assert all(v > 0 for v in PEAK_BF16_TFLOPS.values())


def test_mfu():
    # 8 GPUs of 989 TFLOPS; 100k tokens/s at 6 * 8e9 FLOPs/token = 4.8e15 FLOP/s -> 4.8e15 / 7.912e15.
    assert mfu(1e5, 6 * 8e9, 989e12, 8) == pytest.approx(4.8e15 / (8 * 989e12))
    assert mfu(1e5, 1.0, None, 1) is None
