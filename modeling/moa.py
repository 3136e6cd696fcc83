"""Mixture of attention heads (MoA), a cross-head baseline (`cross_head_variant="moa"`).

Formulation (Zhang, Shen, Huang, Zhou, Rong and Xiong, "Mixture of Attention Heads: Selecting Attention Heads Per
Token", EMNLP 2022, arXiv:2210.05144): a router scores the `E` attention experts for each query token `t`,
`p_t = softmax(x_t W_r)`, keeps the top `k`, and the layer's output is the gated sum of the kept experts' outputs,
`y_t = sum_{i in top-k(p_t)} g_ti E_i(x_t)`, each expert an attention head with its own query and output projections.

Here the experts are the layer's own heads (`E = num_attention_heads`): head `i`'s query and its slice of the output
projection are expert `i`'s, and the keys and values are the layer's: the paper shares one key/value head among all
experts, which is a Llama-family config with `num_key_value_heads=1`; a multi-head layer gives each expert its own.
The gate is `g_ti = E p_ti` (the paper's `p_ti` times `E`, a constant the output projection absorbs), so that a
zero router (its start) with `k = E` computes exactly multi-head attention. With `k < E` (the paper's setting and the
default, half the heads) each token uses `k` heads from the start: no start is exact.

**Losses.** Each layer records, for the forward that just ran, the auxiliary loss of the reference implementation's
router: the load-balancing loss of the Switch Transformer, `E sum_i f_i P_i` (`f_i` the share of the `T k` selections
that went to expert `i`, `P_i` the mean router probability of expert `i`; 1 when balanced), weighted by
`moa_balance_loss_coef`, plus the router z-loss `mean_t (logsumexp_i x_t W_r)^2` weighted by `moa_z_loss_coef`. The
model reports their mean over layers as `aux_loss` in its output and adds it to `loss` (`report_router_losses`). Every token
counts, padding included, as in the reference code without a skip mask.

**Cost**: every head is computed and the unselected ones are gated to zero, so MoA costs what multi-head attention
costs plus the router; the paper's saving (computing only the selected heads) needs a gather kernel this
implementation does not have. It runs on every attention backend, with grouped-query attention and the KV cache.

Written for this project from the paper; this file imports only torch and transformers (remote-code payload).
"""

import torch
from torch import nn
from transformers import initialization as init
from transformers.utils import ModelOutput

from .attention_heads import CrossHeadModule


class HeadRouter(CrossHeadModule, nn.Module):
    """The router of one MoA layer: `weight` `(E, hidden)` (zero at the start), `top_k` heads per token, and the loss
    weights. `router_loss` holds the weighted auxiliary loss of the last forward (None before one). At each call it
    gates the layer's heads (`attended_output`); each model holding routers reports their loss
    (`prepare_model`), also through gradient checkpointing (`checkpointing_function`)."""

    def __init__(self, hidden_size: int, num_heads: int, top_k: int, balance_loss_coef: float, z_loss_coef: float):
        super().__init__()
        self.num_heads, self.top_k = num_heads, top_k
        self.balance_loss_coef, self.z_loss_coef = balance_loss_coef, z_loss_coef
        # A raw parameter, not nn.Linear, so that the host model's Linear init never overrides the zero start.
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size))
        self.router_loss: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config) -> "HeadRouter":
        heads = config.num_attention_heads
        return cls(
            config.hidden_size, heads, selected_heads(config), config.moa_balance_loss_coef, config.moa_z_loss_coef
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states` `(b, t, hidden)`, the query tokens -> the gates `(b, t, E)`: `E p_ti` for the `top_k`
        heads of token `t`, 0 for the others. Records `router_loss`."""
        # The softmax and the losses in at least float32: a half-precision logsumexp loses the z-loss.
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        logits = hidden_states.to(dtype) @ self.weight.to(dtype).T
        probabilities = logits.softmax(-1)
        kept, selected = probabilities.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probabilities).scatter(-1, selected, kept * self.num_heads)
        self.router_loss = self.balance_loss_coef * balance_loss(probabilities, selected) + (
            self.z_loss_coef * logits.logsumexp(-1).square().mean()
        )
        return gates.to(hidden_states.dtype)

    def attended_output(self, layer, output, hidden_states):
        return gate_heads(self, output, hidden_states)

    @classmethod
    def prepare_model(cls, model) -> None:
        report_router_losses(model)

    @classmethod
    def checkpointing_function(cls, checkpoint, layer):
        return checkpoint_carrying_router_losses(checkpoint, layer)


def selected_heads(config) -> int:
    """`k`: `config.moa_top_k`, or half the heads (rounded up) where it is None."""
    return config.moa_top_k or -(-config.num_attention_heads // 2)


def balance_loss(probabilities: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss `E sum_i f_i P_i` over every token of `probabilities` `(..., E)`,
    with `selected` `(..., k)` the heads each token kept."""
    experts = probabilities.shape[-1]
    counts = torch.zeros(experts, dtype=probabilities.dtype, device=probabilities.device)
    counts = counts.index_add(0, selected.flatten(), torch.ones_like(selected.flatten(), dtype=probabilities.dtype))
    shares = counts / selected.numel()
    mean_probabilities = probabilities.reshape(-1, experts).mean(0)
    return experts * (shares * mean_probabilities).sum()


def gate_heads(router: HeadRouter, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """`output` `(b, t, E, d_h)`, every head's attention output -> each head scaled by its gate (0: not selected)."""
    return output * router(hidden_states).unsqueeze(-1)


def init_moa(module: nn.Module, std: float) -> None:
    """Weight init for `HeadRouter`: zero, so that every head has the same probability at the start."""
    if isinstance(module, HeadRouter):
        init.zeros_(module.weight)  # transformers' guarded init: skips a weight loaded from a checkpoint


def model_router_loss(model: nn.Module) -> torch.Tensor | None:
    """The mean over `model`'s routers of the losses their last forward recorded (None: no router ran)."""
    losses = [module.router_loss for module in model.modules() if isinstance(module, HeadRouter)]
    losses = [loss for loss in losses if loss is not None]
    return torch.stack(losses).mean() if losses else None


def checkpoint_carrying_router_losses(checkpoint, layer: nn.Module):
    """`checkpoint` (the checkpointing function transformers gives `layer`) made to hand the router losses of `layer`
    out as outputs of the checkpointed function.

    Reentrant checkpointing runs the layer's first forward without autograd and keeps a graph only for the tensors the
    function returns; a loss the routers merely record would then carry no gradient, and the recomputation in the
    backward pass comes too late to count. As outputs, the losses get their gradient from the recomputation."""

    def checkpointed(function, *args, **kwargs):
        routers = [module for module in layer.modules() if isinstance(module, HeadRouter)]
        if not routers:
            return checkpoint(function, *args, **kwargs)
        layout = {}

        def layer_and_router_losses(*inner_args, **inner_kwargs):
            output = function(*inner_args, **inner_kwargs)
            layout["single"] = isinstance(output, torch.Tensor)
            outputs = (output,) if layout["single"] else tuple(output)
            layout["count"] = len(outputs)
            return (*outputs, *(router.router_loss for router in routers))

        results = checkpoint(layer_and_router_losses, *args, **kwargs)
        outputs = results[: layout["count"]]
        for router, loss in zip(routers, results[layout["count"] :], strict=True):
            router.router_loss = loss
        return outputs[0] if layout["single"] else tuple(outputs)

    return checkpointed


def report_router_losses(model: nn.Module) -> None:
    """Make `model` (a model class: a head, or the base model inside one) report its routers' loss from its forward:
    as the output's `aux_loss`, added to `loss` when there is one (labels were given), as transformers' mixture-of-experts
    models do; so the Trainer, which reads `loss`, trains with it.

    Forward hooks on this instance, registered once when the model is built: the model's class and its stock `forward`
    stay as they are. A base model inside a head reports too: it forgets only what its own routers recorded, before
    they run, and has no `loss` to add to, so the head's `loss` counts each layer once. Nothing is kept between calls but
    what the routers record, so the forward compiles into one graph."""
    if model.__dict__.get(_REPORTING):
        return
    model.register_forward_pre_hook(_forget_router_losses, with_kwargs=True)
    model.register_forward_hook(_report_router_loss, with_kwargs=True)
    setattr(model, _REPORTING, True)


# Set on a model whose forward reports its routers' loss; the other, while a forward runs, when the caller asked for the
# tuple layout (the loss is added to the named output, which is then laid out as the stock tuple).
_REPORTING, _AS_TUPLE = "reports_router_loss", "router_loss_caller_wants_tuple"


def _forget_router_losses(model: nn.Module, args: tuple, kwargs: dict):
    clear_router_losses(model)
    as_tuple = kwargs.get("return_dict") is False
    setattr(model, _AS_TUPLE, as_tuple)
    return (args, {**kwargs, "return_dict": True}) if as_tuple else None


def _report_router_loss(model: nn.Module, args: tuple, kwargs: dict, output):
    if not isinstance(output, ModelOutput):
        return None
    auxiliary_loss = model_router_loss(model)
    if auxiliary_loss is not None:
        if output.get("loss") is not None:
            output["loss"] = output["loss"] + auxiliary_loss.to(output["loss"].dtype)
        output["aux_loss"] = auxiliary_loss
    return output.to_tuple() if getattr(model, _AS_TUPLE, False) else output


def clear_router_losses(model: nn.Module) -> None:
    """Forget what `model`'s routers recorded, so that a router the next forward does not run (a PEFT wrapper's
    frozen original) is not counted."""
    for module in model.modules():
        if isinstance(module, HeadRouter):
            module.router_loss = None


__all__ = [
    "HeadRouter",
    "balance_loss",
    "checkpoint_carrying_router_losses",
    "gate_heads",
    "init_moa",
    "model_router_loss",
    "report_router_losses",
    "selected_heads",
]
