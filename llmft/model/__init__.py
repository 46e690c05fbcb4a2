"""The model of a run: built, quantized, PEFT-wrapped, sped up, materialised shard by shard, saved.

Import the module that owns a name; this package re-exports nothing. Modules, lowest first (each
imports only those above it):

- ``aux_loss``: auxiliary loss terms a component attaches to its module (a router's balancing
  loss), which the training loop adds to each micro loss over a global count;
- ``source``: where a model comes from: its HF config, the name resolved to a local dir or a hub
  id, and the ``UserError``s of finding and loading it;
- ``precision``: the recipe's dtype names, the compute dtype, fp32 trainable weights;
- ``structure``: parameter counts, the one-line description, the decoder-layer classes;
- ``quant``: ``model.quantization`` as a ``BitsAndBytesConfig``, k-bit preparation, the empty
  packed 4-bit layout of a meta-device build;
- ``quant_shard``: one rank's part of a 4-bit weight, quantized bit-identical to the whole;
- ``adapters``: LoRA/DoRA wrapping, the adapters' seeded init, ``base_key``, ``is_peft``;
- ``kernels``: Liger, regional ``torch.compile``, packed-row boundaries for varlen attention
  (the recipe-time refusals are ``llmft.plan.kernels``, with no torch);
- ``heads``: the head the objective's record names (causal LM, or a scalar score for reward models),
  its class and config, and the seeded init of a score head a checkpoint lacks;
- ``build``: ``build_model`` (whole, from a name or from ``model.config``), ``load_base_model``,
  and ``prepare_model``, the one entry the engines call for a model built whole;
- ``meta``: FSDP2's build on the meta device and each rank's shards loaded from safetensors;
- ``zero3``: the same for DeepSpeed ZeRO-3, each rank filling its partitions;
- ``save``: a step's ``model/`` dir and the plain base model (adapters out, 4-bit dequantized),
  used by training and by ``llmft.export.export`` alike;
- ``base_model``: ``checkpoints/base_model``, the random base of a ``model.config`` + PEFT run,
  written once.
"""
