"""The trainer's numerics stages (profiler/numerics.py): which tensors the loops hand `profiler.check_numerics()` and how
the drafter's layers and its update are watched.

    target.pack_hidden  layer{id}      the packed hidden states, one stage per captured target layer
    drafter.unpack      hidden         the drafter's input after unpack
    drafter.fwd_bwd     layer{i}, loss each drafter layer's output (its MLP output, the residual's next addend), the loss
    drafter.optim       grad_norm      the gradient norm before clipping
    drafter.optim       update_ratio   ||w after - w before|| / ||w before|| of the step (jump=True), every
                                       UPDATE_EVERY-th sampled step (its weights copy is the costly part)

Statistics are taken at the steps ProfilerConfig.numerics_every samples; the drift fault's drafter point
(`drift@drafter.fwd_bwd`) is the first layer's output, scaled here by its forward hook.
"""
from __future__ import annotations

import torch

import profiler
from profiler.nonfinite import update_ratio


def layer_views(hidden: torch.Tensor, layer_ids: list, split: bool) -> dict:
    """{"layer{id}": the captured layer's part of the packed hidden states} (views, no copy): [K, N, H] split per
    layer, else [N, K*H] in column blocks."""
    if split:
        return {f"layer{lid}": hidden[i] for i, lid in enumerate(layer_ids)}
    width = hidden.shape[1] // len(layer_ids)
    return {f"layer{lid}": hidden[:, i * width:(i + 1) * width] for i, lid in enumerate(layer_ids)}


class LayerWatch:
    """Forward hooks on the drafter's decoder layers: the first one's output goes through the drift point
    (`profiler.corrupt("drafter.fwd_bwd", ..., kinds=("drift",))`), and at a sampled step each layer's MLP output
    is kept for `take()` (the last forward's, one per layer: an evaluation's forwards overwrite, never grow it)."""

    def __init__(self, layers):
        self._outputs: dict = {}
        self._handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, index: int):
        def hook(module, args, output):
            x, delta = output
            if index == 0:
                x = profiler.corrupt("drafter.fwd_bwd", x, kinds=("drift",))
                delta = profiler.corrupt("drafter.fwd_bwd", delta, kinds=("drift",))
            if profiler.numerics_due():
                self._outputs[f"layer{index}"] = delta.detach()
            return x, delta
        return hook

    def take(self) -> dict:
        """The layers' outputs kept since the last take ({} at an unsampled step)."""
        out, self._outputs = self._outputs, {}
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


UPDATE_EVERY = 10
"""The update ratio is taken at every UPDATE_EVERY-th step the profiler samples: it copies every trained weight
and reads them twice more (on an H100 with the 8B-shaped drafter, about 3% of a step each time it is taken)."""


class UpdateWatch:
    """The update-to-weight ratio of an optimizer step at a sampled step (every UPDATE_EVERY-th): `before(step)`
    copies the trained weights, `after(policy)` hands the ratio to `profiler.numerics` (no host sync)."""

    def __init__(self, params, every: int = UPDATE_EVERY):
        self._params = [p for p in params if p.requires_grad]
        self._before: list | None = None
        self.every = every

    def before(self, step: int) -> None:
        due = self._params and step % self.every == 0 and profiler.numerics_due()
        self._before = torch._foreach_mul([p.detach() for p in self._params], 1.0) if due else None

    def after(self, policy: str) -> None:
        if self._before is not None:
            ratio = update_ratio(self._before, [p.detach() for p in self._params])
            self._before = None
            profiler.check_numerics("drafter.optim", {"update_ratio": ratio}, jump=True, policy=policy)
