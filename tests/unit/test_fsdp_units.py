"""FSDP2's units on a CPU run (llmft/engines/fsdp.py): a decoder layer's attention and MLP, the
input embedding and the LM head are units of their own, so a step gathers one of them at a time."""

from helpers import TINY_LLAMA, tiny_llama_model

from llmft.engines.fsdp import layer_parts, vocab_units


def test_a_layers_attention_and_mlp_are_its_parts():
    layer = tiny_llama_model().model.layers[0]
    assert layer_parts(layer) == [layer.self_attn, layer.mlp]  # not the norms


def test_a_compiled_layer_keeps_its_parts_in_its_own_unit():
    layer = tiny_llama_model().model.layers[0]
    layer.compile()
    assert layer_parts(layer) == []


def test_the_embedding_is_resharded_after_forward_and_the_head_is_kept_for_backward():
    model = tiny_llama_model(tie_word_embeddings=False)
    assert vocab_units(model) == [(model.model.embed_tokens, True), (model.lm_head, False)]


def test_tied_embedding_and_head_stay_in_the_root():
    model = tiny_llama_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert vocab_units(model) == []


def test_a_score_head_model_has_its_embedding_as_a_unit():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    shape = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    model = LlamaForSequenceClassification(LlamaConfig(**shape, num_labels=1))
    assert vocab_units(model) == [(model.model.embed_tokens, True)]
