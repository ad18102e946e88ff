"""A Hugging Face model on shardflow: a tiny ``LlamaForCausalLM`` built from a config (random weights, nothing
downloaded; needs ``transformers``).

``tiny_llama`` is a factory as ``shardflow check`` and ``shardflow plan`` take it: it returns ``(module, batch)``,
and ``module(**batch)`` returns an output whose ``.loss`` is the loss (Hugging Face computes it when given labels):
    shardflow check --model examples/hf_llama.py:tiny_llama --mesh dp=2,tp=2
    shardflow plan --model examples/hf_llama.py:tiny_llama --strategy tp
    shardflow train --model examples/hf_llama.py:tiny_llama --strategy dp
Run as a script, it trains the model with ``shardflow.parallelize`` on a dp=2,tp=2 mesh in this process and loads
the trained weights back into the plain module:
    python examples/hf_llama.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardflow


def tiny_llama(vocab_size: int = 96):
    """2 layers, width 64, 4 attention heads over 2 key/value heads (grouped-query), SwiGLU MLP of 128; a batch of
    4 sequences of 16 tokens, the labels being the tokens (the model shifts them). ``shardflow train --model`` passes
    its tokenizer's ``vocab_size``."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )  # export captures the training forward: no KV cache
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": tokens, "labels": tokens}


def main():
    model, batch = tiny_llama()
    trainer = shardflow.parallelize(model, batch, mesh="dp=2,tp=2", lr=0.5)  # strategy dp,tp: named by the axes
    for step in range(1, 21):
        loss = trainer.step(batch)
        if step % 5 == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    model.load_state_dict(trainer.state_dict())  # the plain module, trained
    print(f"final loss of the plain module: {model(**batch).loss.item():.4f}")


if __name__ == "__main__":
    main()
