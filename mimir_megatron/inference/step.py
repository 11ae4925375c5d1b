"""One scheduling step of the engine as one flattened forward pass.

A step feeds the model the new token of every decoding row and the whole prompt of every request
that joins the batch, as one ``[tokens, hidden]`` sequence without padding: each linear of each
layer application is one matrix product over all of them (the weights are read once per step,
not once for the decoding rows and again for the prompts), and only attention looks at rows:

- decoding rows (``0 .. d - 1`` of the :class:`~mimir_megatron.inference.kv_cache.KVCache`): the
  new keys and values are written at each row's length, and each row's new query attends its
  cached tokens;
- joining prompts (rows ``d ..``): their keys and values fill fresh rows, and attention is
  bidirectional inside each prompt (PrefixLM: the prompt is the prefix).

The arithmetic is the model's, in its order (``inference/fast_stack.py`` spells it out): the
parameterless RMSNorm, the fused q / gate / k / v projection, RoPE on q and k (rotate-half, the
pass's table: equal to :class:`~mimir_megatron.model.rope.RotaryTable`), the sigmoid output gate
(fp32 for a bf16 model, cast back), SwiGLU, the residual adds after the output projections, the
stack's exit norm after every application; after the attention of the last layer of the last H
application only each row's last token goes on (every token's keys and values are cached by then,
and nothing reads the others' final states). Parameters are read from the modules at each call;
the weight products go through ``inference/products.py`` (on CPU: on weights prepacked once for
oneDNN, remade when a weight changes in place), the norms and the attention half of each layer
through ``inference/step_ops.py`` (on CPU for fp32: C kernels; elsewhere torch's operations).
``tests/integration/test_inference.py`` checks it against megatron's layers and a full forward.

Not covered (:meth:`StepForward.of` returns None; the engine then runs the model's own recurrence
per pass, :meth:`~mimir_megatron.inference.engine.InferenceEngine.forward`): training mode,
Transformer Engine layers, FP8, sequence parallelism, query groups shared by several heads,
fewer heads than TP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from megatron.core import parallel_state

from mimir_megatron import backend
from mimir_megatron.inference.kv_cache import DecodeRows, KVCache
from mimir_megatron.inference.products import Products, products_for
from mimir_megatron.inference.step_ops import Prompts, StepTokens, TorchOps, ops_for
from mimir_megatron.model.rope import RotaryTable, rotary_angles


@dataclass
class _Layer:
    eps_attention: float
    eps_mlp: float
    qkv: torch.nn.Module
    proj: torch.nn.Module
    fc1: torch.nn.Module
    fc2: torch.nn.Module
    heads: int
    head_dim: int
    scale: float | None


class StepForward:
    """The recurrence over one step's flat tokens, with the model's weights and the cache."""

    def __init__(self, model, compile_decode: bool = False) -> None:
        self.model = model
        self.cfg = model.cfg
        self._group = parallel_state.get_tensor_model_parallel_group()
        self._reduce = parallel_state.get_tensor_model_parallel_world_size() > 1
        self._stacks = {"L": self._layers(model.L), "H": self._layers(model.H)}
        self._exit_eps = {"L": model.L.final_layernorm.eps, "H": model.H.final_layernorm.eps}
        first = next(model.parameters())
        self.products: Products = products_for(first.device)
        """The weight products (``inference/products.py``); a benchmark may swap them."""
        self.ops: TorchOps = ops_for(first.device, first.dtype)
        """The norms and attention (``inference/step_ops.py``); a benchmark may swap them."""
        self._compiled = None
        if compile_decode:  # decoding-only steps compiled (see _compiled_decode)
            self._compiled = torch.compile(self._decode_graph, **backend.decode_compile_options(first.device))
        self._static_shapes = backend.uses_cuda_graphs(first.device)

    @classmethod
    def of(cls, model, compile_decode: bool = False) -> "StepForward | None":
        """The step for ``model`` (in eval mode), or None where it does not apply (module docstring)."""
        cfg = model.cfg
        if (model.training or model.layer_backend != "local" or cfg.uses_sequence_parallel
                or cfg.execution.fp8 != "none"
                or cfg.num_attention_heads < cfg.parallel.tensor_parallel_size):
            return None
        for block in (model.L, model.H):
            for layer in block.layers:
                attn = layer.self_attention
                if attn.num_attention_heads_per_partition != attn.num_query_groups_per_partition:
                    return None
        return cls(model, compile_decode)

    @staticmethod
    def _layers(block) -> list[_Layer]:
        layers = []
        for layer in block.layers:
            attn, mlp = layer.self_attention, layer.mlp
            layers.append(_Layer(
                layer.input_layernorm.eps, layer.pre_mlp_layernorm.eps,
                attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2,
                attn.num_attention_heads_per_partition, attn.hidden_size_per_attention_head,
                attn.core_attention.softmax_scale,
            ))
        return layers

    @torch.no_grad()
    def __call__(self, cache: KVCache, tokens: list[int], prompts: list[list[int]], plan) -> torch.Tensor:
        """``[decoding rows + prompts, hidden]``: the final high-level state of each row's last token
        (decoding rows in cache order, then the prompts, which become the cache's next rows).
        ``tokens``: the new token of each of the cache's rows (none or all of them)."""
        if tokens and len(tokens) != cache.rows:
            raise ValueError(f"a step feeds every cached row: {cache.rows} rows, {len(tokens)} tokens")
        if self._compiled is not None and tokens and not prompts:
            return self._compiled_decode(cache, tokens, plan)
        device = cache.device
        decoding = len(tokens)
        decode = cache.decode_rows(decoding) if decoding else None
        groups: list[Prompts] = []
        offset, row = decoding, cache.rows
        for prompt in prompts:
            n = len(prompt)
            if groups and groups[-1].length == n:
                groups[-1].count += 1
            else:
                groups.append(Prompts(row, 1, n, offset))
            offset, row = offset + n, row + 1
        cache.reserve(row, max([decode.key_length if decode else 0, *map(len, prompts)]))

        ids = list(tokens)
        positions = list(cache.lengths[:decoding])
        for prompt in prompts:
            ids.extend(prompt)
            positions.extend(range(len(prompt)))
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=device)
        rotary = RotaryTable(rotary_angles(positions_t[None], self.cfg.head_dim, self.cfg.rope_theta))
        z_H = self.model._embed(ids_t[None]).view(len(ids), -1)  # [tokens, hidden]
        step = StepTokens.of(decode, groups, rotary)
        self.ops.prepare(step)
        last = None  # each row's last token: all of them when only decoding rows step
        if prompts:
            rows = list(range(decoding))
            for g in groups:
                rows.extend(g.offset + (i + 1) * g.length - 1 for i in range(g.count))
            last = torch.tensor(rows, device=device)
        z_H = self._recurrence(z_H, cache.buffers, plan.schedule, step, self.products, self.ops, last)
        cache.commit([1] * decoding)
        cache.add_rows([len(p) for p in prompts])
        return z_H

    def _recurrence(self, z_H: torch.Tensor, buffers, schedule: tuple[str, ...], step: StepTokens,
                    products: Products, ops: TorchOps, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The applications of ``schedule`` from the embedded tokens ``z_H``; ``buffers(slot,
        like)``: the cache's key and value buffers of a slot. ``keep``: the tokens whose final
        state is wanted (all when None), in the order returned. Their rows alone go through the
        last layer after its attention, when the last application is H's: by then every token's
        keys and values are cached, and nothing else reads the other tokens' final states (a
        64-token prompt of mid512: ~2 % of the prefill's products)."""
        z_L = self.model.z_L_init.to(z_H.dtype).expand_as(z_H)
        last = len(schedule) - 1
        for application, module in enumerate(schedule):
            if module == "L":
                z_L = self._stack("L", z_L + z_H, buffers, application, step, products, ops)
            else:
                z_H = self._stack("H", z_H + z_L, buffers, application, step, products, ops,
                                  keep if application == last else None)
        if keep is not None and schedule[-1:] != ("H",):
            z_H = z_H.index_select(0, keep)
        return z_H

    def _compiled_decode(self, cache: KVCache, tokens: list[int], plan) -> torch.Tensor:
        """A decoding-only step through the compiled graph: tensors in (write positions, the
        attention mask), tensors out. With static shapes (CUDA graphs: one graph replayed step
        after step) the rows are padded to a power of two and every allocated position is
        attended; with dynamic shapes (CPU) the step's rows attend its longest row's length. A
        single row is padded to two either way: torch specialises a dimension of size 1, and a
        second graph for it would cost a second compile. Padding rows write into free cache
        rows at position 0 and attend to that position alone."""
        rows = len(tokens)
        padded = 1 << (rows - 1).bit_length() if self._static_shapes else rows
        padded = max(padded, 2)
        attended = max(cache.lengths) + 1
        if self._static_shapes:
            cache.reserve(padded, attended)
            attended = cache.position_room
        else:  # room beyond the step's rows and length: a slice never spans a whole buffer, which
            cache.reserve(padded + 1, attended + 1)  # torch would guard on (a recompile)
        lengths = cache.lengths + [0] * (padded - rows)
        device = cache.device
        positions = torch.tensor(lengths, dtype=torch.long, device=device)
        mask = torch.zeros(padded, 1, 1, attended, device=device)
        beyond = torch.arange(attended, device=device)[None, :] > positions[:, None]
        mask.masked_fill_(beyond[:, None, None, :], float("-inf"))
        ids = torch.tensor(tokens + [0] * (padded - rows), dtype=torch.long, device=device)
        # No duck sizing: sizes that happen to be equal at the first compile (the cache's
        # positions and the head width, say) would otherwise be guarded equal (a recompile).
        with fx_config.patch(use_duck_shape=False):
            hidden = self._compiled(cache.all_buffers(), ids, positions, mask, plan.schedule)
        cache.commit([1] * rows)
        return hidden[:rows]

    def _decode_graph(self, buffers: dict, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                      schedule: tuple[str, ...]) -> torch.Tensor:
        """What :meth:`_compiled_decode` compiles: tensors in, tensors out, shapes from the inputs'."""
        rows = ids.shape[0]
        decode = DecodeRows(rows, mask.shape[-1], None, positions, mask,
                            torch.arange(rows, device=ids.device))
        rotary = RotaryTable(rotary_angles(positions[None], self.cfg.head_dim, self.cfg.rope_theta))
        z_H = self.model._embed(ids[None]).view(rows, -1)
        # The weights as stored and torch's operations: the compiler chooses its own kernels.
        step = StepTokens.of(decode, [], rotary)
        return self._recurrence(z_H, lambda slot, like: buffers[slot], schedule, step, Products(),
                                TorchOps())

    def _stack(self, name: str, hidden: torch.Tensor, buffers, application: int, step: StepTokens,
               products: Products, ops: TorchOps, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One application of a stack; ``keep``: the rows that go on after the last layer's
        attention (:meth:`_recurrence`)."""
        tokens, width = hidden.shape
        layers = self._stacks[name]
        for number, layer in enumerate(layers, start=1):
            x = ops.norm(hidden, layer.eps_attention)
            # The fused projection holds, per head (one head per query group), q, gate, k, v.
            mixed = products.linear(x, layer.qkv.weight).view(tokens, layer.heads, 4, layer.head_dim)
            keys, values = buffers((application, number), mixed[:, :, 2])
            context = ops.attend(mixed, keys, values, step, layer.scale, hidden.dtype)
            if keep is not None and number == len(layers):
                hidden, context = hidden.index_select(0, keep), context.index_select(0, keep)
            hidden = self._residual(hidden, context, layer.proj.weight, products)
            up = products.linear(ops.norm(hidden, layer.eps_mlp), layer.fc1.weight)
            up_gate, up = torch.chunk(up, 2, dim=-1)
            hidden = self._residual(hidden, F.silu(up_gate).mul_(up), layer.fc2.weight, products)
        return ops.norm(hidden, self._exit_eps[name])

    def _residual(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  products: Products) -> torch.Tensor:
        """``hidden + x W^T``; row-parallel under TP (the product all-reduced first, as megatron)."""
        if not self._reduce:
            return products.add_linear(hidden, x, weight)
        out = products.linear(x, weight)
        torch.distributed.all_reduce(out, group=self._group)
        return hidden + out
