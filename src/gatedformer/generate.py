"""Sampling text from a trained language model."""

from __future__ import annotations

import torch
from torch import nn

from gatedformer.errors import ConfigError


@torch.no_grad()
def generate(model: nn.Module, vocab, prompt: str, max_tokens: int = 200, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, context: int = 512) -> str:
    """Continue ``prompt`` by ``max_tokens`` sampled tokens; returns prompt plus continuation as text.

    Stateful models (Transformer-XL memory, SRU) are fed one token at a time with their carried
    state; the others re-read the last ``context`` tokens at every step.
    """
    if max_tokens < 1:
        raise ConfigError(f"--tokens must be at least 1, got {max_tokens}")
    if temperature <= 0:
        raise ConfigError(f"--temperature must be positive, got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be 0 (sample among all tokens) or positive, got {top_k}")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = vocab.encode(prompt) if prompt else []
    if not ids:
        ids = [0]
    history = torch.tensor(ids, dtype=torch.long)
    state = None
    logits, state = model(history[-context:].unsqueeze(0).to(device), None)
    stateful = state is not None
    new_ids: list[int] = []
    for _ in range(max_tokens):
        scores = logits[0, -1].float().cpu() / temperature
        if top_k > 0:
            kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        token = int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
        new_ids.append(token)
        history = torch.cat([history, torch.tensor([token])])
        if stateful:
            logits, state = model(torch.tensor([[token]], device=device), state)
        else:
            logits, _ = model(history[-context:].unsqueeze(0).to(device), None)
    return (prompt if prompt else "") + vocab.decode(new_ids)
