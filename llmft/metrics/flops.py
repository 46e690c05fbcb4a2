"""Training FLOPs per token, peak accelerator throughput, and model FLOPs utilisation (MFU).

Pure arithmetic: nothing heavy is imported here (torch only inside
``detect_device_name``), so the loop and ``llmft plan`` can both use it.
"""

from __future__ import annotations

from llmft.plan.shape import ModelShape

# Dense (no 2:4 sparsity) bf16 tensor-core TFLOPS with fp32 accumulation, from the vendors'
# datasheets. GeForce cards run bf16/fp32-accumulate at half their fp16-accumulate rate, so
# their number is the lower one. V100 and T4 have no bf16: their fp16 number is given.
# A10G (AWS g5) is a cut-down A10 for tensor math: ~70 vs 125.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.0,
    "GH200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM; names like "NVIDIA H100 80GB HBM3"
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 6000 Ada": 364.0,
    "RTX A6000": 155.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
    "T4": 65.0,
    "MI300X": 1307.0,
    "MI325X": 1307.0,
    "MI250X": 383.0,
}


def flops_per_token(shape: ModelShape, seq_len: int, *, peft: bool, adapter_params: int = 0) -> float:
    """Model FLOPs to train on one token (forward + backward), as MFU counts them.

    Full fine-tune (PaLM, Chowdhery et al. 2022, appendix B; Kaplan et al. 2020 table 1;
    Chinchilla, Hoffmann et al. 2022, appendix F)::

        6 * N  +  12 * L * d * T

    where N = ``ModelShape.matmul_params`` (decoder linears + LM head, no embedding), L layers, d
    the attention width (heads x head_dim: the hidden size unless the config's head_dim differs),
    T = ``seq_len`` (the attended context: max_seq_len, or the mean record length when not
    packing). A matmul with N weights costs 2N per token forward and 4N backward (input gradient
    2N + weight gradient 2N). Attention scores (QK^T) and the weighted sum (AV) cost 2 * 2 * T * d
    per layer forward, x3 with backward = 12 L d T. Like PaLM we do not halve it for the causal
    mask, nor count a sliding window's shorter context (gpt-oss: every other layer).

    A mixture of experts counts its active parameters: N holds the routers and the K of E routed
    experts each token goes to, not the others (``ModelShape.matmul_params``), so tokens/s and MFU
    compare with a dense model of the active size. Memory counts every expert (``plan.memory``).

    LoRA / QLoRA / DoRA (``peft=True``)::

        4 * N  +  12 * L * h * T  +  6 * adapter_params

    The frozen base weights get no weight gradient, so their backward is the input gradient
    only: 2N + 2N. The attention term is unchanged: it has no weights, and the gradient
    must still flow through Q, K and V to the adapters of earlier layers. The adapters
    themselves are trained in full (6 per parameter; pass their count when known, it is
    usually < 1% of N).

    Recomputation under gradient checkpointing is not counted (that would be hardware
    FLOPs, not model FLOPs), and neither are norms, activations, softmax or the optimizer.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = shape.matmul_params
    attention = 12 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len
    if peft:
        return float(4 * n + attention + 6 * adapter_params)
    return float(6 * n + attention)


def peak_flops(device_name: str | None, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device, or None when unknown (MFU is then not reported).

    ``device_name`` is what ``torch.cuda.get_device_name()`` returns, e.g. "NVIDIA H100 80GB
    HBM3"; it is matched case-insensitively by substring, longest table key first, so that
    "A100" never matches "A10" and "H100 PCIe" wins over "H100". ``override_tflops`` (for a
    device missing from the table, or a power-capped one) wins over the table.
    """
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"override_tflops must be > 0, got {override_tflops}")
        return override_tflops * 1e12
    if not device_name:
        return None
    name = device_name.lower()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def detect_device_name() -> str | None:
    """The CUDA device name when torch is importable and a GPU is visible, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, num_devices: int = 1) -> float | None:
    """Achieved over peak: ``tokens_per_s * flops_per_token / (peak * num_devices)``.

    ``tokens_per_s`` is the throughput of all ``num_devices`` together; ``peak`` is per device
    (from ``peak_flops``). None when the peak is unknown.
    """
    if peak is None or peak <= 0 or num_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak * num_devices)
