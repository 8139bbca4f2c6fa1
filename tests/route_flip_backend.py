"""A candidate that sends every token to the next expert over (a routing bug with correct kernels)."""

from torch import nn

from veosnap.reference.probes import find_moe_layers


def next_expert(model: nn.Module) -> nn.Module:
    for moe in find_moe_layers(model):

        def hook(_module, _inputs, output, n=moe.num_experts):  # noqa: ANN001, ANN202
            logits, weights, indices = output[0], output[1], output[2]
            return (logits, weights, (indices + 1) % n, *output[3:])

        moe.router.register_forward_hook(hook)
    return model
