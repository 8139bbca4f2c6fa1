"""Item 1: a candidate whose loss comes from hidden states and the LM head weight, no logits returned.

    veosnap check --model llama --dtype float32 --backend examples/veomni/repro/item1_no_logits.py:fused_loss

main: ERROR AttributeError: 'NoneType' object has no attribute 'detach' (at veosnap/capture.py:123):
capture evaluates `output.logits.detach()` as the default of `produced.get(...)` even when nothing
was produced. VeOmni's GPT-OSS does this with every ops config, every family with `chunk_loss`.
"""

import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutput


def fused_loss(model):
    def forward(input_ids=None, labels=None, **kwargs):
        hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = F.linear(hidden[:, :-1], model.lm_head.weight).float()  # inside the loss only, as chunked CE does
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=None)

    model.forward = forward
    return model
