"""Exact-match evaluation by greedy decoding on held-out prompt/completion pairs.

Decoding re-runs the full recurrence on the prompt plus what was generated so far (no KV cache:
the recurrence would need one cache slot per module application); fine for short demo samples.
All TP ranks decode the same rows; data-parallel ranks split the samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimir_megatron.batch import Batch


@torch.no_grad()
def greedy_complete(model, prompts: list[list[int]], stop_id: int, max_new_tokens: int,
                    device: torch.device) -> list[list[int]]:
    """Generate until ``stop_id`` (included) or ``max_new_tokens`` for each prompt."""
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        rows = [p + o for p, o in zip(prompts, outputs)]
        width = max(map(len, rows))
        width += (-width) % model.cfg.tensor_parallel_size  # sequence parallel splits seq
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        seg = torch.zeros_like(ids)
        pos = torch.zeros_like(ids)
        prefix = torch.zeros_like(ids, dtype=torch.bool)
        for r, (row, prompt) in enumerate(zip(rows, prompts)):
            ids[r, : len(row)] = torch.tensor(row)
            seg[r, : len(row)] = 1
            pos[r, : len(row)] = torch.arange(len(row))
            prefix[r, : len(prompt)] = True
        batch = Batch(ids, pos, seg, prefix).to(device)
        logits = model(batch, validate=False).logits
        last = torch.tensor([len(r) - 1 for r in rows], device=device)
        next_ids = logits[torch.arange(len(rows), device=device), last].argmax(-1).tolist()
        for r, token in enumerate(next_ids):
            if not done[r]:
                outputs[r].append(token)
                done[r] = token == stop_id
        if all(done):
            break
    return outputs


@torch.no_grad()
def exact_match(model, samples, *, max_new_tokens: int, device: torch.device, dp_rank: int = 0,
                dp_size: int = 1, dp_group=None, batch_size: int = 64) -> tuple[float, int]:
    """Share of samples whose greedy completion equals the reference exactly; (score, count)."""
    # Similar lengths share a batch: less padding in every decoding step.
    mine = sorted(samples[dp_rank::dp_size], key=lambda s: (len(s.prompt_ids), len(s.completion_ids)))
    correct = 0
    was_training = model.training
    model.eval()
    for start in range(0, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        stop_id = chunk[0].completion_ids[-1]
        generated = greedy_complete(model, [s.prompt_ids for s in chunk], stop_id,
                                    max_new_tokens, device)
        correct += sum(g == list(s.completion_ids) for g, s in zip(generated, chunk))
    model.train(was_training)
    totals = torch.tensor([correct, len(mine)], dtype=torch.float64)
    if dist.is_initialized() and dp_size > 1:
        dist.all_reduce(totals, group=dp_group)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())
